"""kvtier's L2 adapter through LMCache 0.5.6's own objects: built by its plugin loader, fed its
ObjectKeys and TensorMemoryObjs, on real Redis. Every wait is on the adapter's event fds."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface

from connector.lmcache_l2.adapter import KvtierL2Adapter
from rigs.ports import free_port
from rigs.redis_server import RedisServer
from tests.lmcache.helpers import (
    key,
    load,
    lookup,
    make_adapter,
    memory_obj,
    redis_name,
    same_bytes,
    store,
    wait_fd,
)

CHUNK = 64 << 10  # bytes per chunk here (the benchmark uses LMCache's real 256-token chunk)


def test_lmcache_loads_it_by_name(adapter: Any) -> None:
    assert isinstance(adapter, KvtierL2Adapter) and isinstance(adapter, L2AdapterInterface)
    fds = {adapter.get_store_event_fd(), adapter.get_lookup_and_lock_event_fd(),
           adapter.get_load_event_fd()}
    assert len(fds) == 3  # LMCache routes events by fd
    assert adapter.report_status()["is_healthy"] is True


def test_stored_chunk_is_looked_up_locked_and_loaded_byte_exact(adapter: Any) -> None:
    keys = [key(i) for i in range(5)]
    objs = [memory_obj(CHUNK, seed=i) for i in range(5)]
    result = store(adapter, keys, objs)
    assert result.is_successful() and result.bytes_transferred() == 5 * CHUNK
    assert adapter.pop_completed_store_tasks() == {}  # handed out once

    absent = key(99)
    assert lookup(adapter, [*keys, absent]) == [True] * 5 + [False]
    assert adapter.counts()["lock_count"] == 5

    outs = [memory_obj(CHUNK) for _ in range(5)]
    assert load(adapter, keys, outs) == [True] * 5
    assert all(same_bytes(a, b) for a, b in zip(objs, outs, strict=True))
    adapter.submit_unlock(keys)
    counts = adapter.counts()
    assert (counts["locks"], counts["unlocks"], counts["lock_count"]) == (5, 5, 0)


def test_results_are_handed_out_once(adapter: Any) -> None:
    store(adapter, [key(1)], [memory_obj(CHUNK, seed=1)])
    task = adapter.submit_lookup_and_lock_task([key(1)], {})
    wait_fd(adapter.get_lookup_and_lock_event_fd())
    assert adapter.query_lookup_and_lock_result(task) is not None
    assert adapter.query_lookup_and_lock_result(task) is None
    task = adapter.submit_load_task([key(1)], [memory_obj(CHUNK)])
    wait_fd(adapter.get_load_event_fd())
    assert adapter.query_load_result(task) is not None
    assert adapter.query_load_result(task) is None
    assert adapter.query_load_result(12345) is None
    adapter.submit_unlock([key(1)])


def test_many_tasks_in_flight_each_complete(adapter: Any) -> None:
    keys = [key(i) for i in range(12)]
    objs = [memory_obj(CHUNK, seed=i) for i in range(12)]
    tasks = [adapter.submit_store_task(keys[i:i + 3], objs[i:i + 3]) for i in range(0, 12, 3)]
    done: dict[int, Any] = {}
    while len(done) < len(tasks):
        wait_fd(adapter.get_store_event_fd())
        done.update(adapter.pop_completed_store_tasks())
    assert sorted(done) == sorted(tasks) and all(r.is_successful() for r in done.values())
    outs = [memory_obj(CHUNK) for _ in keys]
    assert load(adapter, keys, outs) == [True] * 12  # split over the load threads
    assert all(same_bytes(a, b) for a, b in zip(objs, outs, strict=True))


# ---------------------------------------------------------------------------- misses
def _corrupt(raw: redis.Redis, name: bytes, how: str, foreign: bytes | None) -> None:
    value = raw.get(name)
    assert value is not None
    if how == "damaged":  # one payload bit flipped: header fine, checksum not
        i = len(value) - 100
        raw.set(name, value[:i] + bytes([value[i] ^ 0x01]) + value[i + 1:])
    elif how == "truncated":
        raw.set(name, value[: len(value) - 1000])
    else:  # another namespace's valid value under this key's name
        assert foreign is not None
        raw.set(name, foreign)


@pytest.mark.parametrize("how", ["damaged", "truncated", "other_model", "other_kv_rank",
                                 "other_cache_salt"])
def test_foreign_or_bad_values_are_counted_misses(adapter: Any, redis_url: str,
                                                  how: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    mine = key(7, salt="alice")
    other = {"other_model": key(7, model="Qwen/Qwen3-8B", salt="alice"),
             "other_kv_rank": key(7, kv_rank=1, salt="alice"),
             "other_cache_salt": key(7, salt="bob")}.get(how)
    obj = memory_obj(CHUNK, seed=7)
    assert store(adapter, [mine], [obj]).is_successful()
    foreign = None
    if other is not None:
        assert store(adapter, [other], [memory_obj(CHUNK, seed=8)]).is_successful()
        assert redis_name(adapter, other) != redis_name(adapter, mine)  # its own name
        foreign = raw.get(redis_name(adapter, other))
    _corrupt(raw, redis_name(adapter, mine), how, foreign)
    before = adapter.report_status()["tier"]["corrupt"]

    found = lookup(adapter, [mine])
    out = memory_obj(CHUNK)
    loaded = load(adapter, [mine], [out])
    if found[0]:  # only a damaged payload passes the header-only lookup
        assert how == "damaged"
        adapter.submit_unlock([mine])
    assert loaded == [False]  # LMCache drops a failed key's buffer: never served as KV
    assert adapter.report_status()["tier"]["corrupt"] > before
    # a value proven bad is deleted (while unchanged): the next lookup is a plain miss
    assert lookup(adapter, [mine]) == [False]


def test_load_into_a_buffer_of_another_size_is_a_miss(adapter: Any) -> None:
    obj = memory_obj(CHUNK, seed=3)
    store(adapter, [key(3)], [obj])
    assert load(adapter, [key(3)], [memory_obj(CHUNK // 2)]) == [False]
    assert lookup(adapter, [key(3)]) == [True]  # kept: valid for a reader of its size
    adapter.submit_unlock([key(3)])


# ---------------------------------------------------------------------------- Redis down
def _assert_every_task_fails_and_signals(adapter: Any) -> None:
    keys = [key(i) for i in range(3)]
    result = store(adapter, keys, [memory_obj(CHUNK, seed=i) for i in range(3)])
    assert not result.is_successful()
    assert lookup(adapter, keys) == [False] * 3
    assert load(adapter, keys, [memory_obj(CHUNK) for _ in keys]) == [False] * 3
    assert adapter.get_usage().total_bytes_used == 0
    assert adapter.report_status()["is_healthy"] is False


def test_redis_that_never_answered_fails_tasks_and_fires_fds(key_prefix: str) -> None:
    adapter = make_adapter({"redis_url": f"redis://127.0.0.1:{free_port()}/0",
                            "key_prefix": key_prefix, "redis_timeout_s": 0.5})
    try:
        _assert_every_task_fails_and_signals(adapter)
    finally:
        adapter.close()


def test_redis_killed_midway_fails_tasks_and_fires_fds(redis_server: RedisServer,
                                                       key_prefix: str) -> None:
    adapter = make_adapter({"redis_url": redis_server.url, "key_prefix": key_prefix,
                            "redis_timeout_s": 0.5})
    try:
        obj = memory_obj(CHUNK, seed=1)
        assert store(adapter, [key(100)], [obj]).is_successful()
        redis_server.kill()
        _assert_every_task_fails_and_signals_after_kill(adapter)
    finally:
        adapter.close()


def _assert_every_task_fails_and_signals_after_kill(adapter: Any) -> None:
    keys = [key(i) for i in range(3)]
    assert not store(adapter, keys, [memory_obj(CHUNK, seed=i) for i in range(3)]).is_successful()
    assert lookup(adapter, [key(100), *keys]) == [False] * 4
    assert load(adapter, [key(100)], [memory_obj(CHUNK)]) == [False]
    assert adapter.get_usage().total_bytes_used == CHUNK  # what was stored before the kill
    assert adapter.report_status()["is_healthy"] is False


def test_redis_paused_past_the_timeout_fails_tasks_and_fires_fds(redis_server: RedisServer,
                                                                 key_prefix: str) -> None:
    adapter = make_adapter({"redis_url": redis_server.url, "key_prefix": key_prefix,
                            "redis_timeout_s": 0.5})
    try:
        assert store(adapter, [key(1)], [memory_obj(CHUNK, seed=1)]).is_successful()
        redis_server.pause()
        try:
            assert lookup(adapter, [key(1)]) == [False]
            assert load(adapter, [key(1)], [memory_obj(CHUNK)]) == [False]
            assert not store(adapter, [key(2)], [memory_obj(CHUNK, seed=2)]).is_successful()
        finally:
            redis_server.resume()
    finally:
        adapter.close()


# ---------------------------------------------------------------------------- locks, delete
def test_locks_and_unlocks_balance(adapter: Any) -> None:
    keys = [key(i) for i in range(3)]
    store(adapter, keys, [memory_obj(CHUNK, seed=i) for i in range(3)])
    assert lookup(adapter, keys) == [True] * 3
    assert lookup(adapter, keys[:2]) == [True] * 2
    assert adapter.counts()["lock_count"] == 5
    adapter.submit_unlock(keys)
    assert adapter.counts()["lock_count"] == 2
    adapter.submit_unlock(keys[:2])
    adapter.submit_unlock([keys[0], key(42)])  # never locked: ignored, counted
    counts = adapter.counts()
    assert (counts["locks"], counts["unlocks"], counts["unmatched_unlocks"],
            counts["lock_count"], counts["locked_keys"]) == (5, 5, 2, 0, 0)


def test_delete_of_a_locked_key_waits_for_its_last_unlock(adapter: Any, redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    obj = memory_obj(CHUNK, seed=5)
    store(adapter, [key(5)], [obj])
    assert lookup(adapter, [key(5)]) == [True]  # locked: a load is planned
    adapter.delete([key(5)])
    assert adapter.get_usage().total_bytes_used == 0  # forgotten at once
    assert lookup(adapter, [key(5)]) == [False]  # no new lock on it
    out = memory_obj(CHUNK)
    assert load(adapter, [key(5)], [out]) == [True] and same_bytes(obj, out)  # the planned one
    assert raw.exists(redis_name(adapter, key(5)))
    adapter.submit_unlock([key(5)])  # queues the unlink on the store thread
    store(adapter, [key(6)], [memory_obj(CHUNK, seed=6)])  # that thread's next job
    assert not raw.exists(redis_name(adapter, key(5)))
    assert adapter.counts()["deletes_waiting_for_unlock"] == 0


def test_delete_of_an_unlocked_key_removes_it(adapter: Any, redis_url: str) -> None:
    raw = redis.Redis.from_url(redis_url)
    store(adapter, [key(6)], [memory_obj(CHUNK, seed=6)])
    adapter.delete([key(6), key(404)])
    assert not raw.exists(redis_name(adapter, key(6)))
    assert lookup(adapter, [key(6)]) == [False]


# ---------------------------------------------------------------------------- usage
def test_usage_matches_what_was_stored_and_deleted(adapter: Any) -> None:
    a1, a2, b1 = key(1, salt="alice"), key(2, salt="alice"), key(3, salt="bob")
    store(adapter, [a1, a2], [memory_obj(CHUNK, seed=1), memory_obj(2 * CHUNK, seed=2)])
    store(adapter, [b1], [memory_obj(CHUNK, seed=3)])
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 4 * CHUNK
    assert dict(usage.bytes_by_cache_salt) == {"alice": 3 * CHUNK, "bob": CHUNK}
    store(adapter, [a1], [memory_obj(CHUNK, seed=9)])  # a re-store counts once
    assert adapter.get_usage().total_bytes_used == 4 * CHUNK
    adapter.delete([a2, key(404)])
    usage = adapter.get_usage()
    assert usage.total_bytes_used == 2 * CHUNK
    assert dict(usage.bytes_by_cache_salt) == {"alice": CHUNK, "bob": CHUNK}
    adapter.delete([a1, b1])
    assert adapter.get_usage().total_bytes_used == 0
    assert dict(adapter.get_usage().bytes_by_cache_salt) == {}


def test_partly_failed_store_fails_the_task_and_counts_what_was_written(adapter: Any) -> None:
    good = key(1)
    bad = key(2, group=1 << 32)  # an object group id kvtier's header cannot hold
    result = store(adapter, [good, bad], [memory_obj(CHUNK, seed=1), memory_obj(CHUNK, seed=2)])
    assert not result.is_successful()
    assert adapter.get_usage().total_bytes_used == CHUNK
    assert lookup(adapter, [good]) == [True]
    adapter.submit_unlock([good])
    assert adapter.counts()["bad_keys"] >= 1


def test_capacity_is_reported_for_lmcache_eviction(adapter_factory: Any) -> None:
    adapter = adapter_factory(max_capacity_gb=1)
    assert adapter.supports_global_eviction
    store(adapter, [key(1)], [memory_obj(CHUNK, seed=1)])
    assert adapter.get_usage().usage_fraction == pytest.approx(CHUNK / (1 << 30))


# ---------------------------------------------------------------------------- listing
def test_list_l2_keys_pages_through_every_key_once(adapter: Any) -> None:
    keys = [key(i, salt="t1" if i % 2 else "") for i in range(23)]
    others = [key(i, model="Qwen/Qwen3-8B") for i in range(4)]
    store(adapter, keys + others, [memory_obj(CHUNK, seed=i) for i in range(27)])
    seen: list[Any] = []
    cursor = None
    while True:
        page = adapter.list_l2_keys(model_name="meta-llama/Llama-3.1-8B", page_size=5,
                                    cursor=cursor)
        assert len(page.entries) <= 5
        seen += page.entries
        cursor = page.next_page_token
        if cursor is None:
            break
    got = {(e.key.chunk_hash_hex, e.key.cache_salt, e.key.kv_rank) for e in seen}
    assert len(seen) == len(got) == 23
    assert got == {(k.chunk_hash.hex(), k.cache_salt, 0) for k in keys}
    assert {e.size_bytes for e in seen} == {CHUNK}
    assert len(adapter.list_l2_keys(page_size=1000).entries) == 27
    with pytest.raises(ValueError):
        adapter.list_l2_keys(page_size=0)
    with pytest.raises(ValueError):
        adapter.list_l2_keys(cursor="nonsense")


def test_a_new_adapter_lists_what_another_stored(adapter_factory: Any) -> None:
    first = adapter_factory()
    store(first, [key(1, salt="s")], [memory_obj(CHUNK, seed=1)])
    first.list_l2_keys()  # the registry write ran before (same control thread)
    second = adapter_factory()
    entries = second.list_l2_keys().entries
    assert [(e.key.model_name, e.key.cache_salt) for e in entries] == [
        ("meta-llama/Llama-3.1-8B", "s")]
    assert adapter_factory(namespace="weights-v2").list_l2_keys().entries == ()


# ---------------------------------------------------------------------------- credentials
def test_password_from_a_file_reaches_an_acl_redis(secret_redis: Any, key_prefix: str,
                                                  tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    secret = tmp_path / "redis-password"
    secret.write_text(secret_redis.user_password + "\n")
    secret.chmod(0o600)
    url = f"redis://127.0.0.1:{secret_redis.server.port}/0"
    adapter = make_adapter({"redis_url": url, "redis_username": "kvtier",
                            "redis_password_file": str(secret), "key_prefix": key_prefix})
    try:
        obj = memory_obj(CHUNK, seed=1)
        assert store(adapter, [key(1)], [obj]).is_successful()
        out = memory_obj(CHUNK)
        assert load(adapter, [key(1)], [out]) == [True] and same_bytes(obj, out)
        assert not secret_redis.found_in(str(adapter.report_status()) + caplog.text)
    finally:
        adapter.close()


def test_inline_password_is_refused_by_the_plugin_loader(key_prefix: str) -> None:
    with pytest.raises(ValueError, match="carries a password"):
        make_adapter({"redis_url": "redis://:hunter2@127.0.0.1:6379/0",
                      "key_prefix": key_prefix})


# ---------------------------------------------------------------------------- threads, close
def test_submit_never_runs_redis_io_on_the_callers_thread(adapter: Any,
                                                          redis_server: RedisServer,
                                                          key_prefix: str) -> None:
    paused = make_adapter({"redis_url": redis_server.url, "key_prefix": key_prefix,
                           "redis_timeout_s": 5.0})
    try:
        redis_server.pause()  # every Redis call now waits up to 5 s
        returned = threading.Event()

        def submit() -> None:
            paused.submit_lookup_and_lock_task([key(1)], {})
            paused.submit_load_task([key(1)], [memory_obj(CHUNK)])
            paused.submit_store_task([key(2)], [memory_obj(CHUNK, seed=2)])
            returned.set()

        caller = threading.Thread(target=submit)
        caller.start()
        assert returned.wait(1.0), "a submit blocked on Redis"
        redis_server.resume()
        wait_fd(paused.get_lookup_and_lock_event_fd())
        wait_fd(paused.get_load_event_fd())
        wait_fd(paused.get_store_event_fd())
        caller.join()
    finally:
        redis_server.resume()
        paused.close()


def test_close_completes_queued_tasks_and_is_idempotent(adapter_factory: Any) -> None:
    adapter = adapter_factory()
    keys = [key(i) for i in range(4)]
    store(adapter, keys, [memory_obj(CHUNK, seed=i) for i in range(4)])
    lookup_task = adapter.submit_lookup_and_lock_task(keys, {})
    load_task = adapter.submit_load_task(keys, [memory_obj(CHUNK) for _ in keys])
    adapter.close()
    assert adapter.query_lookup_and_lock_result(lookup_task) is not None
    assert adapter.query_load_result(load_task) is not None
    adapter.close()
    task = adapter.submit_load_task(keys[:1], [memory_obj(CHUNK)])  # after close: failed
    bitmap = adapter.query_load_result(task)
    assert bitmap is not None and not bitmap.test(0)

"""The daemon's Redis janitor against real Redis: exactly the unservable values go.

Valid values are written by offload_tiers (RedisTier.put_many); bad ones by hand. The
shared server (``key_prefix``) is used where other traffic does not matter; a server of the
test's own (``redis_server``) where it is paused, killed or its keyspace counted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from connector.daemon.config import ConfigError, load_config
from offload_tiers import codec
from offload_tiers.keys import BlockKey, BlockKind, Namespace, parse_key_name
from offload_tiers.redis.janitor import REASONS, Pacer, RedisJanitor, judge
from offload_tiers.redis.tier import RedisTier
from rigs.daemon_proc import REPO, DaemonProcess
from rigs.ports import free_port
from rigs.redis_server import RedisServer, SecretRedis

NS_A = Namespace("model-a", "float32", "nhd", 16)
NS_B = Namespace("model-b", "bfloat16", "nhd", 16, tenant="t1")
FP, FP_B = NS_A.fingerprint, NS_B.fingerprint


def bkey(i: int, *, ns: Namespace = NS_A, group: int = 0, partial: bool = False,
         fingerprint: str | None = None) -> BlockKey:
    kind = BlockKind.PARTIAL if partial else BlockKind.FULL
    return BlockKey(fingerprint or ns.fingerprint, group, i.to_bytes(8, "big"),
                    24 if partial else 32, kind)


def name(prefix: str, key: BlockKey) -> bytes:
    return f"{prefix}:{key.name}".encode()


def repack(value: bytes, **fields: Any) -> bytes:
    """``value`` with header fields replaced (magic, version, kind, digest, group, ...)."""
    order = ("magic", "version", "kind", "r1", "digest", "group", "num_tokens", "hash_tag",
             "length", "checksum", "save_id")
    vals = dict(zip(order, codec.HEADER.unpack_from(value, 0), strict=True))
    vals.update(fields)
    return codec.HEADER.pack(*(vals[k] for k in order)) + value[codec.HEADER_SIZE:]


def write_valid(url: str, prefix: str, client: Any = None) -> dict[bytes, bytes]:
    """Valid values of two namespaces, both groups, FULL and PARTIAL, empty to 1 MiB."""
    items = [(bkey(i), os.urandom(100 + i)) for i in range(20)]
    items += [(bkey(100 + i, ns=NS_B, group=1), os.urandom(50)) for i in range(10)]
    items += [(bkey(200 + i, partial=True), os.urandom(70)) for i in range(5)]
    items += [(bkey(300), b""), (bkey(301), os.urandom(1 << 20))]
    items += [(bkey(302, fingerprint=FP.upper()), b"upper-case fingerprint: still served")]
    with RedisTier.from_url(url, prefix=prefix, strict=True) as tier:
        assert tier.put_many(items) == len(items)
        # what a reader gets back is exactly what was written
        assert [bytes(v) for v in tier.get_many([k for k, _ in items])] == [p for _, p in items]
    client = client or redis.Redis.from_url(url)
    return {name(prefix, k): client.get(name(prefix, k)) for k, _ in items}


def write_bad(client: redis.Redis, prefix: str) -> dict[bytes, str]:
    """One or more values per reason; returns {key name: expected reason}."""
    good0 = codec.encode_bytes(bkey(500), b"p" * 40)
    bad: dict[bytes, str] = {}

    def put(key: BlockKey | str, value: bytes, reason: str) -> None:
        n = name(prefix, key) if isinstance(key, BlockKey) else f"{prefix}:{key}".encode()
        client.set(n, value)
        bad[n] = reason

    put(bkey(500), b"XXXX" + good0[4:], "bad_magic")
    put(bkey(501), repack(codec.encode_bytes(bkey(501), b"q" * 8), version=1), "bad_version")
    put(bkey(502), repack(codec.encode_bytes(bkey(502), b"q" * 8), kind=3), "bad_kind")
    put(bkey(503), codec.encode_bytes(bkey(503, ns=NS_B), b"q" * 8), "fingerprint_mismatch")
    put(bkey(504), codec.encode_bytes(bkey(504, group=1), b"q" * 8), "group_mismatch")
    put(bkey(505), codec.encode_bytes(bkey(999), b"q" * 8), "hash_mismatch")
    put(bkey(506), repack(codec.encode_bytes(bkey(506), b"q" * 8), num_tokens=0),
        "bad_num_tokens")
    put(bkey(507), codec.encode_bytes(bkey(507), b"q" * 8) + b"padding", "bad_length")
    put(bkey(508), codec.encode_bytes(bkey(508), b"q" * 8)[:-3], "bad_length")
    put(bkey(509), repack(codec.encode_bytes(bkey(509), b"q"), length=1 << 40), "bad_length")
    put(bkey(510), b"short", "truncated")
    put(bkey(511), b"", "truncated")
    put("junk", good0, "bad_key_name")
    put(f"{FP}:x:00", good0, "bad_key_name")
    put(f"{FP}:0:ABCDEF01", good0, "bad_key_name")  # RedisTier writes lower-case hex
    put(f"{FP}:007:00", good0, "bad_key_name")
    put(f"{FP[:30]}:0:00", good0, "bad_key_name")
    lst = name(prefix, bkey(512))
    client.rpush(lst, b"not a string")
    bad[lst] = "wrong_type"
    hsh = f"{prefix}:not-even-a-name".encode()
    client.hset(hsh, "f", "v")
    bad[hsh] = "bad_key_name"
    return bad


def keys_under(client: redis.Redis, pattern: str) -> set[bytes]:
    return set(client.scan_iter(match=pattern, count=1000))


def expected_counts(bad: dict[bytes, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for reason in bad.values():
        out[reason] = out.get(reason, 0) + 1
    return out


# --------------------------------------------------------------------------- pure logic


def test_judge_agrees_with_the_reader() -> None:
    """Every value judge() keeps, codec.check_header accepts for the key its name implies;
    every value it condemns, check_header rejects for every key with that name."""
    key = bkey(7)
    good = codec.encode_bytes(key, b"z" * 33)
    parsed = parse_key_name(key.name.encode())
    assert parsed is not None
    assert judge(parsed, good[:64], len(good)) is None
    codec.check_header(key, good[:64], total_len=len(good))
    variants = {
        "bad_magic": b"KVTA" + good[4:],
        "bad_version": repack(good, version=0),
        "bad_kind": repack(good, kind=3),
        "fingerprint_mismatch": repack(good, digest=NS_B.digest),
        "group_mismatch": repack(good, group=9),
        "hash_mismatch": repack(good, hash_tag=1),
        "bad_num_tokens": repack(good, num_tokens=0),
        "bad_length": good + b"x",
        "truncated": good[:63],
    }
    for reason, value in variants.items():
        assert judge(parsed, value[:64], len(value)) == reason
        for kind in (BlockKind.FULL, BlockKind.PARTIAL):
            for ntok in (1, 24, 32, 1 << 40):
                reader_key = BlockKey(key.fingerprint, key.group, key.block_hash, ntok, kind)
                with pytest.raises(codec.CorruptValue):
                    codec.check_header(reader_key, value[:64], total_len=len(value))
    # header fields no reader condemns (the pad byte, the save id) are not a reason to delete
    assert judge(parsed, repack(good, r1=7, save_id=9)[:64], len(good)) is None
    assert judge(parsed, repack(good, version=1)[:64], len(good)) == "bad_version"  # format 1
    assert judge(parsed, good[:64], len(good), frozenset({NS_B.digest})) == "retired_namespace"
    assert judge(parsed, good[:64], len(good), frozenset({NS_A.digest})) is None


class FakeClock:
    """Time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.on_sleep: Any = None

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> bool:
        self.sleeps.append(seconds)
        self.now += seconds
        if self.on_sleep is not None:
            self.on_sleep(self.now)
        return False


def test_pacer_never_runs_ahead_of_its_rate() -> None:
    clock = FakeClock()
    pacer = Pacer(50.0, clock, clock.sleep)
    spent = 0
    for n in [10] * 20 + [30, 1, 1, 45]:
        pacer.spend(n)
        assert spent <= 50.0 * clock.now + 1e-9  # work started before now fits the rate
        spent += n
    assert clock.now == pytest.approx((spent - 45) / 50.0)


# --------------------------------------------------------------------------- real Redis


def test_pass_deletes_exactly_the_unservable_values(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    valid = write_valid(redis_url, key_prefix)
    bad = write_bad(client, key_prefix)
    assert set(bad.values()) == set(REASONS) - {"retired_namespace"}  # own test below
    # not ours: a longer prefix nested under ours, and a sibling prefix
    nested = f"{key_prefix}:sub:{FP}:0:{'00' * 8}".encode()
    sibling = f"{key_prefix}x:junk".encode()
    client.set(nested, b"garbage of another deployment")
    client.set(sibling, b"garbage of another deployment")
    before = keys_under(client, f"{key_prefix}*")

    janitor = RedisJanitor(redis_url, key_prefix, scan_count=7)
    assert janitor.run_pass() is True
    s = janitor.stats()

    after = keys_under(client, f"{key_prefix}*")
    assert after == before - set(bad)
    assert set(valid) <= after and nested in after and sibling in after
    for k, v in valid.items():
        assert client.get(k) == v  # untouched, byte for byte
    assert s["deleted"] == expected_counts(bad)
    assert s["deleted_total"] == len(bad)
    assert s["keys_scanned"] == len(valid) + len(bad) + 1  # + the nested key
    assert s["nested_prefix_skipped"] == 1
    assert s["bytes_seen"] >= sum(len(v) for v in valid.values())
    assert (s["passes"], s["sweeps"], s["passes_failed"], s["errors"]) == (1, 1, 0, 0)
    assert s["available"] is True and s["changed_before_delete"] == 0

    # a second pass finds nothing more to do and the valid values are still served
    assert janitor.run_pass() is True
    assert janitor.stats()["deleted_total"] == len(bad)
    with RedisTier.from_url(redis_url, prefix=key_prefix) as tier:
        keys = [bkey(i) for i in range(20)]
        assert all(v is not None for v in tier.get_many(keys))
    janitor.stop()


def test_dry_run_counts_but_deletes_nothing(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    write_valid(redis_url, key_prefix)
    bad = write_bad(client, key_prefix)
    before = keys_under(client, f"{key_prefix}:*")
    janitor = RedisJanitor(redis_url, key_prefix, dry_run=True)
    assert janitor.run_pass()
    assert keys_under(client, f"{key_prefix}:*") == before
    s = janitor.stats()
    assert s["would_delete"] == expected_counts(bad) and s["deleted_total"] == 0


def test_allowed_fingerprints_retire_other_namespaces(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    valid = write_valid(redis_url, key_prefix)
    janitor = RedisJanitor(redis_url, key_prefix, allowed_fingerprints=[FP])
    assert janitor.run_pass()
    left = keys_under(client, f"{key_prefix}:*")
    assert left == {k for k in valid if FP_B.encode() not in k}
    assert janitor.stats()["deleted"] == {"retired_namespace": 10}


def test_glob_characters_in_the_prefix_match_literally(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    odd = f"{key_prefix}[a]*"
    neighbour = f"{key_prefix}a:junk".encode()  # what an unescaped MATCH 'x[a]*:*' would hit
    mine = f"{odd}:junk".encode()
    client.set(neighbour, b"x")
    client.set(mine, b"x")
    try:
        janitor = RedisJanitor(redis_url, odd)
        assert janitor.run_pass()
        assert client.exists(neighbour) == 1 and client.exists(mine) == 0
    finally:
        client.delete(neighbour, mine)


def test_value_replaced_by_a_good_one_before_the_delete_is_kept(redis_server: RedisServer,
                                                                key_prefix: str) -> None:
    """Judged bad, then a writer stores a good value: the conditional delete must keep it.

    A server of the test's own: on a shared one, SCAN may split the three keys over
    batches, and the second batch would judge the rewritten garbage afresh."""
    redis_url = redis_server.url
    client = redis.Redis.from_url(redis_url)
    k_str, k_list, k_bad2 = bkey(1), bkey(2), bkey(3)
    client.set(name(key_prefix, k_str), b"garbage that is long enough" * 4)
    client.rpush(name(key_prefix, k_list), b"x")
    client.set(name(key_prefix, k_bad2), b"garbage")
    good = {k: codec.encode_bytes(k, os.urandom(64)) for k in (k_str, k_list)}
    janitor = RedisJanitor(redis_url, key_prefix)
    original = janitor._delete

    def racing_delete(label: str, node: Any, doomed: list[Any]) -> list[bool]:
        for k, v in good.items():  # the writer wins the race for two of the three keys
            client.set(name(key_prefix, k), v)
        client.set(name(key_prefix, k_bad2), b"other garbage")  # still bad, but not the same
        return original(label, node, doomed)

    janitor._delete = racing_delete  # type: ignore[method-assign]
    assert janitor.run_pass()
    for k, v in good.items():
        assert client.get(name(key_prefix, k)) == v
    s = janitor.stats()
    assert s["deleted_total"] == 0 and s["changed_before_delete"] == 3
    janitor._delete = original  # type: ignore[method-assign]
    assert janitor.run_pass()  # the next pass judges the new garbage afresh
    assert client.exists(name(key_prefix, k_bad2)) == 0
    assert janitor.stats()["deleted"] == {"truncated": 1}
    assert all(client.get(name(key_prefix, k)) == v for k, v in good.items())


def test_concurrent_writer_never_loses_a_good_value(redis_url: str, key_prefix: str) -> None:
    """A writer flips keys bad -> good while passes run back to back; the good value it
    stored last is always there at the end (the janitor only ever removes bad ones)."""
    client = redis.Redis.from_url(redis_url)
    keys = [bkey(i) for i in range(40)]
    good = {name(key_prefix, k): codec.encode_bytes(k, os.urandom(32)) for k in keys}
    stop = threading.Event()
    janitor = RedisJanitor(redis_url, key_prefix, scan_count=10, max_keys_per_s=1e9)
    finished = threading.Condition()
    done = [0]  # passes finished by the thread below
    errors: list[BaseException] = []

    def passes() -> None:
        try:
            while not stop.is_set():
                janitor.run_pass()
                with finished:
                    done[0] += 1
                    finished.notify_all()
        except BaseException as exc:  # re-raised by the test below
            errors.append(exc)
            with finished:
                finished.notify_all()

    def wait_passes_after(seen: int, more: int) -> None:
        """Block until ``more`` passes finished after ``seen`` (a deadline, not a window)."""
        with finished:
            ok = finished.wait_for(lambda: errors or done[0] >= seen + more, timeout=30)
        assert not errors, errors
        assert ok, f"janitor passes stalled at {done[0]}"

    t = threading.Thread(target=passes)
    t.start()
    lost = 0
    try:
        wclient = redis.Redis.from_url(redis_url)
        for _ in range(30):
            pipe = wclient.pipeline(transaction=False)
            for n, v in good.items():
                pipe.set(n, v[:40])  # truncated: bad
            pipe.execute()
            pipe = wclient.pipeline(transaction=False)
            for n, v in good.items():
                pipe.set(n, v)
            pipe.execute()
            with finished:
                seen = done[0]
            # Every pass that could have judged a bad value started before the good ones
            # were written, so it has finished (its deletes landed) once one more has.
            wait_passes_after(seen, 1)
            now = wclient.mget(list(good))
            lost += sum(got != v for got, v in zip(now, good.values(), strict=True))
        with finished:
            seen = done[0]
        wait_passes_after(seen, 2)  # passes over the good values only
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors
    # Printed for RELIABILITY.md: what the race costs a plain UNLINK (run the mutant by hand:
    # KVTIER_MUTANT=janitor-plain-unlink pytest -p tests.mutants.apply -s ... -k concurrent).
    print(f"\nKVTIER-JANITOR-RACE lost {lost} of {30 * len(good)} good writes")
    assert lost == 0  # a good value stored after a bad one was never deleted
    assert janitor.run_pass()
    assert {n: client.get(n) for n in good} == good
    s = janitor.stats()
    assert s["passes"] >= 3 and s["errors"] == 0
    assert set(s["deleted"]) <= {"bad_length", "truncated"}


# --------------------------------------------------------------------------- pacing


def fill(server: RedisServer, prefix: str, n: int) -> None:
    with RedisTier.from_url(server.url, prefix=prefix, strict=True) as tier:
        assert tier.put_many([(bkey(i), b"v" * 16) for i in range(n)]) == n


def test_scan_is_paced_to_max_keys_per_s(redis_server: RedisServer) -> None:
    fill(redis_server, "kv", 500)
    clock = FakeClock()
    janitor = RedisJanitor(redis_server.url, "kv", scan_count=20, max_keys_per_s=100.0,
                           clock=clock, sleep=clock.sleep)
    seen: list[tuple[float, int]] = []
    clock.on_sleep = lambda now: seen.append((now, janitor.stats()["keys_examined_budget"]))
    assert janitor.run_pass()
    s = janitor.stats()
    assert s["keys_scanned"] == 500 and s["sweeps"] == 1
    # every SCAN started only once the keys examined before it fit in 100 keys/s
    assert seen and all(examined <= 100.0 * now + 1e-6 for now, examined in seen)
    assert clock.now == pytest.approx((s["scan_calls"] - 1) * 20 / 100.0)
    assert s["keys_examined_budget"] == s["scan_calls"] * 20


def test_max_keys_per_pass_cuts_and_resumes(redis_server: RedisServer) -> None:
    fill(redis_server, "kv", 250)
    janitor = RedisJanitor(redis_server.url, "kv", scan_count=30, max_keys_per_pass=100,
                           max_keys_per_s=1e9)
    per_pass, sweeps = [], []
    for _ in range(4):
        assert janitor.run_pass()
        s = janitor.stats()
        per_pass.append(s["last_pass_keys"])
        sweeps.append(s["sweeps"])
    assert per_pass == [100, 100, 50, 100]
    assert sweeps == [0, 0, 1, 1]
    assert janitor.stats()["keys_scanned"] == 350


# --------------------------------------------------------------------------- Redis down


@pytest.mark.parametrize("fault", ["pause", "kill"])
def test_redis_down_mid_pass_is_counted_and_recovers(redis_server: RedisServer,
                                                     fault: str) -> None:
    fill(redis_server, "kv", 200)
    redis_server.client().set(b"kv:junk", b"x")
    clock = FakeClock()
    janitor = RedisJanitor(redis_server.url, "kv", scan_count=10, max_keys_per_s=10.0,
                           redis_timeout_s=0.5, clock=clock, sleep=clock.sleep)
    calls = {"n": 0}

    def break_on_third(now: float) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            redis_server.pause() if fault == "pause" else redis_server.kill()

    clock.on_sleep = break_on_third
    assert janitor.run_pass() is False  # no exception, just a failed pass
    s = janitor.stats()
    assert s["available"] is False and s["errors"] >= 1 and s["passes_failed"] == 1
    assert s["unavailable_events"] == 1 and s["passes"] == 0
    assert "password" not in s["last_error"].lower()
    assert janitor.run_pass() is False  # still down: counted again, still no exception
    clock.on_sleep = None
    if fault == "pause":
        redis_server.resume()
    else:
        redis_server.start()
        fill(redis_server, "kv", 200)
        redis_server.client().set(b"kv:junk", b"x")
    assert janitor.run_pass() is True
    s = janitor.stats()
    assert s["available"] is True and s["recoveries"] == 1 and s["passes_failed"] == 2
    assert redis_server.client().exists(b"kv:junk") == 0
    assert len(redis_server.client().keys(b"kv:*")) == 200


def test_background_thread_backs_off_while_down_and_stops(redis_server: RedisServer) -> None:
    janitor = RedisJanitor(redis_server.url, "kv", interval_s=0.05, redis_timeout_s=0.3,
                           backoff_initial_s=0.05)
    redis_server.kill()
    janitor.start()
    deadline = time.monotonic() + 20
    while janitor.stats()["passes_failed"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert janitor.running and janitor.stats()["passes_failed"] >= 2
    redis_server.start()
    while janitor.stats()["passes"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert janitor.stats()["available"] is True
    janitor.stop()
    assert not janitor.running


# --------------------------------------------------------------------------- config + daemon


def test_config_keys_and_errors() -> None:
    base = {"publishers": [{"endpoint": "tcp://*:5557"}]}
    cfg = load_config(None, dict(base))
    assert cfg.redis_url is None and cfg.janitor_dry_run is False
    with pytest.raises(ConfigError, match=r"redis_url: unsupported.*u:\*\*\*@h") as exc:
        load_config(None, {**base, "redis_url": "http://u:topsecret@h:1"})
    assert "topsecret" not in str(exc.value)
    with pytest.raises(ConfigError, match="janitor_allowed_fingerprints"):
        load_config(None, {**base, "redis_url": "redis://h", "janitor_allowed_fingerprints":
                           ["nothex"]})
    with pytest.raises(ConfigError, match="needs redis_url"):
        load_config(None, {**base, "janitor_allowed_fingerprints": [FP]})
    with pytest.raises(ConfigError, match="janitor_max_keys_per_s"):
        load_config(None, {**base, "redis_url": "redis://h", "janitor_max_keys_per_s": 0})
    example = load_config(REPO / "configs" / "daemon.yaml", {})
    assert example.redis_url is None  # the example config keeps the janitor off


def test_redis_timeout_s_and_its_deprecated_name(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    base = {"publishers": [{"endpoint": "tcp://*:5557"}]}
    assert load_config(None, base).redis_timeout_s == 2.0
    assert load_config(None, {**base, "redis_timeout_s": 0.5}).redis_timeout_s == 0.5
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({**base, "redis_socket_timeout_s": 0.7}))
    with caplog.at_level(logging.WARNING, logger="connector.daemon.config"):
        assert load_config(old, {}).redis_timeout_s == 0.7  # an existing YAML keeps working
    assert "redis_socket_timeout_s is deprecated" in caplog.text
    with pytest.raises(ConfigError, match="redis_socket_timeout_s"):
        load_config(None, {**base, "redis_socket_timeout_s": 0})


class KvtierDaemon(DaemonProcess):
    """The daemon started as the user starts it: ``kvtier daemon ...``."""

    def command(self) -> list[str]:
        exe = shutil.which("kvtier", path=str(Path(os.sys.executable).parent))
        assert exe is not None, "the kvtier console script is not installed in this venv"
        return [exe, "daemon", *self.args]


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{line_start} not in /metrics")


@pytest.fixture
def pw_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis-pw", password="s3cret-Janitor-pw").start()
    yield server
    server.stop()


def test_daemon_process_cleans_reports_and_survives_redis_down(pw_server: RedisServer,
                                                               tmp_path: Path) -> None:
    client = pw_server.client()
    valid = write_valid(pw_server.url, "kvtier")
    bad = write_bad(client, "kvtier")
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(yaml.safe_dump({"redis_timeout_s": 0.5}))
    d = KvtierDaemon("--config", str(cfg), "--endpoint", f"tcp://*:{free_port()}",
                     "--no-replay-on-start", "--redis-url", pw_server.url,
                     "--janitor-interval", "0.2", "--janitor-max-keys-per-s", "100000").start()
    try:
        d.wait_for(lambda s: s["janitor"]["passes"] >= 1, what="a janitor pass")
        assert set(client.keys(b"kvtier:*")) == set(valid)
        text = d.get("/metrics")
        for reason, n in expected_counts(bad).items():
            assert metric(text, f'kvtier_daemon_janitor_deleted_total{{reason="{reason}"}}') == n
        assert metric(text, "kvtier_daemon_janitor_keys_scanned_total") >= len(valid) + len(bad)
        assert metric(text, "kvtier_daemon_janitor_bytes_seen_total") >= 1 << 20
        assert metric(text, "kvtier_daemon_janitor_redis_up") == 1
        assert metric(text, 'kvtier_daemon_janitor_passes_total{result="ok"}') >= 1

        pw_server.pause()  # Redis stops answering: the daemon keeps serving
        d.wait_for(lambda s: not s["janitor"]["available"], what="janitor sees Redis down")
        assert d.get("/healthz")["status"] == "ok"
        assert d.lookup([1, 2, 3])["any"]["tokens"] == 0
        text = d.get("/metrics")
        assert metric(text, "kvtier_daemon_janitor_redis_up") == 0
        assert metric(text, "kvtier_daemon_janitor_errors_total") >= 1
        pw_server.resume()
        s = d.wait_for(lambda s: s["janitor"]["available"], what="janitor recovers")
        assert s["janitor"]["recoveries"] >= 1
        stats_text = str(s) + d.get("/metrics")
    finally:
        if pw_server.proc is not None:
            os.kill(pw_server.proc.pid, signal.SIGCONT)
        code = d.terminate()
    assert code == 0
    assert pw_server.password not in stats_text
    assert pw_server.password not in d.output.decode()
    assert "redis://:***@127.0.0.1" in d.output.decode()
    # A password on the command line is visible to every user (ps): said once, at start.
    assert d.output.decode().count("carries a password") == 1


@pytest.mark.parametrize("how", ["url_env", "password_file"])
def test_daemon_credentials_from_the_environment_or_a_file_never_in_clear(
        how: str, secret_redis: SecretRedis, tmp_path: Path) -> None:
    """The janitor reaches a password-protected Redis as an ACL user whose URL is in an
    environment variable, or whose password is in a private file: it deletes the bad
    values, and neither password is in the daemon's output, /stats or /metrics."""
    prefix = f"kvtier-cred-{how}"
    client = redis.Redis.from_url(secret_redis.admin_url)
    valid = write_valid(secret_redis.admin_url, prefix)
    bad = write_bad(client, prefix)
    if how == "url_env":
        args, env = ["--redis-url-env", "KVTIER_TEST_JANITOR_URL"], {
            "KVTIER_TEST_JANITOR_URL": secret_redis.user_url}
    else:
        password_file = tmp_path / "redis-password"
        password_file.write_text(secret_redis.user_password + "\n")
        password_file.chmod(0o600)
        args, env = ["--redis-url", f"redis://127.0.0.1:{secret_redis.server.port}/0",
                     "--redis-username", "kvtier",
                     "--redis-password-file", str(password_file)], {}
    d = KvtierDaemon("--endpoint", f"tcp://*:{free_port()}", "--no-replay-on-start",
                     "--redis-prefix", prefix, *args, "--janitor-interval", "0.2",
                     "--janitor-max-keys-per-s", "100000", env=env).start()
    try:
        s = d.wait_for(lambda s: s["janitor"]["passes"] >= 1, what="a janitor pass")
        seen = json.dumps(s) + d.get("/metrics")
    finally:
        assert d.terminate() == 0
    assert bad and set(client.keys(f"{prefix}:*".encode())) == set(valid)  # bad ones gone
    output = d.output.decode()
    assert secret_redis.found_in(seen + output) == []
    assert "carries a password" not in output


def test_daemon_with_wrong_password_counts_errors_never_leaks_it(pw_server: RedisServer) -> None:
    wrong = "Wr0ng-Pass-Word-42"
    url = f"redis://default:{wrong}@127.0.0.1:{pw_server.port}/0"
    d = DaemonProcess("--endpoint", f"tcp://*:{free_port()}", "--no-replay-on-start",
                      "--redis-url", url, "--janitor-interval", "0.2").start()
    try:
        s = d.wait_for(lambda s: s["janitor"]["passes_failed"] >= 1, what="a failed pass")
        assert "authentication" in s["janitor"]["last_error"].lower() or \
            "password" in s["janitor"]["last_error"].lower()
        text = d.get("/metrics")
        assert metric(text, "kvtier_daemon_janitor_redis_up") == 0
        assert d.get("/healthz")["status"] == "ok"
        seen = str(d.stats()) + text
    finally:
        assert d.terminate() == 0
    assert wrong not in seen and wrong not in d.output.decode()


def test_daemon_without_redis_url_has_no_janitor() -> None:
    d = DaemonProcess("--endpoint", f"tcp://*:{free_port()}", "--no-replay-on-start").start()
    try:
        assert "janitor" not in d.stats()
        assert "kvtier_daemon_janitor" not in d.get("/metrics")
    finally:
        assert d.terminate() == 0



def test_scripts_refused_by_acl_fall_back_to_watch(redis_server: RedisServer) -> None:
    """A user without @scripting (common on managed Redis): same conditional deletes, by
    WATCH/MULTI; a value replaced by a good one meanwhile is still kept."""
    c = redis_server.client()
    c.execute_command("ACL", "SETUSER", "janitor", "on", ">jan-pw", "~*", "+@all",
                      "-@scripting")
    fill(redis_server, "kv", 20)
    c.set(name("kv", bkey(900)), b"garbage")
    c.rpush(name("kv", bkey(901)), b"x")
    c.set(b"kv:junk", b"x")
    c.set(name("kv", bkey(902)), b"garbage too")
    good = codec.encode_bytes(bkey(902), b"good")
    janitor = RedisJanitor(f"redis://janitor:jan-pw@127.0.0.1:{redis_server.port}/0", "kv")
    original = janitor._delete

    def racing_delete(label: str, node: Any, doomed: list[Any]) -> list[bool]:
        c.set(name("kv", bkey(902)), good)
        return original(label, node, doomed)

    janitor._delete = racing_delete  # type: ignore[method-assign]
    assert janitor.run_pass()
    s = janitor.stats()
    assert s["delete_method"] == "watch" and s["errors"] == 0 and s["available"]
    assert s["deleted"] == {"truncated": 1, "wrong_type": 1, "bad_key_name": 1}
    assert s["changed_before_delete"] == 1
    assert c.get(name("kv", bkey(902))) == good
    assert len(c.keys(b"kv:*")) == 21
    assert "jan-pw" not in str(s)


@pytest.mark.slow
def test_cluster_every_master_is_walked(tmp_path: Path) -> None:
    from redis.cluster import RedisCluster

    from tests.support.redis_cluster import RedisClusterProcs

    cluster = RedisClusterProcs(tmp_path / "cluster").start()
    try:
        client = RedisCluster(host="127.0.0.1", port=cluster.servers[0].port)
        valid = write_valid(cluster.url, "kvc", client)
        bad = write_bad(client, "kvc")
        per_node = cluster.total_keys("kvc:*")
        assert sum(per_node.values()) == len(valid) + len(bad)
        assert all(n > 0 for n in per_node.values())  # spread over the 3 masters
        janitor = RedisJanitor(cluster.url, "kvc", scan_count=5)
        assert janitor.run_pass()
        s = janitor.stats()
        assert s["deleted"] == expected_counts(bad) and s["sweeps"] == 1
        assert sum(cluster.total_keys("kvc:*").values()) == len(valid)
        assert {k: client.get(k) for k in valid} == valid
        janitor.stop()
    finally:
        cluster.stop()


def _with_password(url: str) -> tuple[str, str]:
    """``url`` with a password in it, and that password (the default user of a server
    without one accepts any: then the password is only there to be kept secret)."""
    password = redis.connection.parse_url(url).get("password")
    if password:
        return url, password
    password = "Janitor-Pw-5e1d"
    scheme, rest = url.split("://", 1)
    return f"{scheme}://default:{password}@{rest}", password


def test_vanished_keys_and_internal_errors_are_counted(redis_url: str, key_prefix: str,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    client = redis.Redis.from_url(redis_url)
    k = name(key_prefix, bkey(1))
    client.set(k, b"")  # empty string: judged truncated, deleted
    url, password = _with_password(redis_url)
    janitor = RedisJanitor(url, key_prefix)
    assert janitor.run_pass() and janitor.stats()["deleted"] == {"truncated": 1}
    client.set(k, b"bad")
    original = janitor._delete

    def expire_first(label: str, node: Any, doomed: list[Any]) -> list[bool]:
        client.delete(k)  # expired / removed by the connector meanwhile
        return original(label, node, doomed)

    janitor._delete = expire_first  # type: ignore[method-assign]
    assert janitor.run_pass()
    s = janitor.stats()
    assert s["changed_before_delete"] == 1 and s["deleted_total"] == 1  # gone, not by us
    client.set(k, b"bad")

    def bug(*_a: Any, **_kw: Any) -> None:  # a bug inside a pass, the password in its text
        raise ZeroDivisionError(f"bug while judging a value from {url}")

    monkeypatch.setattr("offload_tiers.redis.janitor.judge", bug)
    with caplog.at_level(logging.ERROR, logger="offload_tiers.redis.janitor"):
        assert janitor.run_pass() is False  # counted, never raised
    s = janitor.stats()
    assert s["passes_failed"] == 1 and "ZeroDivisionError" in s["last_error"]
    assert client.get(k) == b"bad"
    (record,) = [r for r in caplog.records if "pass failed" in r.getMessage()]
    logged = record.getMessage()  # the traceback, scrubbed
    assert "Traceback" in logged and "ZeroDivisionError" in logged and "***" in logged
    assert password not in logged and password not in s["last_error"]


def test_tls_with_acl_user_cleans_and_an_untrusted_ca_is_an_error(tmp_path: Path) -> None:
    from tests.support.redis_tls import start_tls_server
    from tests.support.tls_certs import make_tls_files

    files = make_tls_files(tmp_path / "tls")
    server, tls_port = start_tls_server(tmp_path / "tls-redis", files)
    try:
        c = server.client()
        c.execute_command("ACL", "SETUSER", "jan", "on", ">tls-Secret-1", "~kv:*", "+@all")
        fill(server, "kv", 10)
        c.set(b"kv:junk", b"x")
        url = f"rediss://jan:tls-Secret-1@127.0.0.1:{tls_port}/0"
        janitor = RedisJanitor(url, "kv", ssl_ca_certs=str(files.ca_cert))
        assert janitor.run_pass()
        assert janitor.stats()["deleted"] == {"bad_key_name": 1}
        assert len(c.keys(b"kv:*")) == 10
        untrusted = RedisJanitor(url, "kv", ssl_ca_certs=str(files.other_ca_cert))
        assert untrusted.run_pass() is False
        s = untrusted.stats()
        assert s["errors"] == 1 and not s["available"] and "tls-Secret-1" not in str(s)
        assert s["url"] == f"rediss://jan:***@127.0.0.1:{tls_port}/0"
    finally:
        server.stop()

"""kvtier's Redis tier driven through vLLM's own TieringOffloadingManager, on the CPU.

The manager is built the way vLLM builds it: ``TieringOffloadingSpec(config).get_manager()``
loads the tier by ``type`` + ``module_path`` through ``SecondaryTierFactory``, with the
engine's real ``VllmConfig`` (the tiny Llama's, built once) current, as the tier needs it for
its identity. The test plays the GPU side: it writes each chunk's bytes into the primary
tier's row (as the worker's GPU->CPU copy would) and completes the store; the manager
cascades to the Redis tier. Synchronisation is the tier's own contract: ``wait_for_jobs()``
returns once every submitted job's result is available (``drain_jobs()`` does too, and moves
the generation: it is vLLM's connector-cache reset); an existence check is awaited with a
deadline on its result.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from vllm.config import set_current_vllm_config
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from connector.native_tier.config import NativeTierConfigError
from connector.native_tier.namespace import NativeTierIdentityError
from connector.native_tier.tier import KvtierRedisTier
from connector.native_tier.vllm_api import HAS_DEFERRED_RELEASE, manager_lock
from offload_tiers import codec

BLOCK_BYTES = 8192  # worker KV bytes per block: one page-aligned chunk row
TOKENS = 32
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_ids = itertools.count()


@pytest.fixture(scope="module")
def base_config(tiny_llama_dir: Path) -> Any:
    """The tiny Llama's real ``VllmConfig`` (what vLLM hands its OffloadingConnector)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    model = ModelConfig(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True,
                        max_model_len=1024)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=TOKENS),
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="OffloadingConnector", kv_role="kv_both",
                          engine_id="kvtier-test-base"))


def engine_config(base: Any, *, model: str | None = None, revision: str | None = None,
                  dtype: Any = None, kv_cache_dtype: str | None = None,
                  quantization: str | None = None, tp_size: int | None = None) -> Any:
    """A copy of ``base`` for another engine (its own ``engine_id``), settings changed as
    ``vllm serve`` flags would change them."""
    config = copy.deepcopy(base)
    config.kv_transfer_config.engine_id = f"kvtier-test-{uuid.uuid4().hex[:10]}"
    for obj, name, value in ((config.model_config, "model", model),
                             (config.model_config, "revision", revision),
                             (config.model_config, "dtype", dtype),
                             (config.cache_config, "cache_dtype", kv_cache_dtype),
                             (config.model_config, "quantization", quantization),
                             (config.parallel_config, "tensor_parallel_size", tp_size)):
        if value is not None:
            setattr(obj, name, value)
    return config


def make_spec(redis_url: str, prefix: str, vllm_config: Any, *, chunks: int = 4,
              events: bool = True, **tier: Any) -> TieringOffloadingSpec:
    """The spec vLLM's ``build_offloading_config`` would make for ``vllm_config``."""
    entry = {"type": "KvtierRedisTier", "module_path": "connector.native_tier.tier",
             "redis_url": redis_url, "redis_prefix": prefix, **tier}
    model, cache = vllm_config.model_config, vllm_config.cache_config
    kv_dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=("l0", "l1"),
                                      group_id=0),),
        worker_kv_bytes_per_block=BLOCK_BYTES, enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": chunks * BLOCK_BYTES, "secondary_tiers": [entry]},
        engine_id=vllm_config.kv_transfer_config.engine_id,
        model=OffloadingModelConfig(name=model.model,
                                    dtype=str(kv_dtype).removeprefix("torch.")),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=tp_size, tp_size=tp_size, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=True))
    return TieringOffloadingSpec(config)


class Engine:
    """One TieringOffloadingManager with kvtier's tier, and the test playing the GPU."""

    def __init__(self, spec: TieringOffloadingSpec, vllm_config: Any) -> None:
        self.spec = spec
        with set_current_vllm_config(vllm_config):
            self.manager = spec.get_manager()
        self.tier: KvtierRedisTier = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview())

    def locked(self) -> Any:
        """The manager's lock (vLLM >= 0.33: every caller holds it; 0.32: a no-op)."""
        return manager_lock(self.manager)

    def request(self, keys: list[OffloadKey]) -> ReqContext:
        ctx = ReqContext(req_id=f"req-{next(_ids)}")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, (i + 1) * TOKENS)
        with self.locked():
            self.manager.on_new_request(ctx)
        return ctx

    def store(self, ctx: ReqContext, keys: list[OffloadKey]) -> None:
        with self.locked():
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None
            for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                self.rows[cid] = pattern(key)  # the worker's GPU->CPU copy
            self.manager.complete_store(out.keys_to_store, ctx)
        self.settle()

    def settle(self) -> None:
        """Let every submitted job finish and the manager take the results."""
        with self.locked():
            self.manager.on_schedule_end(STEP)
        self.tier.wait_for_jobs()
        with self.locked():
            self.manager.on_schedule_end(STEP)

    def lookup(self, key: OffloadKey, ctx: ReqContext, timeout: float = 60.0) -> LookupResult:
        """A look-up asked again, step after step, until it is no longer RETRY."""
        deadline = time.monotonic() + timeout
        while True:
            with self.locked():
                result = self.manager.lookup(key, ctx)
                if result is not LookupResult.RETRY or time.monotonic() > deadline:
                    return result
                self.manager.on_schedule_end(STEP)
            time.sleep(0.002)  # poll on the result, bounded by the deadline

    def fetch(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """Look up; on a secondary hit let the promotion run; then the primary's answer."""
        result = self.lookup(key, ctx)
        if result is LookupResult.HIT_PENDING:
            self.settle()
            with self.locked():
                result = self.manager.lookup(key, ctx)
        return result

    def primary_bytes(self, key: OffloadKey, ctx: ReqContext) -> bytes:
        with self.locked():
            spec = self.manager.prepare_load([key], ctx)
            data = self.rows[spec.chunk_ids[0]].tobytes()
            self.manager.complete_load([key], ctx)
        return data

    def finish(self, ctx: ReqContext) -> None:
        with self.locked():
            self.manager.on_request_finished(ctx)

    def reset(self) -> None:
        """The connector-cache reset as vLLM's scheduler makes it: ``reset_cache()``, then
        (vLLM >= 0.33, no worker job in flight here) ``on_reset_flushed()``, which releases
        the promotions the reset holds back."""
        with self.locked():
            self.manager.reset_cache()
            flushed = getattr(self.manager, "on_reset_flushed", None)
            if flushed is not None:
                flushed()

    def close(self) -> None:
        if self.spec._manager is not None and not getattr(self, "closed", False):
            self.closed = True
            self.rows = None  # the primary region is unmapped on shutdown
            self.manager.shutdown()

    def lookup_all(self, keys: list[OffloadKey], ctx: ReqContext,
                   timeout: float = 60.0) -> list[LookupResult]:
        """All keys looked up in one step, as the scheduler does, until none is RETRY."""
        deadline = time.monotonic() + timeout
        while True:
            with self.locked():
                results = [self.manager.lookup(k, ctx) for k in keys]
                if LookupResult.RETRY not in results or time.monotonic() > deadline:
                    return results
                self.manager.on_schedule_end(STEP)
            time.sleep(0.002)  # poll on the results, bounded by the deadline


def pattern(key: OffloadKey) -> np.ndarray:
    seed = int.from_bytes(key[:8], "big") % (2**32)
    return np.random.default_rng(seed).integers(-128, 127, BLOCK_BYTES, dtype=np.int8)


def chain(n: int, salt: str = "") -> list[OffloadKey]:
    base = uuid.uuid4().bytes + salt.encode()
    return [make_offload_key(base + i.to_bytes(4, "big") + b"\0" * 8, 0) for i in range(n)]


@pytest.fixture
def engines(redis_url: str, key_prefix: str, base_config: Any) -> Iterator[Any]:
    made: list[Engine] = []

    def make(url: str | None = None, config: Any = None, **kw: Any) -> Engine:
        vllm_config = config if config is not None else engine_config(base_config)
        engine = Engine(make_spec(url or redis_url, key_prefix, vllm_config, **kw), vllm_config)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def stored_names(url: str, prefix: str) -> list[bytes]:
    return sorted(redis.Redis.from_url(url).scan_iter(match=f"{prefix}:*", count=1000))


def name_of(url: str, prefix: str, key: OffloadKey) -> bytes:
    """The Redis key holding ``key``'s chunk (its name ends with the block hash)."""
    return next(n for n in stored_names(url, prefix) if n.endswith(key[:-4].hex().encode()))


def returns(fn: Any, deadline_s: float = 120.0, what: str = "") -> None:
    """Call ``fn()`` in a thread: fails when it raises, or when it has not returned by the
    deadline (a hang; the deadline is no speed bound)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(deadline_s)
    assert not thread.is_alive(), what or f"{fn} never returned"
    if errors:
        raise errors[0]


def wait_until(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)  # poll on the condition, bounded by the deadline
    return True


# ---------------------------------------------------------------------------- store, cascade
def test_loaded_by_module_path_and_cascades_every_stored_chunk(engines: Any, redis_url: str,
                                                               key_prefix: str) -> None:
    eng = engines()
    assert type(eng.tier).__name__ == "KvtierRedisTier"
    keys = chain(3)
    ctx = eng.request(keys)
    eng.store(ctx, keys)
    names = stored_names(redis_url, key_prefix)
    assert len(names) == 3
    client = redis.Redis.from_url(redis_url)
    for key in keys:
        value = client.get(name_of(redis_url, key_prefix, key))
        fields = codec.parse_header(value)
        assert fields.magic == b"KVTB" and fields.group == 0
        assert fields.digest == bytes.fromhex(eng.tier.fingerprint)
        assert fields.length == BLOCK_BYTES and value[codec.HEADER_SIZE:] == pattern(key).tobytes()
    # one key per chunk: {prefix}:{fingerprint}:{group}:{hash}
    assert all(n.decode().split(":")[1] == eng.tier.fingerprint for n in names)
    counts = eng.tier.counters()
    assert counts["stored_chunks"] == 3
    events = list(eng.manager.take_events())
    storage = [e for e in events if e.medium is Medium.STORAGE]
    assert storage and not storage[0].removed
    assert sorted(k for e in storage for k in e.keys) == sorted(keys)
    assert storage[0].ownership == "kvtier-redis"
    eng.finish(ctx)


def test_the_cascade_s_writer_keeps_a_short_linger(engines: Any) -> None:
    """vLLM's CPU blocks stay held while their store job runs: the writer does not wait the
    connector's 200 ms for more stores."""
    from offload_tiers.redis.settings import SHORT_WRITE_LINGER_S, WRITE_LINGER_S

    assert engines().tier.redis._writer._linger_s == SHORT_WRITE_LINGER_S < WRITE_LINGER_S


def test_chunk_already_held_is_not_rewritten(engines: Any) -> None:
    eng = engines(chunks=2)
    keys = chain(4)
    ctx = eng.request(keys)
    eng.store(ctx, keys[:2])
    eng.store(ctx, keys[2:])  # evicts keys[:2] from the 2-chunk primary
    ctx2 = eng.request(keys)
    assert eng.fetch(keys[0], ctx2) is LookupResult.HIT  # promoted back
    out = eng.manager.prepare_store([keys[0]], ctx2)
    assert out is not None and not out.keys_to_store  # the primary has it
    eng.tier.get_stats()
    job = eng.manager.create_store_job([keys[0]], ctx2)
    eng.tier.submit_store(job)
    eng.settle()
    assert eng.tier.counters()["store_skipped_present"] == 1


# ---------------------------------------------------------------------------- promotion, eviction
def test_evicted_chunk_is_promoted_back_with_its_bytes(engines: Any) -> None:
    eng = engines(chunks=2)
    keys = chain(5)
    ctx = eng.request(keys)
    for key in keys:
        eng.store(ctx, [key])  # a 2-chunk primary: three of the five are evicted
    # Which three is vLLM's policy, not kvtier's: 0.32's LRU evicts the oldest, 0.33's keeps
    # an active request's head and evicts its tail first.
    evicted = [k for k in keys if eng.manager.primary_tier.lookup(k, ctx) is LookupResult.MISS]
    assert len(evicted) == 3
    key = evicted[0]
    ctx2 = eng.request(keys)
    assert eng.manager.lookup(key, ctx2) is LookupResult.HIT_PENDING  # known: no Redis wait
    eng.settle()
    assert eng.manager.lookup(key, ctx2) is LookupResult.HIT
    assert eng.primary_bytes(key, ctx2) == pattern(key).tobytes()
    assert eng.tier.counters()["loaded_chunks"] == 1


def test_new_engine_restores_from_redis_after_an_async_check(engines: Any) -> None:
    first = engines()
    keys = chain(3)
    ctx = first.request(keys)
    first.store(ctx, keys)
    second = engines()  # another engine: empty primary, knows nothing
    ctx2 = second.request(keys)
    assert second.manager.lookup(keys[0], ctx2) is LookupResult.RETRY  # never waits on Redis
    for key in keys:
        assert second.fetch(key, ctx2) is LookupResult.HIT
        assert second.primary_bytes(key, ctx2) == pattern(key).tobytes()
    counts = second.tier.counters()
    assert counts["lookup_checked_hits"] == 3 and counts["loaded_chunks"] == 3


def test_unknown_chunk_is_a_miss_and_unpositioned_key_is_a_miss(engines: Any) -> None:
    eng = engines()
    keys = chain(1)
    ctx = eng.request(keys)
    assert eng.lookup(keys[0], ctx) is LookupResult.MISS
    stray = chain(1)[0]  # no position recorded in this request
    assert eng.tier.lookup(stray, ctx) is LookupResult.MISS
    assert eng.tier.counters()["unpositioned_keys"] == 1


# ---------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("how", ["flip", "truncate", "header"])
def test_bad_value_is_a_miss_and_the_other_keys_still_load(engines: Any, redis_url: str,
                                                           key_prefix: str, how: str) -> None:
    first = engines()
    keys = chain(3)
    ctx = first.request(keys)
    first.store(ctx, keys)
    client = redis.Redis.from_url(redis_url)
    victim = name_of(redis_url, key_prefix, keys[1])
    value = bytearray(client.get(victim))
    if how == "flip":
        value[codec.HEADER_SIZE + 1234] ^= 0x40
    elif how == "truncate":
        value = value[:-100]
    else:
        value[10] ^= 0x01
    client.set(victim, bytes(value))

    second = engines()
    ctx2 = second.request(keys)
    # lookups first (as the scheduler does), then one batched promotion of all three
    results = second.lookup_all(keys, ctx2)
    if how == "flip":  # the header is intact: the check passes, the load's checksum refuses it
        assert results == [LookupResult.HIT_PENDING] * 3
        second.settle()
        got = [second.manager.lookup(k, ctx2) for k in keys]
        assert got[0] is LookupResult.HIT and got[2] is LookupResult.HIT
        assert second.manager.lookup(keys[1], ctx2) is LookupResult.MISS
        assert second.primary_bytes(keys[2], ctx2) == pattern(keys[2]).tobytes()
        counts = second.tier.counters()
        assert counts["loaded_chunks"] == 2 and counts["load_misses"] == 1
        assert counts["corrupt_values"] == 1
    else:  # the existence check reads the header and length: a miss before any load
        assert results[1] is LookupResult.MISS
        assert results[0] is LookupResult.HIT_PENDING and results[2] is LookupResult.HIT_PENDING
        assert second.tier.counters()["corrupt_values"] == 1


def test_partial_load_reports_successful_keys(engines: Any, redis_url: str,
                                              key_prefix: str) -> None:
    first = engines()
    keys = chain(3)
    ctx = first.request(keys)
    first.store(ctx, keys)
    second = engines()
    ctx2 = second.request(keys)
    assert second.lookup_all(keys, ctx2) == [LookupResult.HIT_PENDING] * 3
    # between the check and the load, another writer leaves a foreign value
    client = redis.Redis.from_url(redis_url)
    client.set(name_of(redis_url, key_prefix, keys[2]),
               client.get(name_of(redis_url, key_prefix, keys[0])))
    reported: list[Any] = []
    tier = second.tier
    original = tier.get_finished_jobs

    def spy() -> list[Any]:
        out = list(original())
        reported.extend(out)
        return out

    tier.get_finished_jobs = spy  # type: ignore[method-assign]
    second.settle()
    loads = [r for r in reported if r.successful_keys is not None or not r.success]
    assert len(loads) == 1 and loads[0].success is False
    assert set(loads[0].successful_keys) == {keys[0], keys[1]}
    if HAS_DEFERRED_RELEASE:  # vLLM 0.34: the failed promotion's I/O is done, nothing deferred
        assert loads[0].deferred_release is None
    assert second.manager.lookup(keys[0], ctx2) is LookupResult.HIT
    assert second.manager.lookup(keys[2], ctx2) is LookupResult.MISS
    second.reset()  # vLLM's reset_cache drains the tier: no release left deferred (0.34 asserts)


def test_only_the_connector_cache_reset_moves_the_generation(engines: Any) -> None:
    """Stores, loads, settling, waiting for jobs and a shutdown leave the namespace where it
    is; vLLM's reset_cache (its one call of drain_jobs) moves it, once per reset."""
    eng = engines()
    keys = chain(2)
    ctx = eng.request(keys)
    eng.store(ctx, keys)
    fp = eng.tier.fingerprint
    eng.settle()
    eng.tier.wait_for_jobs()
    assert eng.fetch(keys[0], ctx) is LookupResult.HIT
    assert eng.tier.fingerprint == fp
    assert eng.tier.counters().get("generation_moves", 0) == 0
    eng.reset()
    assert eng.tier.fingerprint != fp
    assert eng.tier.counters()["generation_moves"] == 1
    moved = eng.tier.fingerprint
    eng.close()  # shutdown waits for jobs, moves nothing
    assert eng.tier.fingerprint == moved


def test_foreign_namespace_is_never_served(engines: Any, base_config: Any) -> None:
    import torch

    keys = chain(2)
    writer = engines()
    ctx = writer.request(keys)
    writer.store(ctx, keys)
    for other in (dict(model_id="another-model"), dict(config=engine_config(
            base_config, dtype=torch.bfloat16)), dict(config=engine_config(base_config,
                                                                            tp_size=2))):
        reader = engines(**other)
        assert reader.tier.fingerprint != writer.tier.fingerprint
        ctx2 = reader.request(keys)
        assert reader.lookup(keys[0], ctx2) is LookupResult.MISS


# ---------------------------------------------------------------------------- Redis faults
def test_killed_redis_gives_misses_and_counted_drops_then_recovers(engines: Any,
                                                                   redis_server: Any) -> None:
    # A killed server refuses at once; the timeout only has to let the healthy writes
    # before the kill through on a loaded machine.
    eng = engines(url=redis_server.url, chunks=8, redis_timeout_s=5.0)
    keys = chain(4)
    ctx = eng.request(keys)
    eng.store(ctx, keys[:2])
    assert eng.tier.counters()["stored_chunks"] == 2
    redis_server.kill()
    eng.store(ctx, keys[2:])  # Redis gone: the cascade's job is reported failed, counted
    counts = eng.tier.counters()
    assert counts["stored_chunks"] == 2  # the two stored before the kill, no more
    assert counts.get("store_drops", 0) + counts.get("store_failures", 0) >= 2
    assert "Timeout" not in eng.tier.redis.last_error  # refused at once, no socket timeout
    eng.tier.get_stats()  # drain counters so far
    later = chain(1)
    eng.store(eng.request(later), later)
    counts = eng.tier.counters()
    assert counts.get("stored_chunks", 0) == 0
    assert counts.get("store_drops", 0) + counts.get("store_failures", 0) >= 1
    other = engines(url=redis_server.url, chunks=8)
    ctx2 = other.request(keys)
    assert other.lookup(keys[0], ctx2) is LookupResult.MISS  # unavailable: a miss, no wait
    redis_server.start()  # empty again, same port
    # the Redis writer thread's probe reconnects (exponential backoff, at most 5 s)
    assert wait_until(lambda: eng.tier.redis.available, 120)
    fresh = chain(1)
    ctx3 = eng.request(fresh)
    eng.tier.get_stats()
    eng.store(ctx3, fresh)
    assert eng.tier.counters()["stored_chunks"] == 1


def test_paused_redis_bounds_drain_and_lookups(engines: Any, redis_server: Any) -> None:
    # Long enough for the healthy store and probe before the pause on a loaded machine;
    # each wait on the paused server costs it once.
    first = engines(url=redis_server.url, redis_timeout_s=2.0)
    keys = chain(3)
    ctx = first.request(keys)
    first.store(ctx, keys)
    second = engines(url=redis_server.url, redis_timeout_s=2.0)
    ctx2 = second.request(keys)
    assert second.lookup_all(keys, ctx2) == [LookupResult.HIT_PENDING] * 3
    redis_server.pause()
    try:
        second.manager.on_schedule_end(STEP)  # submits the promotion
        returns(second.tier.drain_jobs)  # ended by the socket timeout, not waiting forever
        assert "Timeout" in second.tier.redis.last_error
        second.manager.on_schedule_end(STEP)
        assert second.manager.lookup(keys[0], ctx2) is LookupResult.MISS
        assert second.tier.counters()["load_misses"] == 3
        returns(second.close)  # shutdown does not wait on the paused server either
    finally:
        redis_server.resume()


def test_no_password_in_logs_or_errors(engines: Any, caplog: Any, tmp_path: Any,
                                       base_config: Any) -> None:
    from rigs.redis_server import RedisServer

    right = "r1ght-pw-" + uuid.uuid4().hex[:6]
    wrong = "wr0ng-pw-" + uuid.uuid4().hex[:6]
    server = RedisServer(tmp_path / "auth", password=right).start()
    try:
        with caplog.at_level("DEBUG"):
            good = engines(url=server.url)
            keys = chain(1)
            good.store(good.request(keys), keys)
            assert good.tier.counters()["stored_chunks"] == 1
            bad = engines(url=server.url.replace(right, wrong))
            assert not bad.tier.redis.available
            assert bad.lookup(keys[0], bad.request(keys)) is LookupResult.MISS
        for secret in (right, wrong):
            assert secret not in caplog.text
            assert secret not in bad.tier.redis.last_error
            assert secret not in repr(bad.tier.settings.describe())
        assert "authentication" in bad.tier.redis.last_error.lower()
        with pytest.raises(NativeTierConfigError) as err:
            make_spec(f"bogus://:{right}@h/0", "p", base_config).get_manager()
        assert right not in str(err.value)
    finally:
        server.stop()


def test_password_from_the_environment(engines: Any, caplog: Any, tmp_path: Any, base_config: Any,
                                       monkeypatch: Any) -> None:
    from rigs.redis_server import RedisServer

    secret = "env-pw-" + uuid.uuid4().hex[:6]
    server = RedisServer(tmp_path / "env", password=secret).start()
    monkeypatch.setenv("KVTIER_TEST_REDIS_PW", secret)
    try:
        with caplog.at_level("DEBUG"):
            eng = engines(url=f"redis://127.0.0.1:{server.port}/0",
                          redis_password_env="KVTIER_TEST_REDIS_PW")
            keys = chain(1)
            eng.store(eng.request(keys), keys)
            assert eng.tier.counters()["stored_chunks"] == 1
        assert secret not in caplog.text
        monkeypatch.delenv("KVTIER_TEST_REDIS_PW")
        with pytest.raises(NativeTierConfigError, match="redis_password_env.*not set"):
            make_spec(server.url, "p", base_config,
                      redis_password_env="KVTIER_TEST_REDIS_PW").get_manager()
    finally:
        server.stop()


def test_config_info_reports_the_settings_and_no_credentials(engines: Any,
                                                             key_prefix: str) -> None:
    """vLLM 0.33 publishes it as vllm:kv_offload_config_info; on 0.32 nothing calls it."""
    secret = "info-pw-" + uuid.uuid4().hex[:6]
    url = f"redis://kvuser:{secret}@127.0.0.1:1/3?client_name=kvuser"  # never reached
    eng = engines(url=url, redis_ttl_s=None, io_threads=3, known_keys=10, locality="REMOTE")
    info = eng.tier.config_info()
    assert tuple(info) == KvtierRedisTier.config_info_keys({}) and "tier" not in info
    assert info == {
        "kvtier_redis_url": "redis://127.0.0.1:1/3", "kvtier_redis_cluster": False,
        "kvtier_redis_tls": False, "kvtier_redis_prefix": key_prefix,
        "kvtier_redis_ttl_s": "None", "kvtier_redis_timeout_s": 0.25, "kvtier_io_threads": 3,
        "kvtier_known_keys": 10, "kvtier_write_queue_max": 1024, "kvtier_kv_events": True,
        "kvtier_locality": "REMOTE"}
    assert secret not in repr(info) and "kvuser" not in repr(info)
    assert eng.tier.config_info() == info  # fixed for the process lifetime
    assert KvtierRedisTier.tolerates_off_thread_polling is False
    published = getattr(eng.manager, "config_info", None)  # vLLM >= 0.33
    if published is not None:
        extra = eng.spec.extra_config
        assert set(info) <= set(type(eng.spec).config_info_keys(extra))
        (tier_series,) = [series for series in published()[1:]
                          if series.get("kvtier_redis_prefix") == key_prefix]
        assert {k: v for k, v in tier_series.items() if k != "tier"} == info
        assert eng.manager._tier_poll_thread is None  # not polled off the scheduler thread


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize(("entry", "needle"), [
    ({"redis_urll": "redis://x"}, "redis_urll: unknown setting"),
    ({"io_threads": 0}, "io_threads"),
    ({"redis_timeout_s": -1}, "redis_timeout_s"),
    ({"locality": "MARS"}, "locality"),
])
def test_bad_settings_name_the_key_and_the_fix(redis_url: str, entry: dict[str, Any],
                                               needle: str) -> None:
    from connector.native_tier.config import load_native_settings

    base = {"redis_url": redis_url}
    base.update(entry)
    if "redis_urll" in entry:
        base.pop("redis_url")
    with pytest.raises(NativeTierConfigError) as err:
        load_native_settings(base)
    assert needle in str(err.value) and "Fix:" in str(err.value)


def test_credentials_from_a_variable_or_a_file_and_the_inline_warning(
        tmp_path: Any, monkeypatch: Any) -> None:
    from connector.native_tier.config import load_native_settings

    monkeypatch.setenv("KVTIER_TEST_NATIVE_URL", "redis://u:from-env@h:1/0")
    by_env = load_native_settings({"redis_url_env": "KVTIER_TEST_NATIVE_URL"})
    assert by_env.url == "redis://u:from-env@h:1/0" and by_env.redis_warnings == ()
    assert "from-env" not in str(by_env.describe())
    path = tmp_path / "pw"
    path.write_text("from-file\n")
    path.chmod(0o600)
    by_file = load_native_settings({"redis_url": "redis://h:1/0", "redis_username": "u",
                                    "redis_password_file": str(path)})
    assert by_file.url == "redis://u:from-file@h:1/0" and by_file.redis_warnings == ()
    inline = load_native_settings({"redis_url": "redis://:inline-pw@h:1/0"})
    assert len(inline.redis_warnings) == 1 and "inline-pw" not in inline.redis_warnings[0]
    with pytest.raises(NativeTierConfigError, match="redis_url_env.*not set.*Fix:"):
        load_native_settings({"redis_url_env": "KVTIER_TEST_NATIVE_UNSET"})
    with pytest.raises(NativeTierConfigError, match="redis_url: required"):
        load_native_settings({})


def test_importing_offload_tiers_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys, offload_tiers.redis.tier, offload_tiers.codec, "
            "connector.native_tier.config, connector.daemon.service; print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------- janitor, namespace
def test_janitor_keeps_the_tier_s_values_and_removes_a_damaged_one(engines: Any, redis_url: str,
                                                                   key_prefix: str) -> None:
    from offload_tiers.redis.janitor import RedisJanitor

    eng = engines()
    keys = chain(3)
    eng.store(eng.request(keys), keys)
    client = redis.Redis.from_url(redis_url)
    victim = name_of(redis_url, key_prefix, keys[1])
    value = bytearray(client.get(victim))
    value[40] ^= 0xFF  # the header's hash tag: contradicts the key name
    client.set(victim, bytes(value))
    janitor = RedisJanitor(redis_url, key_prefix)
    assert janitor.run_pass() is True
    left = set(stored_names(redis_url, key_prefix))
    assert victim not in left and len(left) == 2
    allowed = RedisJanitor(redis_url, key_prefix,
                           allowed_fingerprints=[eng.tier.fingerprint])
    assert allowed.run_pass() is True
    assert set(stored_names(redis_url, key_prefix)) == left


# ---------------------------------------------------------------------------- identity
def test_every_setting_read_from_vllm_changes_the_fingerprint(engines: Any, base_config: Any,
                                                              tiny_llama_dir: Path,
                                                              tmp_path: Path) -> None:
    import shutil

    import torch

    same = engines()
    reference = same.tier.fingerprint
    assert engines().tier.fingerprint == reference  # another engine, same settings: shared
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, ckpt)
    at_copy = engines(config=engine_config(base_config, model=str(ckpt))).tier.fingerprint
    weights = next(p for p in ckpt.iterdir() if p.name.endswith(".safetensors"))
    with weights.open("r+b") as f:  # the checkpoint rewritten in place, same path and size
        f.seek(weights.stat().st_size - 4)
        f.write(b"\x01\x02\x03\x04")
    variants = {
        "quantization": dict(config=engine_config(base_config, quantization="fp8")),
        "revision": dict(config=engine_config(base_config, revision="refs/pr/7")),
        "model dtype": dict(config=engine_config(base_config, dtype=torch.bfloat16)),
        "KV dtype": dict(config=engine_config(base_config, kv_cache_dtype="fp8_e4m3")),
        "KV dtype e5m2": dict(config=engine_config(base_config, kv_cache_dtype="fp8_e5m2")),
        # the same KV dtype and row bytes, another model dtype: only the VllmConfig says it
        "model dtype, KV dtype set": dict(config=engine_config(
            base_config, kv_cache_dtype="fp8_e4m3", dtype=torch.bfloat16)),
        "weights_version": dict(weights_version="step-1200"),
        "model_id": dict(model_id="org/tiny-llama"),
        "checkpoint": dict(config=engine_config(base_config, model=str(ckpt))),
    }
    seen = {"reference": reference, "checkpoint copy": at_copy}
    for name, kw in variants.items():
        seen[name] = engines(**kw).tier.fingerprint
    assert len(set(seen.values())) == len(seen), seen


def test_quantized_engine_is_never_served_the_unquantized_values(engines: Any,
                                                                 base_config: Any) -> None:
    """The finding of issue #17: same model, same KV dtype and row bytes, fp8 weights."""
    keys = chain(2)
    plain = engines()
    plain.store(plain.request(keys), keys)
    quantized = engines(config=engine_config(base_config, quantization="fp8"))
    ctx = quantized.request(keys)
    assert quantized.lookup_all(keys, ctx) == [LookupResult.MISS] * 2
    assert quantized.tier.counters().get("loaded_chunks", 0) == 0


def test_identity_needs_the_engine_s_vllm_config(redis_url: str, key_prefix: str,
                                                 base_config: Any) -> None:
    config = engine_config(base_config)
    with pytest.raises(NativeTierIdentityError, match="cannot find the engine's VllmConfig"):
        make_spec(redis_url, key_prefix, config).get_manager()  # no config current or above
    other = engine_config(base_config)  # another engine's config is not ours
    with set_current_vllm_config(other), pytest.raises(NativeTierIdentityError,
                                                       match="engine_id"):
        make_spec(redis_url, key_prefix, config).get_manager()


def test_identity_from_the_caller_s_vllm_config_as_vllm_builds_it(redis_url: str,
                                                                  key_prefix: str,
                                                                  base_config: Any) -> None:
    """vLLM 0.32 sets no current config in the engine core: the tier is built inside
    ``OffloadingConnectorScheduler.__init__(spec, vllm_config, ...)``."""

    def scheduler_init(spec: TieringOffloadingSpec, vllm_config: Any) -> Any:
        return spec.get_manager()

    config = engine_config(base_config)
    manager = scheduler_init(make_spec(redis_url, key_prefix, config), config)
    other = engine_config(base_config)
    reference = Engine(make_spec(redis_url, key_prefix, other), other)
    try:
        assert manager.secondary_tiers[0].fingerprint == reference.tier.fingerprint
    finally:
        manager.shutdown()
        reference.close()


# ---------------------------------------------------------------------------- generation
class EngineCore:
    """Named like vLLM's: the tier reads ``_weight_version`` of the EngineCore building it."""

    def __init__(self, version: str = "default") -> None:
        self._weight_version = version

    def start(self, make: Any, **kw: Any) -> Engine:
        return make(**kw)


def test_connector_reset_moves_to_a_generation_no_other_engine_shares(engines: Any) -> None:
    a, b = engines(), engines()
    start = a.tier.fingerprint
    assert b.tier.fingerprint == start and a.tier.generation.name == "0"
    keys = chain(2)
    ctx = a.request(keys)
    a.store(ctx, keys)
    a.finish(ctx)
    a.reset()  # vLLM's reset_prefix_cache(reset_connector=True) lands here
    b.reset()
    assert len({start, a.tier.fingerprint, b.tier.fingerprint}) == 3  # a nonce each
    assert a.tier.counters()["generation_moves"] == 1
    ctx = a.request(keys)  # forgotten, and Redis holds nothing under the new fingerprint
    assert a.lookup_all(keys, ctx) == [LookupResult.MISS] * 2
    assert a.tier.counters().get("lookup_known_hits", 0) == 0
    a.store(ctx, keys)  # stored again, under a's new generation: b never meets it
    ctx_b = b.request(keys)
    assert b.lookup_all(keys, ctx_b) == [LookupResult.MISS] * 2
    fresh = engines()  # a restarted engine is at generation "0": it meets the first values
    assert fresh.tier.fingerprint == start
    assert fresh.fetch(keys[0], fresh.request(keys)) is LookupResult.HIT


def test_a_named_weight_version_is_shared_after_the_reset(engines: Any) -> None:
    core_a, core_b = EngineCore(), EngineCore()
    a, b = core_a.start(engines), core_b.start(engines)
    start = a.tier.fingerprint
    core_a._weight_version = core_b._weight_version = "rl-step-7"  # update_weight_version
    a.reset()
    b.reset()
    assert a.tier.generation.name == "named:rl-step-7"
    assert a.tier.fingerprint == b.tier.fingerprint != start
    keys = chain(2)
    a.store(a.request(keys), keys)
    ctx = b.request(keys)
    for key in keys:
        assert b.fetch(key, ctx) is LookupResult.HIT
        assert b.primary_bytes(key, ctx) == pattern(key).tobytes()


def test_a_new_weight_version_moves_the_generation_without_a_reset(engines: Any) -> None:
    core = EngineCore()
    eng = core.start(engines)
    keys = chain(2)
    ctx = eng.request(keys)
    eng.store(ctx, keys)
    start = eng.tier.fingerprint
    eng.finish(ctx)
    core._weight_version = "v2"
    # the step's first look-up in the Redis tier after the update already follows it
    # (issue 43.3 (a)): the chunks it knew under v1's generation are not answered as known
    ctx = eng.request(keys)
    known = eng.tier.counters().get("lookup_known_hits", 0)
    assert eng.tier.lookup(keys[0], ctx) is not LookupResult.HIT
    assert eng.tier.counters().get("lookup_known_hits", 0) == known
    assert eng.tier.generation.name == "named:v2" and eng.tier.fingerprint != start
    eng.manager.on_schedule_end(STEP)  # followed again at the step's end: no second move
    assert eng.tier.generation.name == "named:v2"
    eng.finish(ctx)
    # A reset with no new name since the version was followed (a move): the weights may have
    # been updated in place again, so a nonce, never named:v2 again (issue 43.3 (b)).
    eng.reset()
    first = eng.tier.generation.name
    assert first.startswith("nonce:")
    ctx = eng.request(keys)
    assert eng.lookup_all(keys, ctx) == [LookupResult.MISS] * 2  # v1's chunks: not served
    eng.finish(ctx)
    eng.reset()  # again: another nonce
    assert eng.tier.generation.name.startswith("nonce:") and eng.tier.generation.name != first


# ---------------------------------------------------------------------------- failed jobs
def drain_within(tier: KvtierRedisTier, seconds: float) -> None:
    """``tier.wait_for_jobs()`` (``drain_jobs`` without the generation move) in a thread;
    fails, instead of hanging, when it never returns."""
    returns(tier.wait_for_jobs, seconds, "drain never returned: a job was never reported")


def test_a_job_whose_row_read_raises_is_reported_failed(engines: Any, caplog: Any) -> None:
    eng = engines(chunks=8)
    keys = chain(4)
    ctx = eng.request(keys)

    def broken(chunk_id: int) -> np.ndarray:
        raise IndexError(f"row {chunk_id} is not there")

    eng.tier._row = broken  # type: ignore[method-assign]
    reported: list[Any] = []
    original = eng.tier.get_finished_jobs

    def spy() -> list[Any]:
        out = list(original())
        reported.extend(out)
        return out

    eng.tier.get_finished_jobs = spy  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="connector.native_tier.tier"):
        for key in keys[:2]:  # two cascades, each failing while it reads its row
            out = eng.manager.prepare_store([key], ctx)
            eng.rows[out.store_spec.chunk_ids[0]] = pattern(key)
            eng.manager.complete_store([key], ctx)
            eng.manager.on_schedule_end(STEP)
            drain_within(eng.tier, 120)
            eng.manager.on_schedule_end(STEP)
    assert [r.success for r in reported] == [False, False]
    assert all(r.successful_keys is None for r in reported)
    counts = eng.tier.counters()
    assert counts["job_errors"] == 2 and counts.get("stored_chunks", 0) == 0
    assert not eng.tier.has_pending_work()
    errors = [r for r in caplog.records if "store job" in r.getMessage()]
    assert len(errors) == 1 and "IndexError" in errors[0].getMessage()  # logged once
    eng.tier.drain_jobs()  # returns: nothing is left pending


def test_a_load_job_that_raises_is_a_failed_promotion(engines: Any) -> None:
    first = engines()
    keys = chain(2)
    first.store(first.request(keys), keys)
    second = engines()
    ctx = second.request(keys)
    assert second.lookup_all(keys, ctx) == [LookupResult.HIT_PENDING] * 2

    def broken(chunk_id: int) -> np.ndarray:
        raise RuntimeError("primary region unmapped")

    second.tier._row = broken  # type: ignore[method-assign]
    second.manager.on_schedule_end(STEP)  # submits the promotion
    drain_within(second.tier, 120)
    second.manager.on_schedule_end(STEP)
    assert [second.manager.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 2
    counts = second.tier.counters()
    assert counts["job_errors"] == 1 and counts["load_misses"] == 2


def test_submit_never_raises_on_bad_job_metadata(engines: Any) -> None:
    from vllm.v1.kv_offload.tiering.base import TransferJob

    eng = engines()
    keys = chain(3)
    ctx = eng.request(keys)
    for n, promotion in enumerate((False, True)):
        job = TransferJob(job_id=10_000 + n, keys=keys, chunk_ids=np.array([0, 1]),
                          is_promotion=promotion, req_context=ctx)  # one chunk id short
        (eng.tier.submit_load if promotion else eng.tier.submit_store)(job)
    drain_within(eng.tier, 120)
    results = list(eng.tier.get_finished_jobs())
    assert sorted(r.job_id for r in results) == [10_000, 10_001]
    assert not any(r.success for r in results)
    assert eng.tier.counters()["job_errors"] == 2


# ---------------------------------------------------------------------------- corrupt values
def test_a_value_proven_corrupt_is_deleted_and_then_a_plain_miss(engines: Any, redis_url: str,
                                                                 key_prefix: str) -> None:
    first = engines()
    keys = chain(2)
    first.store(first.request(keys), keys)
    client = redis.Redis.from_url(redis_url)
    victim = name_of(redis_url, key_prefix, keys[1])
    value = bytearray(client.get(victim))
    value[codec.HEADER_SIZE + 99] ^= 0x08  # header intact: only the load's checksum sees it
    client.set(victim, bytes(value))
    second = engines()
    ctx = second.request(keys)
    assert second.lookup_all(keys, ctx) == [LookupResult.HIT_PENDING] * 2
    second.settle()
    assert second.manager.lookup(keys[1], ctx) is LookupResult.MISS  # the load missed
    assert not client.exists(victim)  # proven corrupt: deleted (it was unchanged)
    assert client.exists(name_of(redis_url, key_prefix, keys[0]))
    second.finish(ctx)
    counts = second.tier.counters()
    assert counts["corrupt_values"] == 1 and counts["corrupt_deleted"] == 1
    assert counts["load_misses"] == 1
    second.tier.get_stats()  # counters start again from zero
    ctx = second.request(keys)  # a new request asks Redis again: a plain miss, no load
    assert second.lookup(keys[1], ctx) is LookupResult.MISS
    second.settle()
    counts = second.tier.counters()
    assert counts.get("load_misses", 0) == 0 and counts.get("corrupt_values", 0) == 0


def test_the_native_tier_keeps_redis_tier_s_corrupt_deletion_on(engines: Any) -> None:
    assert engines().tier.redis.delete_corrupt is True


def test_known_keys_are_bounded(engines: Any) -> None:
    eng = engines(chunks=8, known_keys=3)
    keys = chain(6)
    eng.store(eng.request(keys), keys)
    assert len(eng.tier._known) == 3
    assert list(eng.tier._known) == keys[3:]  # the most recent ones

"""Model-based test: the Redis tier driven the way the connector drives it, against a
reference, with real Redis behind a proxy that the state machine breaks and repairs at random.

Stores go through the write-behind queue (``submit_put`` with ``on_done``, the payload a
buffer left untouched until ``on_done`` runs) or synchronously (``put_many``); restores are
``get_many_into`` into slab rows (sometimes asking for a save id); ``save_ids_many``,
``delete_many`` and values damaged by hand (straight to Redis, not through the proxy) run in
between.

The reference: every write carries bytes and a save id of its own (a write counter), so a
stale value, a deleted value or another key's value is told apart from the right one. For each
Redis key name the model keeps the set of values the name *may* hold now (``None``: absent):
a store or delete whose outcome is unknown (Redis broken, a queued store not yet done) adds
its value to the set; one known to have landed replaces the set with its value plus those of
the stores still queued (they may land after it). A FULL key and a PARTIAL key share one
Redis key name (``COLLIDERS``): the header's kind/num_tokens must keep them apart. A read may
delete a value it proved corrupt (``delete_corrupt``, the default), never a valid one.

Invariants: a restore fills its row with the bytes of a value the name may hold for exactly
that key (and that save id, when asked), or reports a miss; a probe reports the save id of
such a value or of a damaged value whose header is intact; with Redis healthy and the name's
value known, a read hits exactly when that value is the key's, and a corrupt one is deleted;
every ``on_done`` runs exactly once.

``test_concurrent_writers_of_one_key_never_tear_a_value``: threads write *different* bytes
to the same keys while others read them; every hit must be one whole write, never a mix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from offload_tiers import codec
from offload_tiers.keys import BlockKey, BlockKind
from offload_tiers.redis.tier import RedisTier
from rigs.tcp_proxy import TcpProxy
from tests.tiers.helpers import key, payload, run_threads

SLOT = 512
FULL = [key(i) for i in range(6)]
PARTIAL = [key(i, partial=True) for i in range(6)]
COLLIDERS = [dataclasses.replace(k, num_tokens=k.num_tokens - 5, kind=BlockKind.PARTIAL)
             for k in FULL[:3]]  # same hash, same Redis key name as FULL[:3]
KEYS = FULL + PARTIAL + COLLIDERS
BATCH = st.lists(st.sampled_from(KEYS), max_size=6)
DAMAGE = ("flip", "truncate", "junk")  # payload byte flipped / 10 bytes short / not a value
NO_SUCH_SAVE = codec.MAX_SAVE_ID  # no write of the machine uses it


@dataclasses.dataclass(frozen=True)
class Stored:
    """One write: the key it was written for, its bytes and its save id."""

    key: BlockKey
    data: bytes
    save_id: int


@dataclasses.dataclass(frozen=True)
class Damaged:
    """A value written by hand that no reader may serve (``how``: one of :data:`DAMAGE`)."""

    key: BlockKey
    how: str
    save_id: int


Value = Stored | Damaged | None


def _wait(ok: Callable[[], bool], timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def size_of(k: BlockKey) -> int:
    """Payload length: varies a little, and is the same for keys sharing a Redis key name."""
    return SLOT - k.block_hash[0] % 7


@pytest.fixture(scope="module")
def proxy(redis_url: str) -> Iterator[TcpProxy]:
    url = redis.connection.parse_url(redis_url)
    p = TcpProxy(url.get("host", "127.0.0.1"), int(url.get("port", 6379))).start()
    yield p
    p.stop()


class RedisTierMachine(RuleBasedStateMachine):
    proxy: TcpProxy
    redis_url: str

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"kvtier-test-sm-{uuid.uuid4().hex[:10]}"
        self.proxy.mode = "forward"
        self.redis = RedisTier.from_url(self.proxy.url, prefix=self.prefix, redis_timeout_s=0.5,
                                        backoff_initial_s=0.01, backoff_max_s=0.1)
        self.raw = redis.Redis.from_url(self.redis_url)  # straight to Redis: never broken
        self.slab = np.zeros((8, SLOT), np.uint8)
        self.could_be: dict[str, set[Value]] = {}  # Redis key name -> values it may hold
        self.last_save: dict[BlockKey, int] = {}  # the save id of each key's newest write
        self.writes = 0
        self._lock = threading.Lock()  # guards the three below (on_done runs on the writer)
        self.pending: dict[int, tuple[str, Stored]] = {}  # queued stores not yet done
        self.submitted: list[int] = []
        self.done: list[int] = []

    # ------------------------------------------------------------------ the reference
    def _new(self, k: BlockKey) -> Stored:
        self.writes += 1  # unique bytes and save id (nonzero, fits the header's u32)
        self.last_save[k] = self.writes
        return Stored(k, payload(k, size_of(k), version=self.writes), self.writes)

    def _values(self, name: str) -> set[Value]:
        return self.could_be.setdefault(name, {None})

    def _queued(self, name: str) -> set[Value]:
        with self._lock:
            return {v for n, v in self.pending.values() if n == name}

    def _landed(self, name: str, value: Value, queued: set[Value]) -> None:
        """``value`` is known to be what ``name`` held at some moment after every earlier
        operation; only the stores queued then may have landed after it."""
        self.could_be[name] = {value} | queued

    def _counters(self) -> tuple[int, int]:
        s = self.redis.stats()
        return s["errors"], s["skipped_unavailable"]

    def _on_done(self, write: int) -> Callable[[bool], None]:
        def done(_ok: bool) -> None:
            with self._lock:
                self.pending.pop(write, None)
                self.done.append(write)
        return done

    def _servable(self, k: BlockKey, save_id: int | None = None) -> set[bytes]:
        return {v.data for v in self._values(k.name) if isinstance(v, Stored) and v.key == k
                and (save_id is None or v.save_id == save_id)}

    def _after_read(self, keys: list[BlockKey]) -> None:
        """A read may delete a value it proved corrupt (while unchanged): never another."""
        for k in keys:
            values = self._values(k.name)
            if any(isinstance(v, Damaged) for v in values):
                values.add(None)

    # ------------------------------------------------------------------ operations
    def _restore(self, keys: list[BlockKey], by_save: bool = False) -> list[bool]:
        rows = [self.slab[i, :size_of(k)] for i, k in enumerate(keys)]
        wanted = [self.last_save.get(k, NO_SUCH_SAVE) for k in keys] if by_save else None
        got = self.redis.get_many_into(keys, rows, save_ids=wanted)
        for i, (k, row, hit) in enumerate(zip(keys, rows, got, strict=True)):
            if hit:
                allowed = self._servable(k, wanted[i] if wanted else None)
                assert allowed, f"{k.kind.name} key served, but no value of it may be there"
                assert row.tobytes() in allowed, "stale, deleted, damaged or another key's bytes"
        self._after_read(keys)
        return got

    @rule(k=st.sampled_from(KEYS))
    def submit_put(self, k: BlockKey) -> None:
        value = self._new(k)
        with self._lock:
            self.pending[value.save_id] = (k.name, value)
            self.submitted.append(value.save_id)
        self._values(k.name).add(value)
        self.redis.submit_put(k, memoryview(np.frombuffer(value.data, np.uint8)),
                              on_done=self._on_done(value.save_id), save_id=value.save_id)

    @rule(keys=BATCH)
    def put_many(self, keys: list[BlockKey]) -> None:
        values = [self._new(k) for k in keys]
        queued = {k.name: self._queued(k.name) for k in keys}
        stored = self.redis.put_many([(v.key, v.data) for v in values],
                                     save_ids=[v.save_id for v in values])
        if stored == len(values):  # every SET answered OK, in order: the last one wins
            for v in values:
                self._landed(v.key.name, v, queued[v.key.name])
        else:
            for v in values:
                self._values(v.key.name).add(v)

    @rule(keys=BATCH, by_save=st.booleans())
    def restore(self, keys: list[BlockKey], by_save: bool) -> None:
        self._restore(keys, by_save)

    @rule(keys=BATCH)
    def probe(self, keys: list[BlockKey]) -> None:
        """The cheap probe reads headers only: a flipped payload byte passes it."""
        for k, save_id in zip(keys, self.redis.save_ids_many(keys), strict=True):
            if save_id is not None:
                ok = {v.save_id for v in self._values(k.name) if v is not None and v.key == k
                      and (isinstance(v, Stored) or v.how == "flip")}
                assert save_id in ok, "the probe found a value nobody stored under this key"
        self._after_read(keys)

    @rule(k=st.sampled_from(KEYS))
    def delete(self, k: BlockKey) -> None:
        """UNLINK the key's name; once it answered, a read of the key (or its twin) finds
        nothing but what a queued store may have written since."""
        queued = self._queued(k.name)
        before = self._counters()
        self.redis.delete_many([k])
        if self._counters() == before and self.redis.available:
            event("delete answered")
            self._landed(k.name, None, queued)  # UNLINK answered: the name is gone
        else:
            self._values(k.name).add(None)
        self._restore([k])

    @rule(k=st.sampled_from(KEYS), how=st.sampled_from(DAMAGE))
    def damage(self, k: BlockKey, how: str) -> None:
        """A value under the key's name that no reader may serve, written straight to Redis."""
        queued = self._queued(k.name)
        self.writes += 1
        good = codec.encode_bytes(k, payload(k, size_of(k), version=self.writes),
                                  save_id=self.writes)
        if how == "flip":
            bad = bytearray(good)
            bad[codec.HEADER_SIZE + 3] ^= 0x40
            value = bytes(bad)
        else:
            value = good[:-10] if how == "truncate" else b"junk"
        self.raw.set(f"{self.prefix}:{k.name}", value)
        self._landed(k.name, Damaged(k, how, self.writes), queued)

    def _settle(self) -> bool:
        """Queue empty, every on_done run, Redis answering."""
        self.redis.flush(10)
        with self._lock:
            idle = not self.pending
        return idle and _wait(lambda: self.redis.available)

    @rule(k=st.sampled_from(KEYS))
    @precondition(lambda self: self.proxy.mode == "forward")
    def known_value_is_what_a_read_sees(self, k: BlockKey) -> None:
        """With Redis healthy and the name's value known, a read hits exactly when it is the
        key's (with its bytes); a damaged value is a miss and is deleted by that read (a
        flipped payload only by its own key's read: its header may be another key's)."""
        if not self._settle():
            return
        values = set(self._values(k.name))
        before, deleted = self._counters(), self.redis.stats()["corrupt_deleted"]
        hit = self._restore([k])[0]
        if len(values) != 1 or self._counters() != before or not self.redis.available:
            return
        (value,) = values
        mine = isinstance(value, Stored) and value.key == k
        event(f"known value read: {type(value).__name__}, {'its key' if mine else 'no hit'}")
        assert hit == mine, f"known value {value!r}, read for {k.kind.name}: hit={hit}"
        if isinstance(value, Damaged) and (value.how != "flip" or value.key == k):
            assert self.redis.stats()["corrupt_deleted"] == deleted + 1, "damaged value kept"
            self._landed(k.name, None, set())

    @rule(k=st.sampled_from(KEYS), queued=st.booleans())
    @precondition(lambda self: self.proxy.mode == "forward")
    def stored_is_restored(self, k: BlockKey, queued: bool) -> None:
        """With Redis healthy, a store that reports success is restored right after, with
        its own bytes (not an older value's)."""
        if not self._settle():
            return
        errors = self.redis.stats()["errors"]
        value = self._new(k)
        if queued:
            flags: list[bool] = []
            with self._lock:
                self.pending[value.save_id] = (k.name, value)
                self.submitted.append(value.save_id)
            self._values(k.name).add(value)
            mark = self._on_done(value.save_id)
            self.redis.submit_put(k, memoryview(np.frombuffer(value.data, np.uint8)),
                                  on_done=lambda ok: (flags.append(ok), mark(ok)),
                                  save_id=value.save_id)
            assert self.redis.flush(10)
            stored = flags == [True]
        else:
            stored = self.redis.put_many([(k, value.data)], save_ids=[value.save_id]) == 1
        if stored:
            self._landed(k.name, value, set())
        else:
            self._values(k.name).add(value)
        hit = self._restore([k], by_save=True)[0]
        if stored and self.redis.stats()["errors"] == errors:
            assert hit and self.slab[0, :size_of(k)].tobytes() == value.data

    @rule(i=st.integers(0, len(COLLIDERS) - 1), partial_first=st.booleans())
    @precondition(lambda self: self.proxy.mode == "forward")
    def twin_is_never_served(self, i: int, partial_first: bool) -> None:
        """A FULL key and a PARTIAL key share one Redis key name: storing one, then asking
        for the other, is a miss (the header's kind/num_tokens tell them apart)."""
        stored, asked = (COLLIDERS[i], FULL[i]) if partial_first else (FULL[i], COLLIDERS[i])
        if not self._settle():
            return
        value = self._new(stored)
        if self.redis.put_many([(stored, value.data)], save_ids=[value.save_id]) != 1:
            self._values(stored.name).add(value)
            return
        self._landed(stored.name, value, set())
        row = self.slab[0, :size_of(asked)]
        assert self.redis.get_many_into([asked], [row]) == [False], "the twin was served"

    @rule()
    def break_redis(self) -> None:
        self.proxy.mode = "refuse"
        self.proxy.reset_all()

    @rule()
    def repair_redis(self) -> None:
        self.proxy.mode = "forward"

    @invariant()
    def callbacks_run_once_and_only_for_stores(self) -> None:
        with self._lock:
            assert len(self.done) == len(set(self.done)), "an on_done ran twice"
            assert set(self.done) <= set(self.submitted)

    def teardown(self) -> None:
        self.proxy.mode = "forward"
        self.redis.close(timeout=5)
        with self._lock:
            assert sorted(self.done) == sorted(self.submitted), "an on_done did not run once"
        keys = list(self.raw.scan_iter(match=f"{self.prefix}*", count=1000))
        if keys:
            self.raw.delete(*keys)
        self.raw.close()


def test_redis_tier_matches_reference_under_failures(proxy: TcpProxy, redis_url: str) -> None:
    RedisTierMachine.proxy = proxy
    RedisTierMachine.redis_url = redis_url
    run_state_machine_as_test(
        RedisTierMachine,
        settings=settings(max_examples=40, stateful_step_count=40, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )


# ---------------------------------------------------------------------- concurrency
TORN_KEYS = [key(i, hash_salt="torn") for i in range(4)]
TORN_SIZE = 256 << 10  # several socket reads per reply
TAG = 16  # the payload's first bytes name the write; the rest is derived from them


def tagged(k: BlockKey, writer: int, n: int) -> bytes:
    """Write ``n`` of ``writer``: its bytes differ from every other write of ``k``."""
    tag = f"{writer:04d}:{n:010d}:".encode()
    seed = hashlib.blake2b(k.name.encode() + tag, digest_size=8).digest()
    return tag + np.random.default_rng(int.from_bytes(seed)).bytes(TORN_SIZE - TAG)


def test_concurrent_writers_of_one_key_never_tear_a_value(redis_url: str,
                                                          key_prefix: str) -> None:
    """Three writers store different bytes under the same four keys (``put_many`` and the
    write-behind queue) while two readers read them (``get_many_into`` and ``get_many``):
    every hit is exactly one write, named by its tag, never a mix of two."""
    tier = RedisTier.from_url(redis_url, prefix=key_prefix, strict=True)
    stop = threading.Event()
    torn: list[str] = []
    hits = [0, 0]

    def check(k: BlockKey, got: bytes) -> None:
        try:
            writer, n = (int(x) for x in got[:TAG].split(b":")[:2])
            whole = got == tagged(k, writer, n)
        except ValueError:
            whole = False
        if not whole:
            torn.append(f"{k.name}: {got[:TAG]!r}... is not one whole write")

    def writer(w: int) -> None:
        for n in range(25):
            if n % 2:  # (a store that times out on a loaded machine is no failure here)
                tier.put_many([(k, tagged(k, w, n)) for k in TORN_KEYS])
            else:
                for k in TORN_KEYS:
                    tier.submit_put(k, tagged(k, w, n))

    def reader(r: int) -> None:
        rows = np.zeros((len(TORN_KEYS), TORN_SIZE), np.uint8)
        while True:  # at least one round, however the threads are scheduled
            done = stop.is_set()
            if r == 0:
                got = [row.tobytes() if ok else None for ok, row in
                       zip(tier.get_many_into(TORN_KEYS, list(rows)), rows, strict=True)]
            else:
                got = [bytes(v) if v is not None else None for v in tier.get_many(TORN_KEYS)]
            for k, value in zip(TORN_KEYS, got, strict=True):
                if value is not None:
                    hits[r] += 1
                    check(k, value)
            if done:
                return

    try:
        tier.put_many([(k, tagged(k, 0, 0)) for k in TORN_KEYS])  # readers hit from the start
        run_threads([lambda w=w: writer(w) for w in (1, 2, 3)],
                    [lambda r=r: reader(r) for r in (0, 1)], stop=stop)
        assert tier.flush(10)
        s = tier.stats()
    finally:
        tier.close()
    assert torn == []
    assert min(hits) > 0, hits
    assert s["corrupt"] == 0 and s["hits"] == sum(hits)

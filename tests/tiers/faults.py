"""Shared bits for fault tests: a traffic generator that checks every value it reads and
keeps the result of every write, so a test can prove each failed write was counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from offload_tiers.redis.tier import RedisTier
from tests.tiers.helpers import key, payload

#: tier.stats() fields the write accounting compares (deltas over the traffic's run)
_WRITE_FIELDS = ("puts", "put_failures", "dropped", "dropped_unavailable", "queued",
                 "written", "write_failed")


def wait_until(cond: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@dataclass
class Traffic:
    """Writers and readers on a RedisTier in a thread; records everything it sees.

    Every ``put_many`` result and every ``submit_put`` answer is kept: ``put_stored`` /
    ``put_failed`` (synchronous stores), ``submit_queued`` / ``submit_dropped`` (write-behind).
    """

    tier: RedisTier
    size: int = 8192
    ops: int = 0
    hits: int = 0
    put_stored: int = 0
    put_failed: int = 0
    submit_queued: int = 0
    submit_dropped: int = 0
    wrong: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    _before: dict[str, Any] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._before = self.tier.stats()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                batch = [key(i) for i in range(n % 64, n % 64 + 8)]
                stored = self.tier.put_many([(k, payload(k, self.size)) for k in batch[:4]])
                self.put_stored += stored
                self.put_failed += 4 - stored
                if self.tier.submit_put(batch[4], payload(batch[4], self.size)):
                    self.submit_queued += 1
                else:
                    self.submit_dropped += 1
                for k, got in zip(batch, self.tier.get_many(batch), strict=True):
                    if got is not None:
                        self.hits += 1
                        if bytes(got) != payload(k, self.size):
                            self.wrong.append(k.name)
                self.tier.exists_many(batch)
                self.ops += 1
            except Exception as exc:  # the tier must never raise: record it, fail later
                self.exceptions.append(repr(exc))
            n += 3
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
            assert not self._thread.is_alive(), "traffic thread hung"

    @property
    def failed_writes(self) -> int:
        """Writes that did not reach Redis: failed puts, drops at submit, failed queued ones
        (the last read from the tier: the traffic cannot see them)."""
        return self.put_failed + self.submit_dropped + self._delta()["write_failed"]

    def _delta(self) -> dict[str, int]:
        now = self.tier.stats()
        return {f: now[f] - self._before[f] for f in _WRITE_FIELDS}

    def assert_writes_accounted(self) -> None:
        """Every write the traffic made is in the tier's counters, exactly once: stored, or
        failed (``put_failures``), or dropped (``dropped``/``dropped_unavailable``). Call after
        :meth:`stop`, with no other writer on the tier meanwhile."""
        assert self.tier.flush(30), "write-behind queue did not drain"
        d = self._delta()
        assert d["dropped"] + d["dropped_unavailable"] == self.submit_dropped, d
        assert d["queued"] == self.submit_queued == d["written"] + d["write_failed"], d
        assert d["puts"] == self.put_stored + d["written"], d
        assert d["put_failures"] == self.put_failed + d["write_failed"], d

"""Shared bits for fault tests: a traffic generator that checks every value it reads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from offload_tiers.redis_tier import RedisTier
from tests.tiers.helpers import key, payload


def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@dataclass
class Traffic:
    """Writers and readers on a RedisTier in a thread; records everything it sees."""

    tier: RedisTier
    size: int = 8192
    ops: int = 0
    hits: int = 0
    wrong: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            try:
                batch = [key(i) for i in range(n % 64, n % 64 + 8)]
                self.tier.put_many([(k, payload(k, self.size)) for k in batch[:4]])
                self.tier.submit_put(batch[4], payload(batch[4], self.size))
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

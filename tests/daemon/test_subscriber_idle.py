"""The ingest thread of a daemon without event sources waits between ticks (zmq's poll of no
sockets returns at once: it used to spin a whole core)."""

from __future__ import annotations

import threading

import zmq

from connector.daemon.config import DaemonConfig
from connector.daemon.ingest import Ingestor
from connector.daemon.subscriber import Subscriber


def test_with_no_source_the_ingest_thread_waits_on_its_stop_event(monkeypatch) -> None:  # noqa: ANN001
    sub = Subscriber(DaemonConfig(cpu_bytes=4 << 20), Ingestor({0: 16}), threading.Lock())
    assert sub.sources == []
    polls: list[object] = []
    monkeypatch.setattr(zmq.Poller, "poll", lambda self, timeout=None: polls.append(timeout))
    waits: list[float | None] = []
    expired: list[float] = []
    monkeypatch.setattr(sub, "expire", lambda now: expired.append(now) or 0)
    real_wait = sub._stop.wait

    def wait(timeout: float | None = None) -> bool:
        waits.append(timeout)
        if len(waits) == 3:
            sub._stop.set()  # three ticks seen: stop the loop
        return real_wait(0)

    monkeypatch.setattr(sub._stop, "wait", wait)
    sub.start()
    assert sub._thread is not None
    sub._thread.join()
    assert polls == []  # never polled an empty poller
    assert waits == [0.1, 0.1, 0.1]  # one tick per wait; index expiry still runs each tick
    assert len(expired) == 3
    sub.close()

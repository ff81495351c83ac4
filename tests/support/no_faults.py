"""Deadlines for engines in tests that inject no Redis fault: only a hung Redis reaches them.

kvtier turns a Redis reply later than ``redis_timeout_s`` into a miss (Redis marked down), and
so does a probe still out after ``max_probe_asks`` engine steps. Both are correct, but they
are not what a test of shards, namespaces or restores asserts, and this machine (two vCPUs)
sometimes stalls processes for seconds while engines start. Measured 2026-12-05 beside three
engine-running test files on two pytest workers: a 50 ms sleep that overshot by 16 s, and
``vmstat 1`` silent for 17 s, at the same moment; a Redis PING that took 6.3 s. In those
runs a new TP=2 engine's probe gave up after its 10,000 asks (``probe_gave_up``), and
another's fetches timed out at 30 s on both ranks (``failed_restores``).
"""

from __future__ import annotations

from typing import Any

#: ``redis_timeout_s`` for an engine under test that no Redis fault is injected into.
REDIS_TIMEOUT_S = 300.0

#: kvtier connector settings for such an engine: the Redis deadline above, and a request
#: may wait for its probe as many engine steps as that takes (the probe's own deadline is
#: the Redis timeout).
CONNECTOR: dict[str, Any] = {"redis_timeout_s": REDIS_TIMEOUT_S, "max_probe_asks": 10**9}

#: The daemon's ``redis_timeout_s`` for such tests: its largest allowed value.
DAEMON_REDIS_TIMEOUT_S = 60.0

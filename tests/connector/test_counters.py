"""The connector's counters: vLLM takes a delta every step, in every process."""

from __future__ import annotations

from connector.vllm_connector.stats import ConnectorCounters


def test_a_quiet_step_takes_an_empty_delta() -> None:
    c = ConnectorCounters()
    first = c.take_delta()  # the gauges, once
    assert first == {"redis_available": 0, "redis_configured": 0}
    assert c.take_delta() == {}
    c.set_gauge("redis_available", 0)  # the same value: nothing moved
    assert c.take_delta() == {}


def test_a_delta_names_the_counters_that_moved_and_the_gauges() -> None:
    c = ConnectorCounters()
    c.take_delta()
    c.add("lookups")
    c.add("lookups", 2)
    c.add("blocks_saved", 0)  # no amount: not moved
    assert c.take_delta() == {"lookups": 3, "redis_available": 0, "redis_configured": 0}
    assert c.take_delta() == {}
    c.set_gauge("redis_available", 1)
    assert c.take_delta() == {"redis_available": 1, "redis_configured": 0}
    c.add("lookups", 4)
    assert c.take_delta()["lookups"] == 4  # since the last delta, not since the start
    assert c.snapshot()["lookups"] == 7

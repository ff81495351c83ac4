"""The connector's metric names and HELP: one documented sentence each, no placeholders."""

from __future__ import annotations

import re

from connector.vllm_connector import stats


def test_counters_and_gauges_are_disjoint_and_documented() -> None:
    assert set(stats.COUNTERS).isdisjoint(stats.GAUGES)
    for name, help_text in {**stats.COUNTERS, **stats.GAUGES}.items():
        assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert not name.endswith("_total"), name  # Prometheus adds it to counters
        assert help_text[:1].isupper() or help_text[:1].isdigit(), (name, help_text)
        assert name not in help_text and "kvtier connector:" not in help_text, name


def test_the_counters_object_knows_every_counter() -> None:
    counters = stats.ConnectorCounters()
    for name in stats.COUNTERS:
        counters.add(name)
    assert all(counters.snapshot()[n] == 1 for n in stats.COUNTERS)

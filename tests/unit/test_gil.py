"""kvtier's short switch interval while Redis fetches are in flight: set by the first
fetch in, put back by the last one out, whatever the threads' order."""

from __future__ import annotations

import sys
import threading

import pytest

from connector.vllm_connector.gil import FETCH_SWITCH_INTERVAL_S, short_switch_interval

SHORT = pytest.approx(FETCH_SWITCH_INTERVAL_S, abs=2e-6)  # CPython keeps microseconds


def test_the_interval_is_short_while_any_fetch_is_inside_and_restored_after() -> None:
    before = sys.getswitchinterval()
    first_in = threading.Event()
    first_may_leave = threading.Event()
    seen: list[float] = []

    def first() -> None:
        with short_switch_interval():
            first_in.set()
            first_may_leave.wait(60)
        seen.append(sys.getswitchinterval())  # the main thread is still inside

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert first_in.wait(60)
        with short_switch_interval():
            assert sys.getswitchinterval() == SHORT
            first_may_leave.set()
            thread.join(60)
            assert seen == [SHORT]
        assert sys.getswitchinterval() == pytest.approx(before, abs=2e-6)
    finally:
        first_may_leave.set()
        thread.join(60)


def test_a_shorter_interval_already_set_is_kept() -> None:
    before = sys.getswitchinterval()
    sys.setswitchinterval(FETCH_SWITCH_INTERVAL_S / 2)
    try:
        with short_switch_interval():
            assert sys.getswitchinterval() == pytest.approx(FETCH_SWITCH_INTERVAL_S / 2,
                                                            abs=2e-6)
    finally:
        sys.setswitchinterval(before)

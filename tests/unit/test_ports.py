"""The tests' port picks never come from the ephemeral range (where outgoing connections
get their local ports), and every port of a span is free at the pick."""

from __future__ import annotations

import socket

from rigs.ports import _ephemeral_low, free_port


def test_picks_lie_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = _ephemeral_low()
    for span in (1, 3):
        port = free_port(span=span)
        assert 10000 <= port and port + span <= low
        for p in range(port, port + span):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", p))

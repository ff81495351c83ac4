"""The fault proxy the tests rely on: ``reset_all`` resets a connection that sits idle.

An idle connection's pump threads are blocked in ``recv``; closing their sockets from the
test's thread only dropped the descriptors, so no RST went out and the client waited on a
connection that forwarded nothing (a presence feed stayed silent for its whole
``redis_timeout_s``). The client must see the reset at once, and a new connection must work.
"""

from __future__ import annotations

import socket

import pytest

from rigs.tcp_proxy import TcpProxy
from tests.tiers.faults import wait_until

#: Ends a hang only: the reset is expected at once.
HANG_S = 60.0


def _ping(sock: socket.socket) -> bytes:
    sock.sendall(b"PING\r\n")
    return sock.recv(64)


def test_reset_all_resets_an_idle_connection_and_new_ones_forward(redis_url: str) -> None:
    port = int(redis_url.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = TcpProxy("127.0.0.1", port).start()
    try:
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S)
        assert _ping(client) == b"+PONG\r\n"  # forwarding; now idle, pumps in recv
        assert proxy.reset_all() == 2
        try:
            data = client.recv(64)
        except ConnectionResetError:
            data = None
        except TimeoutError:
            pytest.fail("the idle connection was never reset")
        assert not data  # reset (RST) or closed: never a reply, never a hang
        client.close()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S) as again:
            assert _ping(again) == b"+PONG\r\n"
    finally:
        proxy.stop()


def test_chunks_in_flight_do_not_wait_for_each_other(redis_url: str) -> None:
    """``latency_s`` delays each chunk from its arrival, as a link does: with an hour's
    latency the proxy still takes in every chunk sent (the first one's delay does not hold
    up the second's arrival), and none is delivered."""
    port = int(redis_url.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = TcpProxy("127.0.0.1", port).start()
    proxy.latency_s = 3600.0
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=HANG_S) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for n in range(1, 5):
                client.sendall(b"PING\r\n")
                assert wait_until(lambda n=n: proxy.in_flight == n, timeout=HANG_S)
            client.settimeout(0.0)
            with pytest.raises(BlockingIOError):
                client.recv(64)  # nothing delivered: every PING is still in the line
    finally:
        proxy.stop()

"""HostTierClient.close() against its reader thread reconnecting: close() never waits on a
connection it could not see (a real UNIX socket; the race is forced, not timed)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from offload_tiers.host_tier import client as client_module
from offload_tiers.host_tier.client import HostTierClient


def test_close_during_a_reconnect_does_not_wait_for_a_daemon_that_never_speaks(
        tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    path = str(tmp_path / "host.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)  # accepts (the kernel's backlog) and never answers: no Welcome
    c = HostTierClient(path, retry_s=0.0)
    close_called = threading.Event()

    class ConnectAfterClose(socket.socket):
        """The reader's socket connects only once close() has begun: close() then finds no
        published socket to shut down (the window the race needs, held open)."""

        def connect(self, address) -> None:  # noqa: ANN001
            close_called.wait()
            assert c._closed.wait(60)  # close() sets the flag first thing
            super().connect(address)

    monkeypatch.setattr(client_module.socket, "socket", ConnectAfterClose)
    c.start()
    closer = threading.Thread(target=c.close, daemon=True)

    real_set = c._closed.set

    def set_then_signal() -> None:
        real_set()
        close_called.set()

    c._closed.set = set_then_signal  # type: ignore[method-assign]
    closer.start()
    closer.join(60)  # a hang guard only: close() returns as soon as the reader sees the flag
    try:
        assert not closer.is_alive(), "close() waited on a connection nobody shut down"
        assert c._thread is None and c._sock is None
    finally:
        server.close()

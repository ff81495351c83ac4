"""A loopback TCP proxy a test controls: added latency, connection resets, black-holing."""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time

from rigs.ports import free_port


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a crashed peer or a middlebox would.

    ``shutdown(SHUT_RD)`` first: it wakes a pump thread blocked in ``recv`` on the socket.
    Without it ``close`` only drops the descriptor: the blocked ``recv`` keeps the socket
    open, no RST goes out, and the peer waits on a connection that forwards nothing until its
    own timeout (seen: a presence feed silent for its 300 s ``redis_timeout_s``)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target``; modes: ``forward``, ``blackhole``, ``refuse``.

    ``latency_s`` delays every forwarded chunk by that long after it arrived, as a network
    link does: chunks in flight do not wait for each other (a 1 MiB reply is not 16 chunks'
    delays late, and the proxy adds no limit on bandwidth); ``reset_all()`` RSTs every open
    connection;
    ``blackhole`` accepts and forwards nothing (a hung peer); ``refuse`` resets new
    connections at once. ``hold()`` keeps every chunk (both ways) until ``release()``: a
    peer as slow as the test needs, for exactly as long as it needs.
    """

    def __init__(self, target_host: str, target_port: int, *, port: int | None = None) -> None:
        self.target = (target_host, target_port)
        self.port = port or free_port()
        self.latency_s = 0.0
        self.mode = "forward"
        self.connections = 0
        self.in_flight = 0  # chunks received and not yet delivered (in the delay lines)
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._open = threading.Event()
        self._open.set()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> TcpProxy:
        self._thread.start()
        return self

    def hold(self) -> None:
        """Forward nothing more (chunks wait in the proxy) until ``release()``."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def reset_all(self) -> int:
        with self._lock:
            conns = list(self._conns)
            self._conns.clear()
        for sock in conns:
            _reset(sock)
        return len(conns)

    def stop(self) -> None:
        self._stop.set()
        self._open.set()
        self._thread.join(2)
        self._listener.close()
        self.reset_all()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            if self.mode == "refuse":
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=2)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Receive from ``src`` into a delay line; :meth:`_deliver` sends each chunk to
        ``dst`` once it is due."""
        line: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()
        threading.Thread(target=self._deliver, args=(line, src, dst), daemon=True).start()
        try:
            while not self._stop.is_set():
                data = src.recv(1 << 16)
                if not data:
                    break
                while self.mode == "blackhole" and not self._stop.is_set():
                    time.sleep(0.02)
                while not self._open.wait(0.05):  # held until release()
                    if self._stop.is_set():
                        return
                with self._lock:
                    self.in_flight += 1
                line.put((time.monotonic() + self.latency_s, data))
        except OSError:
            pass
        finally:
            line.put(None)  # the end: delivered after what came before it

    def _deliver(self, line: queue.SimpleQueue[tuple[float, bytes] | None],
                 src: socket.socket, dst: socket.socket) -> None:
        try:
            while (item := line.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0 and self._stop.wait(wait):
                    return  # stopped: what is in the line is not delivered
                dst.sendall(data)
                with self._lock:
                    self.in_flight -= 1
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            _reset(src)
            _reset(dst)

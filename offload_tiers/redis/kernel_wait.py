"""One pipelined batch's socket calls wait in the kernel, not in CPython's poll loop.

A socket with a Python timeout (redis-py's ``socket_timeout``) is non-blocking underneath:
CPython makes every ``recv``/``send`` a ``poll()`` and then the call, each letting the GIL
go and taking it back, and a large value arrives in as many pieces as the network hands
over. In a vLLM worker each of those takes can make the model's main thread wait for the
GIL (it is handed over at the latest after the switch interval, and then only once the
taker got a core). Inside :func:`kernel_wait` the socket is blocking, with the same
timeout given to the kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``): a value's payload is one
``recv_into`` with ``MSG_WAITALL`` and a batch's commands one ``sendmsg``, one take of the
GIL each, however the bytes arrive. TLS sockets and sockets without a timeout are left as
they are.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Iterator
from contextlib import contextmanager

#: The flag a payload read passes while the socket waits in the kernel (0: none).
WAITALL = getattr(socket, "MSG_WAITALL", 0)
_KERNEL_TIMEOUTS = (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)


def _timeval(seconds: float) -> bytes:
    """``struct timeval``; a positive timeout never rounds down to 0, which the kernel reads
    as "wait for ever"."""
    micros = int(seconds * 1e6)
    if seconds > 0:
        micros = max(micros, 1)
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


def _supported(sock: socket.socket) -> bool:
    return (bool(WAITALL) and not isinstance(sock, ssl.SSLSocket)
            and sock.type == socket.SOCK_STREAM)


@contextmanager
def kernel_wait(sock: socket.socket) -> Iterator[int]:
    """While inside, ``sock``'s calls block in the kernel under its own timeout; yields the
    flags a payload read passes (:data:`WAITALL`, or 0 where the socket is left as is).

    A call the kernel times out raises :class:`TimeoutError`, as a Python timeout would.
    On the way out the socket gets its Python timeout back and the kernel's are cleared.
    """
    timeout = sock.gettimeout()
    if timeout is None:  # blocking already, with no timeout to keep
        yield WAITALL if _supported(sock) else 0
        return
    if not timeout or not _supported(sock):
        yield 0
        return
    for option in _KERNEL_TIMEOUTS:
        sock.setsockopt(socket.SOL_SOCKET, option, _timeval(timeout))
    sock.settimeout(None)
    try:
        yield WAITALL
    except BlockingIOError as exc:  # EAGAIN from a blocking socket: its kernel timeout
        raise TimeoutError(f"no reply within the socket timeout ({timeout:g} s)") from exc
    finally:
        if sock.fileno() >= 0:
            sock.settimeout(timeout)
            for option in _KERNEL_TIMEOUTS:
                sock.setsockopt(socket.SOL_SOCKET, option, _timeval(0))

"""RESP on a connected socket: commands packed by hand, replies read by hand.

Rules this module keeps:

* A block's header and payload go to the socket as separate buffers (``sendmsg`` scatter
  list where the socket has one, ``sendall`` per chunk on TLS), the payload never copied.
* A bulk reply can be read straight into a caller's buffer (:meth:`Reader.read_into`): only
  the few bytes a small ``recv`` already took are copied, the rest is ``recv_into``'d there.
* :class:`Reader` owns no socket state: it is built for one pipelined batch and must end
  that batch with nothing buffered (:meth:`Reader.drained`), so redis-py can keep using the
  same connection afterwards. Any malformed reply raises :class:`ProtocolError`.
* RESP2 and RESP3 replies are understood; out-of-band RESP3 pushes are skipped.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

import numpy as np
from redis.exceptions import ResponseError

from offload_tiers._types import BytesLike

SMALL = 16 * 1024  # payloads below this are joined into the surrounding bytes (fewer syscalls)
FILL = 4096  # bytes one small recv asks for: enough for many short replies, little over-read
BUF = 64 * 1024  # the reader's own buffer (lines, headers, short replies, discarded bytes)
_IOV = 512  # buffers per sendmsg (Linux IOV_MAX is 1024)


class ProtocolError(ConnectionError):
    """The server sent something that is not a well-formed reply (the connection is unusable)."""


def bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def command(*args: bytes) -> bytes:
    """A whole small command as one ``bytes``."""
    return b"*%d\r\n" % len(args) + b"".join(bulk(a) for a in args)


def set_parts(name: bytes, header: bytes, payload: BytesLike, px_ms: int | None) -> list:
    """``SET name header+payload [PX ms]`` as ``[head, payload, tail]``."""
    nargs = 3 if px_ms is None else 5
    size = len(header) + memoryview(payload).nbytes
    head = b"*%d\r\n$3\r\nSET\r\n%s$%d\r\n%s" % (nargs, bulk(name), size, header)
    tail = b"\r\n" if px_ms is None else b"\r\n$2\r\nPX\r\n" + bulk(str(px_ms).encode())
    return [head, payload, tail]


class Packer:
    """Accumulates commands into as few chunks as possible for one send."""

    __slots__ = ("chunks", "_pending", "nbytes")

    def __init__(self) -> None:
        self.chunks: list = []
        self._pending = bytearray()
        self.nbytes = 0

    def add(self, parts: list) -> None:
        for part in parts:
            n = memoryview(part).nbytes
            self.nbytes += n
            if n < SMALL:
                self._pending += part
            else:
                if self._pending:
                    self.chunks.append(bytes(self._pending))
                    self._pending.clear()
                self.chunks.append(part)

    def finish(self) -> list:
        if self._pending:
            self.chunks.append(bytes(self._pending))
            self._pending.clear()
        out, self.chunks, self.nbytes = self.chunks, [], 0
        return out


def send_all(sock: socket.socket, chunks: list) -> None:
    """Send every chunk, in order: one ``sendmsg`` for many chunks where possible."""
    if isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        for chunk in chunks:
            sock.sendall(chunk)
        return
    views = [v for v in (memoryview(c).cast("B") for c in chunks) if v.nbytes]
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i:i + _IOV])
        while sent and i < len(views):
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0


class Reader:
    """Replies of one pipelined batch, read from ``sock`` (plain or TLS)."""

    __slots__ = ("_sock", "_payload_flags", "_buf", "_view", "_start", "_end")

    def __init__(self, sock: socket.socket, payload_flags: int = 0) -> None:
        """``payload_flags``: passed to the ``recv_into`` of a payload (``MSG_WAITALL`` while
        the socket waits in the kernel: ``offload_tiers/redis/kernel_wait.py``)."""
        self._sock = sock
        self._payload_flags = payload_flags
        self._buf = bytearray(BUF)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    # -------------------------------------------------------------- bytes
    def _fill(self, want: int = FILL) -> None:
        """Receive at least one more byte into the buffer (compacting it first if needed)."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end + want > BUF:
            kept = bytes(self._view[self._start:self._end])
            self._view[:len(kept)] = kept
            self._start, self._end = 0, len(kept)
        room = min(want, BUF - self._end)
        if room <= 0:
            raise ProtocolError("reply line longer than the read buffer")
        got = self._sock.recv_into(self._view[self._end:self._end + room], room)
        if not got:
            raise ConnectionResetError("connection closed by the server mid-reply")
        self._end += got

    def line(self) -> bytes:
        """The next line, without its CRLF."""
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                out = bytes(self._view[self._start:i])
                self._start = i + 2
                return out
            self._fill()

    def read_into(self, dest: memoryview) -> None:
        """Exactly ``dest.nbytes`` bytes into ``dest``; most of them straight from the socket."""
        n = dest.nbytes
        have = min(n, self._end - self._start)
        if have:
            dest[:have] = self._view[self._start:self._start + have]
            self._start += have
        pos = have
        while pos < n:
            got = self._sock.recv_into(dest[pos:], n - pos, self._payload_flags)
            if not got:
                raise ConnectionResetError("connection closed by the server mid-reply")
            pos += got

    def read_bytes(self, n: int) -> bytes | memoryview:
        """``n`` bytes: ``bytes`` when short; when long, a writable view of a fresh buffer
        filled straight from the socket (numpy's, as ``bytearray(n)`` zero-fills first)."""
        if n <= BUF // 2:
            while self._end - self._start < n:
                self._fill(max(FILL, n - (self._end - self._start)))
            out = bytes(self._view[self._start:self._start + n])
            self._start += n
            return out
        big = memoryview(np.empty(n, dtype=np.uint8))
        self.read_into(big)
        return big

    def skip(self, n: int) -> None:
        """Discard ``n`` bytes."""
        while n > 0:
            if self._start == self._end:
                self._fill(min(BUF, n))
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    def crlf(self) -> None:
        """Consume the CRLF that ends a bulk reply."""
        while self._end - self._start < 2:
            self._fill()
        if self._view[self._start:self._start + 2] != b"\r\n":
            raise ProtocolError("bulk reply not terminated by CRLF")
        self._start += 2

    def drained(self) -> bool:
        """True when nothing beyond the replies read so far was received."""
        return self._start == self._end

    # -------------------------------------------------------------- replies
    def bulk_len(self) -> int | ResponseError | None:
        """Start reading a string reply: its length (the caller consumes ``n`` bytes, then
        :meth:`crlf`), None for a null, or the error reply (already consumed)."""
        while True:
            line = self.line()
            kind, rest = line[:1], line[1:]
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else n
            if kind == b"_":
                return None
            if kind == b">":  # RESP3 out-of-band push: not ours, skip it
                self._finish(kind, rest)
                continue
            reply = self._finish(kind, rest)
            if isinstance(reply, ResponseError):
                return reply
            raise ProtocolError(f"expected a string reply, got type {kind!r}")

    def reply(self) -> Any:
        """One whole reply: bytes (a memoryview when long), int, None, bool, float, list, dict or
        ResponseError (an error reply is a value here, not an exception)."""
        while True:
            line = self.line()
            kind, rest = line[:1], line[1:]
            if kind != b">":
                return self._finish(kind, rest)
            self._finish(kind, rest)

    def _finish(self, kind: bytes, rest: bytes) -> Any:
        if kind == b"+":
            return rest
        if kind == b"-":
            return ResponseError(rest.decode(errors="replace"))
        if kind in (b":", b"("):
            return int(rest)
        if kind in (b"$", b"!", b"="):
            n = int(rest)
            if n < 0:
                return None
            data = self.read_bytes(n)
            self.crlf()
            if kind == b"!":
                return ResponseError(bytes(data).decode(errors="replace"))
            return data[4:] if kind == b"=" else data
        if kind in (b"*", b"~", b">"):
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        if kind == b"%":
            items = [self.reply() for _ in range(2 * int(rest))]
            return {_hashable(k): v for k, v in zip(items[::2], items[1::2], strict=True)}
        if kind == b"_":
            return None
        if kind == b"#":
            return rest == b"t"
        if kind == b",":
            return float(rest)
        raise ProtocolError(f"unknown reply type {kind!r}")


def _hashable(value: Any) -> Any:
    return bytes(value) if isinstance(value, memoryview) else value

"""Hand-packed RESP commands, so a block's header and payload go to the socket as separate
buffers with no copy of the payload (redis-py's hiredis packer copies every value twice).
"""

from __future__ import annotations

from offload_tiers._types import BytesLike

SMALL = 16 * 1024  # payloads below this are joined into the surrounding bytes (fewer syscalls)


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
    """Accumulates commands into as few chunks as possible for ``sendall``."""

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

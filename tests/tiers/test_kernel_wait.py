"""kernel_wait: a batch's socket calls block in the kernel under the socket's own timeout, so
a value's payload is one ``recv_into`` however it arrives, a silent peer still times out, and
the socket leaves as it came."""

from __future__ import annotations

import platform
import socket
import struct
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from offload_tiers.redis.kernel_wait import WAITALL, _timeval, kernel_wait
from offload_tiers.redis.resp import Reader
from tests.tiers.faults import wait_until

# recvfrom's syscall number, to see a thread asleep inside it (/proc/.../syscall)
_RECVFROM = {"x86_64": 45, "aarch64": 207}.get(platform.machine())
PIECES = 16
PIECE = 64 * 1024


class CountingSocket(socket.socket):
    """A socket that counts its ``recv_into`` calls."""

    recv_calls = 0

    def recv_into(self, *args, **kwargs) -> int:  # type: ignore[no-untyped-def]
        got = super().recv_into(*args, **kwargs)
        type(self).recv_calls += 1
        return got


@pytest.fixture
def pair() -> Iterator[tuple[CountingSocket, socket.socket]]:
    a, b = socket.socketpair()
    reader = CountingSocket(a.family, a.type, a.proto, fileno=a.detach())
    reader.settimeout(30.0)
    CountingSocket.recv_calls = 0
    yield reader, b
    reader.close()
    b.close()


def _in_recvfrom(tid: int) -> bool:
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            return f.read().split()[0] == str(_RECVFROM)
    except (FileNotFoundError, IndexError):
        return False


def _read_in_pieces(reader: CountingSocket, peer: socket.socket, use_kernel_wait: bool
                    ) -> bool:
    """``PIECES`` pieces, each sent only once the reader waits for it: asleep in ``recvfrom``
    (kernel_wait: one call for all), or done with the call that took the last piece."""
    data = np.random.default_rng(0).integers(0, 255, PIECES * PIECE, dtype=np.uint8)
    dest = np.zeros_like(data)
    tid: list[int] = []
    errors: list[BaseException] = []

    def read() -> None:
        tid.append(threading.get_native_id())
        try:
            if use_kernel_wait:
                with kernel_wait(reader) as flags:
                    Reader(reader, flags).read_into(memoryview(dest))
            else:
                Reader(reader).read_into(memoryview(dest))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    thread = threading.Thread(target=read)
    thread.start()
    assert wait_until(lambda: bool(tid))
    for i in range(PIECES):
        if use_kernel_wait:
            assert wait_until(lambda: _in_recvfrom(tid[0]) or not thread.is_alive())
        peer.sendall(data[i * PIECE:(i + 1) * PIECE].tobytes())
        if not use_kernel_wait:
            assert wait_until(lambda i=i: CountingSocket.recv_calls > i
                              or not thread.is_alive())
    thread.join()
    assert not errors, errors
    return dest.tobytes() == data.tobytes()


@pytest.mark.skipif(_RECVFROM is None or not WAITALL, reason="x86_64/aarch64 Linux only")
def test_a_payload_sent_in_pieces_is_one_recv(pair: tuple[CountingSocket, socket.socket]
                                              ) -> None:
    reader, peer = pair
    assert _read_in_pieces(reader, peer, use_kernel_wait=True)
    assert CountingSocket.recv_calls == 1


def test_without_it_the_same_pieces_take_a_recv_each(
        pair: tuple[CountingSocket, socket.socket]) -> None:
    reader, peer = pair
    assert _read_in_pieces(reader, peer, use_kernel_wait=False)
    assert CountingSocket.recv_calls >= PIECES


def _kernel_timeouts(sock: socket.socket) -> list[tuple[int, int]]:
    size = struct.calcsize("@ll")
    return [struct.unpack("@ll", sock.getsockopt(socket.SOL_SOCKET, opt, size))
            for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)]


def test_a_silent_peer_times_out_and_the_socket_leaves_as_it_came(
        pair: tuple[CountingSocket, socket.socket]) -> None:
    reader, peer = pair
    reader.settimeout(0.2)
    peer.sendall(b"half a payload")
    dest = np.zeros(1 << 20, dtype=np.uint8)
    with pytest.raises(TimeoutError, match="socket timeout"):
        with kernel_wait(reader) as flags:
            assert reader.gettimeout() is None  # blocking inside, the kernel keeps the time
            assert _kernel_timeouts(reader) == [(0, 200_000)] * 2
            Reader(reader, flags).read_into(memoryview(dest))
    assert dest[:14].tobytes() == b"half a payload"
    assert reader.gettimeout() == 0.2
    assert _kernel_timeouts(reader) == [(0, 0)] * 2


def test_a_socket_without_a_timeout_or_a_non_blocking_one_is_left_alone(
        pair: tuple[CountingSocket, socket.socket]) -> None:
    reader, _peer = pair
    reader.settimeout(None)
    with kernel_wait(reader) as flags:
        assert flags == WAITALL and reader.gettimeout() is None
    reader.setblocking(False)
    with kernel_wait(reader) as flags:
        assert flags == 0 and reader.gettimeout() == 0.0
    assert _kernel_timeouts(reader) == [(0, 0)] * 2


def test_a_tiny_timeout_is_still_a_timeout_for_the_kernel() -> None:
    size = struct.calcsize("@ll")
    assert struct.unpack("@ll", _timeval(1e-9)) == (0, 1)  # 0 would mean no timeout at all
    assert struct.unpack("@ll", _timeval(2.5)) == (2, 500_000)
    assert struct.unpack("@ll", _timeval(0)) == (0, 0)
    assert len(_timeval(5.0)) == size

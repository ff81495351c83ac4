"""Free loopback ports for servers the tests and benchmarks start themselves.

A port the test picks is bound later by another process (a publisher, a server), so it
must not be one the kernel may hand out meanwhile: ports from the ephemeral range (what
binding port 0 returns) are also every outgoing connection's local port, and a Redis client
connecting elsewhere in the suite once took a ZMQ publisher's port between the pick and
the bind ("Address already in use"). Picks come from below that range instead, at random,
each checked free.
"""

from __future__ import annotations

import random
import socket

_LOWEST = 10000


def _ephemeral_low() -> int:
    """The start of the kernel's ephemeral port range (32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_free(port: int) -> bool:
    """Whether a TCP socket can bind ``port`` on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A TCP port P on 127.0.0.1, outside the ephemeral range, with P..P+span-1 free now."""
    high = _ephemeral_low() - span
    if high <= _LOWEST:  # an unusual range: fall back to the kernel's pick
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return int(sock.getsockname()[1])
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(_LOWEST, high)
        if all(port_free(port + i) for i in range(span)):
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")

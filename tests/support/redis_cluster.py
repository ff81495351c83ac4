"""A real 3-master Redis Cluster on loopback ports (20000-29999), started and torn down by tests."""

from __future__ import annotations

import random
import subprocess
import time
from pathlib import Path

import redis

from rigs.ports import port_free
from rigs.redis_server import RedisServer


def cluster_ports(count: int = 3) -> list[int]:
    """``count`` ports in 20000-29999 whose cluster-bus port (+10000) is free too."""
    chosen: list[int] = []
    candidates = list(range(20000, 30000))
    random.shuffle(candidates)
    for port in candidates:
        if port in chosen:
            continue
        if port_free(port) and port_free(port + 10000):
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise RuntimeError("no free ports for a Redis Cluster")


class RedisClusterProcs:
    """Three masters, no replicas, slots split by ``redis-cli --cluster create``."""

    def __init__(self, workdir: Path, masters: int = 3) -> None:
        ports = cluster_ports(masters)
        self.servers = [
            RedisServer(workdir / f"node-{p}", "--cluster-enabled", "yes",
                        "--cluster-config-file", f"nodes-{p}.conf",
                        "--cluster-node-timeout", "2000", port=p)
            for p in ports
        ]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.servers[0].port}/0"

    def start(self) -> RedisClusterProcs:
        for server in self.servers:
            server.start()
        nodes = [f"127.0.0.1:{s.port}" for s in self.servers]
        subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            infos = [s.client().execute_command("CLUSTER", "INFO") for s in self.servers]
            if all(b"cluster_state:ok" in (i if isinstance(i, bytes) else i.encode())
                   for i in infos):
                return self
            time.sleep(0.2)
        raise TimeoutError("Redis Cluster did not reach cluster_state:ok")

    def total_keys(self, pattern: str) -> dict[int, int]:
        out = {}
        for server in self.servers:
            client = redis.Redis(host="127.0.0.1", port=server.port)
            out[server.port] = sum(1 for _ in client.scan_iter(match=pattern, count=1000))
        return out

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

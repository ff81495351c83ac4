"""End to end: LMCache's MP server started as its users start it (``lmcache server`` with an
``--l2-adapter`` JSON naming kvtier's adapter), stored into and retrieved from through LMCache's
own client (``lmcache bench server --mode cpu``, its CPU request path over POSIX shared
memory). After LMCache's L1 is cleared, a second run must find every chunk in kvtier's Redis
tier and retrieve the same bytes (LMCache's own checksum over what it holds)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from rigs.ports import free_port

LMCACHE = str(Path(sys.executable).parent / "lmcache")


class MPServer:
    """``lmcache server`` in a process of its own, with kvtier's adapter."""

    def __init__(self, workdir: Path, redis_url_env: str, key_prefix: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log_path = workdir / "lmcache-server.log"
        spec = {"type": "plugin", "module_path": "connector.lmcache_l2.adapter",
                "class_name": "KvtierL2Adapter",
                "adapter_params": {"redis_url_env": redis_url_env, "key_prefix": key_prefix}}
        self.args = [LMCACHE, "server", "--host", "127.0.0.1", "--port", str(self.port),
                     "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                     "--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--chunk-size", "256",
                     "--l2-adapter", json.dumps(spec)]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 600.0) -> MPServer:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:  # readiness of another process: polled
            if self.proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited {self.proc.returncode}: "
                                   f"{self.log_path.read_text()[-3000:]}")
            try:
                if self.status().get("is_healthy") is not None:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"lmcache server not up after {timeout} s")

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.http}/status", timeout=10) as reply:  # noqa: S310
            return json.loads(reply.read())

    def client(self, *args: str) -> str:
        """Run one of LMCache's own client commands against the server; its stdout."""
        done = subprocess.run([LMCACHE, *args], capture_output=True, text=True, timeout=300,
                              env=os.environ)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def mp_server(tmp_path: Path, redis_url: str, key_prefix: str,
              monkeypatch: pytest.MonkeyPatch) -> Iterator[MPServer]:
    monkeypatch.setenv("KVTIER_LMCACHE_REDIS_URL", redis_url)  # credentials by environment
    server = MPServer(tmp_path, "KVTIER_LMCACHE_REDIS_URL", key_prefix).start()
    yield server
    server.stop()


def _bench(server: MPServer) -> str:
    return server.client("bench", "server", "--mode", "cpu", "--transfer-mode",
                         "lmcache_driven", "--rpc-url", f"tcp://127.0.0.1:{server.port}",
                         "--url", server.http, "--num-tokens", "512", "--start", "0",
                         "--end", "2", "--interval", "0")


def _checksums(out: str, phase: str) -> dict[str, set[str]]:
    """Per request, the checksums LMCache's client printed in ``phase`` (cold / warm)."""
    found: dict[str, set[str]] = {}
    for seq, value in re.findall(rf"\[seq (\d+)/{phase}\] CHECKSUM: ([0-9a-f]+)", out):
        found.setdefault(seq, set()).add(value)
    return found


def _wait_for(condition: Any, what: str, timeout: float = 600.0) -> None:
    """Wait for a condition another process makes true (LMCache writes to L2 after its
    client's STORE returned): checked with a deadline, never a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_lmcache_mp_server_stores_into_and_retrieves_from_kvtier(
        mp_server: MPServer, redis_url: str, key_prefix: str) -> None:
    first = _bench(mp_server)
    stored = _checksums(first, "cold")  # the client's own KV, before it stored it
    assert set(stored) == {"0", "1"}, first[-3000:]
    raw = redis.Redis.from_url(redis_url)

    def chunks() -> list[bytes]:
        return [k for k in raw.scan_iter(match=f"{key_prefix}:*", count=1000)
                if not k.endswith(b":lmcache-namespaces")]

    def l2_stored() -> int:
        return mp_server.status()["storage_manager"]["l2_adapters"][0]["adapter"]["keys_stored"]

    _wait_for(lambda: l2_stored() >= 4, "LMCache's L2 store of 4 chunks")
    assert len(chunks()) == 4  # 2 requests x 2 full 256-token chunks, one value each

    mp_server.client("kvcache", "clear", "--url", mp_server.http)  # LMCache's L1 only
    second = _bench(mp_server)
    assert re.findall(r"\[seq (\d)/cold\] LOOKUP: 2/2 chunks hit", second) == ["0", "1"], \
        second[-3000:]
    got = _checksums(second, "warm")  # what LMCache holds after it fetched them from Redis
    assert set(got) == {"0", "1"} and got == stored, second[-3000:]

    (status,) = mp_server.status()["storage_manager"]["l2_adapters"]
    counts = status["adapter"]
    assert status["type"] == "kvtier-redis" and status["is_healthy"] is True
    assert counts["keys_stored"] >= 4 and counts["keys_loaded"] >= 4
    assert counts["locks"] == counts["unlocks"] and counts["lock_count"] == 0
    assert status["tier"]["corrupt"] == 0
    assert status["current_size_bytes"] == 4 * 2 * 32 * 256 * 8 * 128 * 2  # fp16, 32 layers

"""A real ``kvtier daemon`` process on loopback ports that a test owns."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_LISTENING = re.compile(rb"kvtier daemon listening on http://[^:\s]+:(\d+)")


class DaemonProcess:
    """``python -m connector.daemon.cli ...`` with an HTTP port of its own: the one given, or
    one the daemon binds itself (port 0) and prints, so no port chosen in advance can be
    taken by another process before the daemon binds it."""

    def __init__(self, *args: str, http_port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.http_port = http_port or 0
        self.env = dict(env or {})
        self.args = [*args, "--http", f"127.0.0.1:{self.http_port}"]
        self.proc: subprocess.Popen[bytes] | None = None
        self._lines: list[bytes] = []
        self._listening = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def command(self) -> list[str]:
        """How the daemon is started (subclasses start it as ``kvtier daemon``)."""
        return [sys.executable, "-m", "connector.daemon.cli", *self.args]

    def start(self, timeout: float = 120.0) -> DaemonProcess:
        """Start it and wait for its "listening" line (its HTTP site and host tier are up),
        then for ``/healthz``. The deadline is one only a hung daemon reaches."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self.proc = subprocess.Popen(
            self.command(), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        self._reader = threading.Thread(target=self._read_output, name="daemon-output",
                                        daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        while not self._listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"daemon exited {self.proc.returncode} before listening: "
                                   f"{self.output.decode(errors='replace')[-3000:]}")
        last: object = None  # the last /healthz answer or error, for the failure message
        while time.monotonic() < deadline:
            try:
                last = self.get("/healthz")
                if last["status"] == "ok":
                    return self
            except (urllib.error.URLError, ConnectionError, OSError) as exc:
                last = exc
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"daemon did not become healthy (last /healthz: {last!r}): "
                           f"{self.output.decode(errors='replace')[-3000:]}")

    def _read_output(self) -> None:
        """Keep the daemon's output (it never blocks on a full pipe); note its port."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.append(line)
            found = _LISTENING.search(line)
            if found and not self._listening.is_set():
                self.http_port = int(found.group(1))
                self._listening.set()

    @property
    def output(self) -> bytes:
        """Everything the daemon printed so far (all of it once it has exited)."""
        if self.proc is not None and self.proc.poll() is not None and self._reader:
            self._reader.join(timeout=10)
        return b"".join(self._lines)

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.base + path, timeout=10) as resp:  # noqa: S310
            body = resp.read()
        return body.decode() if path == "/metrics" else json.loads(body)

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data,  # noqa: S310
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def lookup(self, hashes: list[Any], group: int = 0, **extra: Any) -> dict[str, Any]:
        status, body = self.post("/lookup", {"block_hashes": hashes, "group_idx": group, **extra})
        assert status == 200, body
        return body

    def stats(self) -> dict[str, Any]:
        return self.get("/stats")

    def source(self, i: int = 0) -> dict[str, Any]:
        return self.stats()["sources"][i]

    def wait_for(self, predicate: Any, timeout: float = 60.0, what: str = "condition") -> Any:
        """Poll /stats until ``predicate(stats)`` is truthy; return that stats snapshot."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.stats()
            if predicate(last):
                return last
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}; last stats: {json.dumps(last)}")

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; return the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def rss_bytes(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class HostTierDaemon(DaemonProcess):
    """``kvtier daemon`` serving a host tier: ``slots`` slots of ``slot_bytes`` on the
    Unix socket ``sock``, its segment named ``name`` (/dev/shm/kvtier-NAME); with
    ``redis_url`` it also writes behind to Redis and restores from it (``redis_prefix``;
    ``redis_timeout_s``: the daemon's bound on every Redis wait, its default when None)."""

    def __init__(self, sock: Path, name: str, *, slots: int = 8, slot_bytes: int = 4096,
                 redis_url: str | None = None, redis_prefix: str = "kvtier",
                 redis_timeout_s: float | None = None) -> None:
        redis = ["--redis-url", redis_url, "--redis-prefix", redis_prefix] if redis_url else []
        if redis_timeout_s is not None:
            redis += ["--redis-timeout-s", str(redis_timeout_s)]
        super().__init__("--cpu-bytes", str(slots * slot_bytes), "--slot-bytes",
                         str(slot_bytes), "--host-tier-socket", str(sock),
                         "--host-tier-name", name, *redis)
        self.sock = sock
        self.name = name

    def tier(self) -> dict[str, Any]:
        return self.stats()["host_tier"]

    @contextlib.contextmanager
    def running(self) -> Iterator[HostTierDaemon]:
        """Started; killed and its files removed on exit."""
        self.start()
        try:
            yield self
        finally:
            self.kill()
            self.remove_files()

    def remove_files(self) -> None:
        """The segment, pin table and lock file a killed daemon leaves behind."""
        for suffix in ("", ".pins", ".lock"):
            Path(f"/dev/shm/kvtier-{self.name}{suffix}").unlink(missing_ok=True)

"""The demo's host tier: a ``kvtier daemon --cpu-bytes`` child process for one demo run.

The daemon holds the host's shared CPU tier (a segment in ``/dev/shm`` and a Unix socket
in a private temporary directory); the demo's kvtier engines attach to it by the socket.
It outlives each engine, so an engine restarted on the same host restores its prefixes
from it without Redis. With Redis, the daemon holds the Redis connection (the engines set
``host_tier_redis`` and open none): its URL reaches the daemon by its environment only.
Stopped (SIGTERM: it writes what it queued for Redis, removes its socket, segment and pin
table) when the demo ends. Does not import vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any

_LISTENING = "kvtier daemon listening on "
STOP_TIMEOUT_S = 30.0


class HostTierStartError(RuntimeError):
    """The daemon exited before it served; the message carries its last output lines."""


class DemoHostTier:
    """A host-tier daemon for one demo run: ``socket`` to give the engines, ``stats()``."""

    def __init__(self, run_id: str, cpu_bytes: int, slot_bytes: int, *,
                 redis_url_env: str | None = None, redis_prefix: str | None = None,
                 secrets: dict[str, str] | None = None) -> None:
        """``redis_url_env``: the variable of ``secrets`` holding the Redis URL the daemon
        writes behind to and restores from (under ``redis_prefix``); None: no Redis."""
        self.name = f"demo-{run_id}"
        self.cpu_bytes = cpu_bytes
        self.slot_bytes = slot_bytes
        self.redis_url_env = redis_url_env
        self.redis_prefix = redis_prefix
        self._secrets = dict(secrets or {})
        self._dir = Path(tempfile.mkdtemp(prefix="kvtier-demo-host-"))  # mode 0700
        self.socket = str(self._dir / "host.sock")
        self._proc: subprocess.Popen[str] | None = None
        self._base = ""
        self._lines: deque[str] = deque(maxlen=40)

    def start(self) -> DemoHostTier:
        """Start the daemon and wait until it serves (its "listening" line)."""
        cmd = [sys.executable, "-m", "connector.cli", "daemon", "--cpu-bytes",
               str(self.cpu_bytes), "--slot-bytes", str(self.slot_bytes),
               "--host-tier-socket", self.socket, "--host-tier-name", self.name,
               "--http", "127.0.0.1:0"]
        if self.redis_url_env:
            cmd += ["--redis-url-env", self.redis_url_env,
                    "--redis-prefix", self.redis_prefix or "kvtier"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env={**os.environ, **self._secrets})
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.append(line.rstrip())
            if line.startswith(_LISTENING):
                self._base = line[len(_LISTENING):].strip()
                break
        else:
            self._proc.wait()
            tail = "\n".join(self._lines)
            raise HostTierStartError(f"kvtier daemon exited {self._proc.returncode} before "
                                     f"serving:\n{tail}")
        # keep reading its output, so a chatty daemon never blocks on a full pipe
        threading.Thread(target=self._drain, name="demo-host-tier-output", daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.append(line.rstrip())

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def stats(self) -> dict[str, Any]:
        """The daemon's host-tier statistics (its ``/stats``)."""
        with urllib.request.urlopen(self._base + "/stats", timeout=10) as resp:  # noqa: S310
            return dict(json.loads(resp.read())["host_tier"])

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after :data:`STOP_TIMEOUT_S`); remove the directory."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
                for suffix in ("", ".pins", ".lock"):  # a killed daemon leaves its files
                    Path(f"/dev/shm/kvtier-{self.name}{suffix}").unlink(missing_ok=True)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> DemoHostTier:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

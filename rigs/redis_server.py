"""A real redis-server on a loopback port that a test owns: start, SIGKILL, SIGSTOP, restart."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import redis

from rigs.ports import free_port


class RedisServer:
    """One redis-server the test controls. Nothing is persisted to disk."""

    def __init__(self, workdir: Path, *extra_args: str, port: int | None = None,
                 password: str | None = None, nice: int = 0) -> None:
        """``nice``: the server's niceness (``nice -n``; a benchmark's stand-in for a Redis
        on another host takes only what the machine's other processes leave)."""
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (scripts/bootstrap.sh installs it)")
        self.port = port or free_port()
        self.workdir = workdir
        self.password = password
        self.extra_args = list(extra_args)
        self.nice = nice
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def add_acl_user(self, name: str, password: str) -> str:
        """An ACL user with its own password (all commands, every key); its URL."""
        self.client().acl_setuser(name, enabled=True, passwords=[f"+{password}"],
                                  keys=["*"], commands=["+@all"])
        return f"redis://{name}:{password}@127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password,
                           socket_timeout=2)

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
                "--logfile", str(self.workdir / f"redis-{self.port}.log")]
        if self.password:
            args += ["--requirepass", self.password]
        if self.nice:
            args = ["nice", "-n", str(self.nice), *args]
        self.proc = subprocess.Popen(args + self.extra_args, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                log = (self.workdir / f"redis-{self.port}.log")
                text = log.read_text() if log.exists() else ""
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}: {text[-2000:]}"
                )
            try:
                if self.client().ping():
                    return
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                pass
            except redis.AuthenticationError:
                return
            time.sleep(0.05)
        raise TimeoutError(f"redis-server on port {self.port} not ready after {timeout}s")

    def kill(self) -> None:
        """SIGKILL: the server disappears with no goodbye."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the socket stays open but nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.proc = None


class SecretRedis:
    """A redis-server that requires a password, with an ACL user: the secrets a test
    greps for (``secrets``) and the URLs that carry them."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.user_password = f"user-{uuid.uuid4().hex}"
        self.user_url = server.add_acl_user("kvtier", self.user_password)
        self.admin_url = server.url
        self.secrets = (server.password or "", self.user_password)

    def found_in(self, text: str) -> list[str]:
        """The secrets (masked) that occur in ``text``: what a test asserts is empty."""
        return [f"{s[:5]}..." for s in self.secrets if s and s in text]

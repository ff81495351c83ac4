"""One long-lived process per test worker that runs engine specs one after another.

A plain engine start on this machine is ~24 s: ~8 s each for the engine core and the worker
vLLM spawns (the CPU platform always spawns) to import vLLM and torch, a few seconds to load
and warm up, and the caller's own ~7 s import of vLLM before that. The engine core and
workers must be fresh per engine (each spec's connector, CPU tier and settings are its own),
but the imports need not be repeated: this host imports vLLM once and runs every spec's
``LLM(...)`` in it, under vLLM's default executors, and starts the engine processes from a
preloaded fork server (:mod:`tests.support.fast_start`: the same processes, environment
and OpenMP set-up as spawned ones, ~3 s instead of ~20 s). Per spec it

* restores ``os.environ`` and the logging handlers afterwards (a spec's settings never
  leak into the next one),
* sends everything written to file descriptors 1 and 2 during the spec (its own and its
  engine processes' output) to that spec's log, returned as ``result["log"]``,
* shuts the engine down after the result is sent, in the background (the test reads the
  result meanwhile); the next spec starts once it is gone, and any engine process a spec
  left behind is killed then (one engine per host at a time, never a leak), except
* baseline engines (vLLM without kvtier) a spec asks to keep (:func:`keep_engine`, used by
  ``connector_runner``): later specs of the same model and settings reuse them after a
  prefix-cache reset, so a baseline is started once per test worker, not once per module.

Protocol (one JSON object per line): ``{"target": "module:function", "spec": {...}}`` in;
``RESULT {...}`` or ``ERROR {"error": text}`` out. The client restarts a host that died and
kills one that overran its timeout.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from rigs import engine_starts
from tests.support import fast_start

REPO = Path(__file__).resolve().parents[2]
#: What a spec's ``run`` hands over to be shut down once the result is sent.
_pending_shutdowns: list[threading.Thread] = []
#: Shutdowns under way (joined before the host exits).
_running_shutdowns: list[threading.Thread] = []
#: Engine-core processes of engines kept for later specs (see :func:`keep_engine`).
_kept_pids: dict[int, Any] = {}
#: The preloaded fork server engine processes start from (see :mod:`fast_start`), if any.
_server_pid: int | None = None


def defer_shutdown(llm: Any) -> None:
    """Shut ``llm``'s engine down after the result is sent (in the host), or now."""
    core = llm.llm_engine.engine_core

    def stop() -> None:
        core.shutdown()

    if os.environ.get("KVTIER_ENGINE_HOST") != "1":
        stop()
        return
    _pending_shutdowns.append(threading.Thread(target=stop, name="engine-shutdown",
                                               daemon=True))


def core_pids(llm: Any) -> list[int]:
    manager = getattr(llm.llm_engine.engine_core.resources, "engine_manager", None)
    return [int(p.pid) for p in getattr(manager, "processes", ()) if p.pid is not None]


def keep_engine(llm: Any) -> None:
    """Keep ``llm``'s engine running after its spec (a baseline that later specs reuse):
    its processes are not taken for leftovers. Only in the host."""
    for pid in core_pids(llm):
        _kept_pids[pid] = llm


def release_engine(llm: Any) -> None:
    """A kept engine is no longer kept: shut down like any spec's engine."""
    for pid in [p for p, kept in _kept_pids.items() if kept is llm]:
        del _kept_pids[pid]
    defer_shutdown(llm)


def _kept_processes() -> set[int]:
    """Kept engines' processes: their engine cores and whatever those started (under the
    fork server a worker's parent is the server, so its starter comes from the log)."""
    kept = set(_kept_pids)
    started = _fast_start_log()
    grown = True
    while grown:
        before = len(kept)
        kept |= {child for child, starter in started if starter in kept}
        grown = len(kept) != before
    return kept


def _fast_start_log() -> list[tuple[int, int]]:
    path = os.environ.get(fast_start.STARTED_LOG_ENV)
    if not path or not os.path.exists(path):
        return []
    with open(path) as fh:
        return [(int(a), int(b)) for a, b in (line.split() for line in fh if line.strip())]


def _leftover_engine_processes() -> list[int]:
    """Engine processes (children of this host or of its fork server) that outlived their
    spec's shutdown; none should."""
    parents = {os.getpid()} | ({_server_pid} if _server_pid else set())
    kept, found = _kept_processes(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == _server_pid:
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if (int(fields[1]) in parents and fields[0] != "Z" and b"resource_tracker" not in cmdline
                and int(entry) not in kept):
            found.append(int(entry))
    return found


def _finish_previous_engines() -> None:
    """Wait for the previous spec's engine to be shut down; kill what it left behind."""
    for thread in _running_shutdowns:
        thread.join(120)  # a shutdown takes ~5 s; only a hung one takes this long
    _running_shutdowns.clear()
    for pid in _leftover_engine_processes():
        print(f"engine host: killing process {pid} left by the previous spec", file=sys.stderr)
        os.kill(pid, signal.SIGKILL)


def _serve_one(line: str, out_fd: int) -> None:
    _finish_previous_engines()  # one engine at a time (the next one starts afterwards)
    request = json.loads(line)
    module_name, func_name = request["target"].split(":")
    env_before = dict(os.environ)
    root = logging.getLogger()
    handlers_before, level_before = list(root.handlers), root.level
    log = tempfile.NamedTemporaryFile(prefix="kvtier-engine-", suffix=".log", delete=False)
    saved = (os.dup(1), os.dup(2))  # the host's own log
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    reply: str
    try:
        for key, value in (request.get("env") or {}).items():
            os.environ.setdefault(key, value)
        func = getattr(importlib.import_module(module_name), func_name)
        result = func(request["spec"])
        gc.collect()  # an engine nobody holds any more is shut down now, not later
        reply = "RESULT " + json.dumps({**result, "log_path": log.name})
    except BaseException as exc:  # the client raises it, with the spec's log
        reply = "ERROR " + json.dumps({"error": "".join(traceback.format_exception(exc)),
                                       "log_path": log.name})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        log.close()
        os.environ.clear()
        os.environ.update(env_before)
        for handler in list(root.handlers):
            if handler not in handlers_before:
                root.removeHandler(handler)
        root.setLevel(level_before)
    os.write(out_fd, (reply + "\n").encode())
    while _pending_shutdowns:
        thread = _pending_shutdowns.pop()
        thread.start()
        _running_shutdowns.append(thread)


def serve() -> None:
    """The host's loop: import vLLM once, then one spec per stdin line."""
    global _server_pid
    os.environ["KVTIER_ENGINE_HOST"] = "1"
    from connector.demo.presets import apply_cpu_engine_env

    apply_cpu_engine_env()
    out_fd = os.dup(1)  # the protocol's own channel
    between = tempfile.NamedTemporaryFile(prefix="kvtier-engine-host-", suffix=".log",
                                          delete=False)
    started = tempfile.NamedTemporaryFile(prefix="kvtier-engine-host-", suffix=".pids",
                                          delete=False)
    sys.stdout.flush()
    os.dup2(between.fileno(), 1)  # output between specs (engine exits) goes here
    os.dup2(between.fileno(), 2)
    if fast_start.enabled():
        os.environ[fast_start.STARTED_LOG_ENV] = started.name
        _server_pid = fast_start.install()  # its imports overlap this host's own
    import vllm  # noqa: F401  (the cost this host pays once)

    os.write(out_fd, b"READY\n")
    try:
        for line in sys.stdin:
            if line.strip():
                _serve_one(line, out_fd)
        for llm in {id(v): v for v in _kept_pids.values()}.values():
            _running_shutdowns.append(threading.Thread(target=llm.llm_engine.engine_core.shutdown))
            _running_shutdowns[-1].start()
        _kept_pids.clear()
        _finish_previous_engines()
    finally:
        between.close()
        os.unlink(between.name)
        started.close()
        os.unlink(started.name)


class EngineHost:
    """The client: a host process started on first use, restarted when it died."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.engine_host"], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self._lines = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self._lines), daemon=True).start()
        first = self._lines.get(timeout=600)
        if first != "READY":
            self.stop()
            raise RuntimeError(f"the engine host did not start: {first!r}")

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    def call(self, target: str, spec: dict[str, Any], timeout: float,
             env: dict[str, str] | None = None) -> dict[str, Any]:
        """Run ``target(spec)`` in the host (``env``: variables set for it where unset);
        its result with ``log`` (everything the spec's processes wrote)."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"target": target, "spec": spec, "env": env}) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout  # only a hung engine gets there
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop(kill=True)
                raise TimeoutError(f"engine spec ran past {timeout} s: host killed") from None
            if line is None:
                self.stop(kill=True)
                raise RuntimeError("the engine host died during the spec")
            if line.startswith(("RESULT ", "ERROR ")):
                break
        kind, _, body = line.partition(" ")
        payload: dict[str, Any] = json.loads(body)
        if not payload.pop("engine_reused", False):
            engine_starts.record(target.split(":")[0].rsplit(".", 1)[-1], spec)
        log_path = Path(payload.pop("log_path"))
        log = log_path.read_text(errors="replace")
        log_path.unlink(missing_ok=True)
        if kind == "ERROR":
            raise RuntimeError(f"engine run failed:\n{payload['error']}\n{log[-4000:]}")
        payload["log"] = log
        return payload

    def stop(self, kill: bool = False) -> None:
        """End the host (its engines with it); ``kill``: at once, with its process group."""
        if self.proc is None:
            return
        if kill and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()  # the host finishes its shutdowns and exits
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


_host: EngineHost | None = None


def run_spec(target: str, spec: dict[str, Any], timeout: float = 900,
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """``target(spec)`` in this test process's engine host (started on first use)."""
    global _host
    if _host is None:
        _host = EngineHost()
        atexit.register(_host.stop)
    return _host.call(target, spec, timeout, env)


def run_native_engine(spec: dict[str, Any], timeout: float = 900,
                      env: dict[str, str] | None = None) -> dict[str, Any]:
    """``benchmarks.native_tier_engine.run(spec)`` in the host, with the environment its
    own ``run_in_subprocess`` gives it (same OpenMP threads in every mode) and ``env``."""
    return run_spec("benchmarks.native_tier_engine:run", spec, timeout,
                    env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", **(env or {})})


if __name__ == "__main__":
    # The module as imported by name (not this __main__ copy): the specs' defer_shutdown
    # and the loop must share one _pending_shutdowns.
    from tests.support import engine_host

    engine_host.serve()

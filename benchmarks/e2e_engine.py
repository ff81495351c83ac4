"""One engine lifetime for bench_e2e, kept alive between passes so configs can take turns.

The child (``python -m benchmarks.e2e_engine SPEC.json``) builds one ``LLM`` as the spec
says (vLLM's default executors: the caller, the engine core and the worker are three
processes), then runs passes of ``connector.demo.workload``'s workload on command: one JSON
line on stdin per pass (``{"phase": {...}, "out": PATH}``), the result written to ``out``,
then a ``[kvtier-bench-done]`` line on stdout. An empty line or EOF shuts it down.

Per pass it records ``wall_s`` and ``tree_cpu_s``: user + system CPU time of the caller and
every live descendant (psutil), read before and after the pass. ``time.process_time()`` in
the caller alone (``demo_workload``'s ``cpu_s``) misses the two processes that do the work.
Redis's own CPU time (a separate server) is in neither.

Parent: :class:`EngineProc` (start, run a pass, stop).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from connector.demo.engine import EngineRunError
from connector.demo.presets import CPU_ENGINE_ENV
from connector.demo.workload import PROGRESS_TAG, Workload, reset_gpu_prefix_cache

REPO_ROOT = Path(__file__).resolve().parent.parent

DONE_TAG = "[kvtier-bench-done]"
READY_TAG = "[kvtier-bench-ready]"


KV_CACHE_BYTES = 256 << 20
# vLLM's CPU KV cache for a benchmark engine: 256 MiB (262k tokens of the tiny Llama) instead
# of CPU_ENGINE_ENV's 1 GiB, so that several engines fit beside other work. Without
# VLLM_CPU_KVCACHE_SPACE (a legacy setting in whole GiB that overrides the engine argument;
# None = removed from the environment) vLLM reads ``kv_cache_memory_bytes``.
SMALL_KV_ENV: dict[str, str | None] = {"VLLM_CPU_KVCACHE_SPACE": None}
SMALL_KV_OVERRIDES = {"kv_cache_memory_bytes": KV_CACHE_BYTES}


def wait_for_memory(need_bytes: int = 3 << 30, timeout_s: float = 300) -> None:
    """Before an engine starts: until the machine has ``need_bytes`` available (others' jobs
    come and go), else raise; an engine killed by the OOM killer helps no one."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        free = psutil.virtual_memory().available
        if free >= need_bytes:
            return
        if time.monotonic() > deadline:
            raise EngineRunError(f"only {free >> 20} MiB of memory available, need "
                                 f"{need_bytes >> 20} MiB to start another engine")
        print(f"  waiting for memory: {free >> 20} MiB available", file=sys.stderr, flush=True)
        time.sleep(10)


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and all its live descendants."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # a helper that just exited
            continue
        total += t.user + t.system
    return total


# ---------------------------------------------------------------------------- child
def _run_phase(llm: Any, base: dict[str, Any], phase: dict[str, Any]) -> dict[str, Any]:
    from connector.demo.workload import run_workload

    reset_ok = reset_gpu_prefix_cache(llm) if phase.get("reset_before") else None
    workload = Workload(**{**base, **phase.get("workload", {})})
    c0 = tree_cpu_s()
    result = run_workload(llm, workload, phase["name"])
    tree = tree_cpu_s() - c0
    result.reset_ok = reset_ok
    return {**asdict(result), "tree_cpu_s": tree}


def _child(spec_path: str) -> int:
    from connector.demo.presets import apply_cpu_engine_env, engine_kwargs
    from connector.demo.workload import progress

    spec = json.loads(Path(spec_path).read_text())
    apply_cpu_engine_env()
    progress(f"{spec['label']}: importing vLLM")
    t0 = time.perf_counter()
    from vllm import LLM

    kwargs = engine_kwargs(spec["model"], spec["model_dir"], disable_log_stats=False,
                           **spec.get("engine_overrides", {}))
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    progress(f"{spec['label']}: starting engine")
    llm = LLM(**kwargs)
    print(f"{READY_TAG} {time.perf_counter() - t0:.3f}", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        cmd = json.loads(line)
        data = _run_phase(llm, spec["workload"], cmd["phase"])
        Path(cmd["out"]).write_text(json.dumps(data))
        print(DONE_TAG, flush=True)
    progress(f"{spec['label']}: shutting engine down")
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()  # lets pending tier writes finish
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of the engine (slow, can hang)


# ---------------------------------------------------------------------------- parent
class EngineProc:
    """A child engine process: ``start()``, ``run(phase)`` as often as needed, ``stop()``."""

    def __init__(self, spec: dict[str, Any], log_dir: Path, *,
                 extra_paths: list[str] | None = None, env: dict[str, str] | None = None,
                 timeout_s: float = 900) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.slug = "".join(c if c.isalnum() else "-" for c in spec["label"]).strip("-")
        self.log_dir = log_dir
        self.log_path = log_dir / f"{self.slug}.log"
        self.timeout_s = timeout_s
        self.startup_s: float | None = None
        self._n = 0
        merged = {**CPU_ENGINE_ENV, "VLLM_LOGGING_LEVEL": "WARNING", **os.environ,
                  **SMALL_KV_ENV, **(env or {})}
        self._env = {k: v for k, v in merged.items() if v is not None}
        self._env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *(extra_paths or []), os.environ.get("PYTHONPATH", "")]
        ).rstrip(os.pathsep)
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[str] | None = None
        self._tail: list[str] = []

    def start(self) -> EngineProc:
        wait_for_memory()
        spec_path = self.log_dir / f"{self.slug}.spec.json"
        spec_path.write_text(json.dumps(self.spec))
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the child
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.e2e_engine", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, env=self._env, cwd=str(REPO_ROOT))
        line = self._read_until(READY_TAG)
        self.startup_s = float(line.split()[-1])
        return self

    @property
    def pid(self) -> int:
        """The driver process's id (the engine core and its workers are its descendants)."""
        assert self._proc is not None
        return self._proc.pid

    def run(self, phase: dict[str, Any]) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        self._n += 1
        out = self.log_dir / f"{self.slug}.pass{self._n}.json"
        out.unlink(missing_ok=True)
        self._proc.stdin.write(json.dumps({"phase": phase, "out": str(out)}) + "\n")
        self._proc.stdin.flush()
        self._read_until(DONE_TAG)
        return json.loads(out.read_text())

    def stop(self) -> None:
        if self._proc is None:
            return
        try:
            if self._proc.poll() is None and self._proc.stdin is not None:
                self._proc.stdin.write("\n")
                self._proc.stdin.flush()
            self._proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()
        finally:
            if self._log is not None:
                self._log.close()
            self._proc = None

    def _read_until(self, tag: str) -> str:
        assert self._proc is not None and self._proc.stdout is not None and self._log
        t0 = time.monotonic()
        for line in self._proc.stdout:
            self._log.write(line)
            self._tail = (self._tail + [line.rstrip()])[-40:]
            if line.startswith(tag):
                return line
            if line.startswith(PROGRESS_TAG):
                print(f"  {line[len(PROGRESS_TAG):].strip()}", file=sys.stderr, flush=True)
            if time.monotonic() - t0 > self.timeout_s:
                break
        self._proc.kill()
        rc = self._proc.wait()
        raise EngineRunError(f"engine {self.spec['label']!r} failed (exit {rc}); full log: "
                             f"{self.log_path}\n" + "\n".join(self._tail))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m benchmarks.e2e_engine SPEC.json  (commands on stdin)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(_child(sys.argv[1]))

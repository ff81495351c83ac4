"""Where a connector's no-hit time goes: py-spy over the engine core and the worker.

Starts one ``LLM`` (vLLM's default multiprocess executors) for a config of bench_e2e
(``none``, ``native``, ``kvtier`` = CPU + Redis with write-behind, ``kvtier-cpu``), runs one
unmeasured no-hit pass, then attaches ``py-spy record`` (raw collapsed stacks) to the engine
core and the worker and runs ``--passes`` no-hit passes (bench_e2e's ``NOHIT`` shape).
Prints, per process, the share of sampled (non-idle) time under each frame of interest —
inclusive, by ``file:function`` — for kvtier's and vLLM's connector code, and the top
self-time frames.

py-spy is not a project dependency: ``pip install --target /tmp/pyspy py-spy`` and pass
``--py-spy /tmp/pyspy/bin/py-spy`` (needs ptrace rights over the engine's processes).

Usage: python -m benchmarks.profile_nohit [--config kvtier] [--model llama] [--passes 6]
       [--rate 200] [--out DIR] [--redis-url URL] [--py-spy PATH]
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from benchmarks.bench_e2e import NOHIT, Bench
from connector.demo.cli import model_path
from connector.demo.presets import apply_cpu_engine_env, engine_kwargs

# Frames whose inclusive share is reported (substring of "file:function").
WATCH = (
    "connector/", "offload_tiers/", "kv_connector", "kv_transfer", "offloading",
    "cpu_offload", "shm_broadcast", "serial_utils", "msgspec",
)


def _frame(raw: str) -> str:
    """py-spy raw frame ``func (path/file.py:line)`` -> ``pkg/file.py:func``."""
    func, _, where = raw.partition(" (")
    path = where.rsplit(":", 1)[0]
    parts = Path(path).parts
    short = "/".join(parts[-2:]) if parts else path
    return f"{short}:{func.strip()}"


SPIN = ("sched_yield", "SpinCondition.wait", "acquire_read.<locals>.check", "memory_fence",
        "ReadTimeoutWithWarnings", "Condition.wait", "Poller.poll", "select")


def summarize(raw_path: Path, top: int = 20) -> str:
    """Shares of one profile: per thread, watched frames (inclusive), top self time.

    ``busy`` leaves out samples whose innermost frame is a wait (vLLM's shm-queue spin,
    ``sched_yield``, condition waits, polls): the time that does work.
    """
    total = busy = 0
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    inclusive_busy: collections.Counter[str] = collections.Counter()
    self_busy: collections.Counter[str] = collections.Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        raw = stack.split(";")
        thread = raw[0] if raw[0].startswith("thread ") or raw[0].startswith("process ") \
            else "?"
        frames = [_frame(f) for f in raw[1 if thread != "?" else 0:]]
        names = {f for f in frames if any(w in f for w in WATCH)}
        is_busy = bool(frames) and not any(w in frames[-1] for w in SPIN)
        total += n
        threads[_thread_kind(thread, frames)] += n
        for f in names:
            inclusive[f] += n
        if is_busy:
            busy += n
            for f in names:
                inclusive_busy[f] += n
            self_busy[frames[-1]] += n
    if not total:
        return f"{raw_path.name}: no samples"
    out = [f"{raw_path.name}: {total} samples, {busy} busy ({100 * busy / total:.0f}%)",
           "  threads (share of all samples): " + ", ".join(
               f"{k} {100 * v / total:.1f}%" for k, v in threads.most_common())]
    out.append("  watched frames, inclusive: % of all samples / % of busy samples")
    for f, n in inclusive.most_common(top):
        out.append(f"    {100 * n / total:5.1f}% / {100 * inclusive_busy[f] / max(busy, 1):5.1f}%"
                   f"  {f}")
    out.append("  top self time (busy samples):")
    for f, n in self_busy.most_common(top):
        out.append(f"    {100 * n / max(busy, 1):5.1f}%  {f}")
    return "\n".join(out)


def _thread_kind(thread: str, frames: list[str]) -> str:
    joined = ";".join(frames)
    if "WriteBehind" in joined or "write_behind" in joined:
        return "kvtier-writer"
    if "worker_side.py:TieredWorker._probe" in joined or "_fetch" in joined \
            or "kvtier-io" in thread:
        return "kvtier-io"
    if "Thread._bootstrap" in joined:
        return "other-thread"
    return "main"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="kvtier",
                        choices=("none", "null", "native", "kvtier", "kvtier-cpu"))
    parser.add_argument("--model", default="llama", choices=("llama", "hybrid"))
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--out", default="/tmp/kvtier-profile")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--py-spy", dest="py_spy", default="py-spy")
    parser.add_argument("--reserved-cpus", default="1")
    args = parser.parse_args(argv)

    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = args.reserved_cpus
    apply_cpu_engine_env()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = Bench(out / "logs", {}, args.redis_url)  # its kvtier: a Redis prefix of its own
    import psutil
    from vllm import LLM, SamplingParams

    from connector.demo.workload import run_workload

    kwargs = engine_kwargs(args.model, str(model_path(args.model)))
    ktc = bench.transfer_config(args.config)
    if ktc:
        kwargs["kv_transfer_config"] = ktc
    llm = LLM(**kwargs)
    llm.generate(["w1 w2 w3"], SamplingParams(max_tokens=2), use_tqdm=False)
    run_workload(llm, replace(NOHIT, seed=90_000), "warm")
    kids = psutil.Process().children(recursive=True)
    procs = {}
    for p in kids:
        name = " ".join(p.cmdline())
        kind = "worker" if "Worker" in p.name() or "worker" in name.lower() else "enginecore"
        if kind == "worker" or "EngineCore" in p.name() or "engine" in name.lower():
            procs[f"{kind}-{p.pid}"] = p.pid
    if not procs:  # names differ by vLLM version: take every python child
        procs = {f"child-{p.pid}": p.pid for p in kids}
    tag = f"{args.model}-{args.config}"
    spies = []
    for name, pid in procs.items():
        path = out / f"{tag}-{name}.txt"
        spies.append((path, subprocess.Popen(
            [args.py_spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--format",
             "raw", "--threads", "--output", str(path), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    time.sleep(1.0)
    t0 = time.perf_counter()
    for rep in range(args.passes):
        run_workload(llm, replace(NOHIT, seed=100_000 + 100 * rep), f"p{rep}")
    wall = time.perf_counter() - t0
    for _, spy in spies:
        spy.send_signal(signal.SIGINT)
    for path, spy in spies:
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
        if not path.exists():
            print(f"py-spy wrote no {path.name}: {err.decode(errors='replace')[-500:]}")
    print(f"{tag}: {args.passes} no-hit passes, {wall:.2f} s wall "
          f"({wall / args.passes:.3f} s per pass)")
    for path, _ in spies:
        if path.exists():
            print(summarize(path))
    bench.cleanup()
    # The engine core and worker are other processes: shut them down, or they outlive us.
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

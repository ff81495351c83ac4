"""Benchmark: vLLM's native offloading with kvtier's Redis tier, across an engine restart.

Three configurations on the same workload, real vLLM CPU engines (tiny Llama, vLLM's
default executors), each engine lifetime its own process (``benchmarks/native_tier_engine``):

  none     vLLM alone (GPU prefix cache only)
  fs       OffloadingConnector + TieringOffloadingSpec + vLLM's file-system tier
           (``vllm/v1/kv_offload/tiering/fs``), root in a fresh temporary directory
  kvtier   OffloadingConnector + TieringOffloadingSpec + kvtier's Redis tier
           (``connector.native_tier.tier.KvtierRedisTier``), a fresh key prefix

Both offloading configurations use ``CpuTieringOffloadingSpec`` (the stock tiering worker
refuses the CPU platform; ``connector/native_tier/cpu_tiering.py``). Per configuration two
engines run the same workload one after the other: ``cold`` (first lifetime, stores) and
``restart`` (a new process; whatever a persistent tier kept comes back). The workload is
``--docs`` shared prefixes of ``--doc-words`` tokens, each asked ``--questions`` times with
a different suffix; before every request vLLM's GPU prefix cache is reset, so every hit
comes from the offloading tiers (the CPU primary tier in-lifetime, fs / Redis after it).

Reported per (config, phase): request wall seconds (sum), prompt tokens, cached tokens
(vLLM's ``num_cached_tokens``), recomputed tokens (per request max(prompt - cached, 1)),
engine start seconds. Ratios (JSON ``ratios``):

  restart_wall_vs_none      kvtier restart / none restart (request wall time)
  restart_wall_vs_fs        kvtier restart / fs restart
  restart_recomputed_vs_fs  kvtier restart / fs restart (recomputed prefill tokens)
  restart_recomputed_vs_none
  fs_restart_wall_vs_none

Outputs of every configuration are compared with ``none`` (greedy decoding): the table says
whether they are identical.

Usage: python -m benchmarks.bench_native_tier [--quick] [--json PATH]
       [--redis-url URL] [--redis-timeout-s S] [--docs N] [--questions N] [--doc-words N]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from benchmarks.harness import ratio, write_result
from benchmarks.native_tier_engine import run_in_subprocess
from connector.demo.tiny_models import prompt_words

CONFIGS = ("none", "fs", "kvtier")


def workload(docs: int, questions: int, doc_words: int) -> list[list[Any]]:
    prompts = []
    for q in range(questions):
        for d in range(docs):
            prompts.append([f"d{d}q{q}", f"{prompt_words(300 + d, doc_words)} "
                                         f"{prompt_words(900 + 31 * d + q, 9)}"])
    return prompts


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    outs = result["outputs"]
    prompt = sum(o["prompt_tokens"] for o in outs)
    cached = sum(o["num_cached_tokens"] for o in outs)
    return {
        "wall_s": sum(o["seconds"] for o in outs),
        "start_s": result["start_s"],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "recomputed_tokens": sum(max(o["prompt_tokens"] - o["num_cached_tokens"], 1)
                                 for o in outs),
        "token_ids": {o["name"]: o["token_ids"] for o in outs},
        "metrics": {k: v for k, v in result["metrics"].items()
                    if k.startswith(("vllm:kvtier_native_", "vllm:kv_offload_tiering_chunk"))},
    }


def run_config(name: str, prompts: list[list[Any]], redis_url: str, fs_root: Path,
               redis_timeout_s: float) -> dict[str, dict[str, Any]]:
    spec: dict[str, Any] = {"mode": name, "prompts": prompts, "reset_between": True,
                            "max_tokens": 8}
    if name == "fs":
        spec["fs_root"] = str(fs_root)
    if name == "kvtier":
        spec.update(redis_url=redis_url, redis_prefix=f"kvtier-bench-{uuid.uuid4().hex[:8]}",
                    tier={"redis_timeout_s": redis_timeout_s})
    phases = {}
    for phase in ("cold", "restart"):
        print(f"  {name:7s} {phase} ...", file=sys.stderr, flush=True)
        phases[phase] = summarize(run_in_subprocess(spec))
    if name == "kvtier":
        from connector.demo.cli import delete_redis_prefix

        delete_redis_prefix(redis_url, spec["redis_prefix"])
    return phases


def report(results: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    ref = results["none"]
    rows = []
    for name, phases in results.items():
        for phase, s in phases.items():
            same = s["token_ids"] == ref[phase]["token_ids"]
            rows.append((name, phase, s["wall_s"], s["start_s"], s["prompt_tokens"],
                         s["cached_tokens"], s["recomputed_tokens"], same))
    print(f"{'config':8s} {'phase':8s} {'wall s':>8s} {'start s':>8s} {'prompt':>7s} "
          f"{'cached':>7s} {'recomp':>7s} same-as-none")
    for r in rows:
        print(f"{r[0]:8s} {r[1]:8s} {r[2]:8.2f} {r[3]:8.1f} {r[4]:7d} {r[5]:7d} {r[6]:7d} "
              f"{'yes' if r[7] else 'NO'}")
    k, f, n = results["kvtier"]["restart"], results["fs"]["restart"], ref["restart"]
    ratios = {
        "restart_wall_vs_none": ratio(k["wall_s"], n["wall_s"]),
        "restart_wall_vs_fs": ratio(k["wall_s"], f["wall_s"]),
        "restart_recomputed_vs_fs": ratio(k["recomputed_tokens"], f["recomputed_tokens"]),
        "restart_recomputed_vs_none": ratio(k["recomputed_tokens"], n["recomputed_tokens"]),
        "fs_restart_wall_vs_none": ratio(f["wall_s"], n["wall_s"]),
    }
    print("ratios: " + ", ".join(f"{key}={value}" for key, value in ratios.items()))
    return {"rows": [dict(zip(("config", "phase", "wall_s", "start_s", "prompt_tokens",
                               "cached_tokens", "recomputed_tokens", "same_as_none"), r,
                              strict=True)) for r in rows],
            "ratios": ratios,
            "metrics": {name: {phase: s["metrics"] for phase, s in phases.items()}
                        for name, phases in results.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 docs x 2 questions")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--redis-timeout-s", type=float, default=1.0,
                    help="the tier's redis_timeout_s (default 1.0: a loaded machine stalls "
                         "replies past the tier's 0.25 s default, which then counts drops)")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--questions", type=int, default=3)
    ap.add_argument("--doc-words", type=int, default=480)
    args = ap.parse_args(argv)
    docs, questions = (2, 2) if args.quick else (args.docs, args.questions)
    prompts = workload(docs, questions, args.doc_words)
    print(f"workload: {docs} docs x {questions} questions, {args.doc_words}-token prefixes "
          f"({len(prompts)} requests per engine)", file=sys.stderr)
    fs_root = Path(tempfile.mkdtemp(prefix="kvtier-bench-fs-"))
    try:
        results = {name: run_config(name, prompts, args.redis_url, fs_root,
                                    args.redis_timeout_s) for name in CONFIGS}
    finally:
        shutil.rmtree(fs_root, ignore_errors=True)
    out = report(results)
    out["workload"] = {"docs": docs, "questions": questions, "doc_words": args.doc_words}
    write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

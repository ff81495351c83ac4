"""One vLLM CPU engine lifetime with native offloading (or none); prints ``RESULT {json}``.

Used by ``benchmarks/bench_native_tier.py`` and ``tests/native/test_native_tier_e2e.py``::

    python -m benchmarks.native_tier_engine '{"mode": "none" | "cpu" | "fs" | "kvtier",
        "prompts": [[name, prompt], ...], "max_tokens": 8, "cpu_bytes": 67108864,
        "redis_url": "redis://...", "redis_prefix": "...", "fs_root": "/tmp/...",
        "tier": {extra kvtier tier settings}, "reset_between": false,
        "engine": {LLM keyword overrides, e.g. "tensor_parallel_size": 2},
        "wait_before": [...], "wait_for": [[metric | [metrics], at_least], ...]}'

Modes: ``none`` = vLLM alone; ``cpu`` = OffloadingConnector with its plain CPU tier
(``CpuPeerOffloadingSpec``, ``connector/native_tier/cpu_offload.py``); ``fs`` =
OffloadingConnector + TieringOffloadingSpec with vLLM's file-system tier; ``kvtier`` = the
same with kvtier's Redis tier
(``connector.native_tier.tier.KvtierRedisTier``). The spec is ``CpuTieringOffloadingSpec``
(``connector/native_tier/cpu_tiering.py``): ``TieringOffloadingSpec`` with a CPU worker.
vLLM's default executors (engine core and worker in their own processes).

``wait_before``: the same, before the first prompt (e.g. ``[["vllm:kvtier_native_redis_available",
1]]``: the tier has reached Redis, which a loaded machine can delay past an engine's start).
``wait_for``: after the prompts, step the engine (one-token requests) until each metric
(or the sum of a list of metrics) is at least its value: cascades to Redis finish in the
background and are counted when a later step collects them. A generous deadline only ends a
hung engine (the metrics then come back as they are, for the caller's assertions).

Output: per prompt its text, token ids, ``num_cached_tokens`` and seconds; the engine's
start seconds; every ``vllm:kv_offload*`` / ``vllm:kvtier_native_*`` metric (summed).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from connector.demo.presets import TP2_ENV, apply_cpu_engine_env, engine_kwargs

SPEC = {"spec_name": "CpuTieringOffloadingSpec",
        "spec_module_path": "connector.native_tier.cpu_tiering"}
CPU_ALONE = {"spec_name": "CpuPeerOffloadingSpec",
             "spec_module_path": "connector.native_tier.cpu_offload"}


def transfer_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The ``kv_transfer_config`` for ``spec["mode"]`` (None: no connector)."""
    mode = spec["mode"]
    if mode == "none":
        return None
    if mode == "cpu":  # vLLM's plain CPU offloading, with kvtier's CPU worker
        return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    **CPU_ALONE, "cpu_bytes_to_use": int(spec.get("cpu_bytes", 64 << 20))}}
    if mode == "fs":
        tier = {"type": "fs", "root_dir": spec["fs_root"], "n_read_threads": 2,
                "n_write_threads": 2}
    elif mode == "kvtier":
        url = {"redis_url": spec["redis_url"]} if spec.get("redis_url") else {}  # or url_env
        tier = {"type": "KvtierRedisTier", "module_path": "connector.native_tier.tier",
                **url, "redis_prefix": spec["redis_prefix"], **spec.get("tier", {})}
    else:
        raise ValueError(f"unknown mode {mode!r}: none, cpu, fs or kvtier")
    extra = {**SPEC, "cpu_bytes_to_use": int(spec.get("cpu_bytes", 64 << 20)),
             "secondary_tiers": [tier]}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


def metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(("vllm:kv_offload", "vllm:kvtier_native_",
                                       "vllm:prefix_cache")):
            continue
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            out[metric.name] = out.get(metric.name, 0) + value
    return out


def run(spec: dict[str, Any]) -> dict[str, Any]:
    apply_cpu_engine_env()
    if spec.get("log_info"):
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from vllm import LLM

    from connector.demo.tiny_models import tiny_llama

    overrides: dict[str, Any] = dict(spec.get("engine") or {})
    if int(overrides.get("tensor_parallel_size", 1)) > 1:
        for key, value in TP2_ENV.items():  # one core per rank on the CPU backend
            os.environ.setdefault(key, value)
    kv = transfer_config(spec)
    if kv is not None:
        overrides["kv_transfer_config"] = kv
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs("llama", str(tiny_llama()), **overrides))
    start_s = time.perf_counter() - t0
    try:
        return _serve(llm, spec, start_s)
    finally:
        llm.llm_engine.engine_core.shutdown()  # now, whoever runs this (a test's engine host)


def _serve(llm: Any, spec: dict[str, Any], start_s: float) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=int(spec.get("max_tokens", 8)), temperature=0.0)
    wait_for_metrics(llm, spec.get("wait_before") or [])
    outputs = []
    for name, prompt in spec["prompts"]:
        if spec.get("reset_between"):
            llm.reset_prefix_cache()
        request: Any = {"prompt_token_ids": prompt} if isinstance(prompt, list) \
            else {"prompt": prompt}
        t = time.perf_counter()
        out = llm.generate([request], params, use_tqdm=False)[0]
        outputs.append({"name": name, "text": out.outputs[0].text,
                        "token_ids": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens,
                        "prompt_tokens": len(out.prompt_token_ids or ()),
                        "seconds": time.perf_counter() - t, "metrics": metrics(llm)})
    wait_for_metrics(llm, spec.get("wait_for") or [])
    return {"start_s": start_s, "outputs": outputs, "metrics": metrics(llm)}


def wait_for_metrics(llm: Any, wanted: list[list[Any]], deadline_s: float = 300.0) -> None:
    """Step the engine until every ``[metric | [metrics], at_least]`` holds (see above)."""
    from vllm import SamplingParams

    def short(m: dict[str, float]) -> list[tuple[Any, float, float]]:
        out = []
        for names, at_least in wanted:
            names = [names] if isinstance(names, str) else names
            have = sum(m.get(n, 0) for n in names)
            if have < at_least:
                out.append((names, have, at_least))
        return out

    deadline = time.monotonic() + deadline_s
    while short(metrics(llm)) and time.monotonic() < deadline:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)  # a step: finished jobs are collected and counted


def run_in_subprocess(spec: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
    """``spec`` in a fresh Python process (its own engine); the parsed RESULT."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # same OpenMP threads in every mode
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.native_tier_engine",
                           json.dumps(spec)], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT "):])
            result["log"] = proc.stderr
            result["process_s"] = time.perf_counter() - t0
            return result
    raise RuntimeError(f"engine run failed (exit {proc.returncode}):\n{proc.stderr[-6000:]}")


def main() -> None:
    result = run(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""The demo's and the e2e benchmark's workload, run inside one engine process.

A multi-turn, shared-prefix chat workload: ``conversations`` chats share one long system
prompt; every turn appends the previous answer and a new user message, so each request
extends the one before it. Requests go one at a time (deterministic hits, clean TTFT).

This module is the *child* side: ``python -m connector.demo.workload SPEC.json OUT.json``
builds one vLLM engine as the spec says, runs the workload once per phase (optionally
resetting vLLM's GPU prefix cache before a phase, never the connector's tiers) and writes
per-phase results as JSON. What each phase got from where comes from vLLM's own counters
(``prompt_tokens_by_source``, ``prompt_tokens_cached_by_source``), read before and after the
phase, plus the connector's own Prometheus counters when it has any. The parent side
(``connector.demo.engine``) starts one such process per engine lifetime, so an engine
restart is a real new process. Importing this module does not import vLLM.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from connector.demo.presets import apply_cpu_engine_env, engine_kwargs
from connector.demo.thread_times import all_processes, busiest, thread_deltas, thread_times
from connector.demo.tiny_models import prompt_words

PROGRESS_TAG = "[kvtier-progress]"
CONNECTOR_METRIC_PREFIXES = ("kvtier_", "lmcache")



@dataclass(frozen=True)
class Workload:
    """Shape of the chat workload. Word counts are token counts (word-level tokenizer)."""

    conversations: int = 4
    turns: int = 3
    system_words: int = 320
    user_words: int = 40
    max_tokens: int = 8
    seed: int = 7
    shared_system: bool = True

    def system_seed(self, conv: int) -> int:
        """One system prompt for all conversations, or one per conversation (no sharing)."""
        return self.seed if self.shared_system else self.seed + 1 + conv

    def user_turn(self, conv: int, turn: int) -> list[str]:
        """The words of conversation ``conv``'s user message at ``turn``."""
        seed = self.seed * 1000 + conv * 37 + turn + 1
        return prompt_words(seed, self.user_words).split()


@dataclass
class RequestRecord:
    """One request of a phase: what it asked, what vLLM says it reused, what it answered."""

    conv: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    output: list[int]


@dataclass
class PhaseResult:
    """One pass of the workload over one engine: per-source token counts and timings."""

    name: str
    requests: list[RequestRecord] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time (engine + connector run in-process)
    reset_ok: bool | None = None
    # With a phase's "machine_threads": seconds every thread on the machine ran during the
    # phase, the busiest first ("process / thread @cpus", connector/demo/thread_times.py).
    machine_threads_s: dict[str, float] | None = None
    machine_window_s: float = 0.0  # the wall time those readings span (the phase and more)

    def ttft_p50_ms(self) -> float:
        return 1000.0 * statistics.median(r.ttft_s for r in self.requests)


def progress(message: str) -> None:
    """A line the parent echoes to the user's terminal (everything else goes to a log)."""
    print(f"{PROGRESS_TAG} {message}", flush=True)


def _counter_key(name: str, labels: dict[str, str]) -> str:
    extra = sorted((k, v) for k, v in labels.items() if k not in {"model_name", "engine"})
    return name + "".join(f"[{k}={v}]" for k, v in extra)


def snapshot_counters(llm: Any) -> dict[str, float]:
    """Every counter the engine exports (vLLM's and any connector's), keyed with labels."""
    from vllm.v1.metrics.reader import Counter

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter):
            key = _counter_key(metric.name, metric.labels)
            out[key] = out.get(key, 0.0) + float(metric.value)
    out.update(_connector_counters())
    return out


def _connector_counters() -> dict[str, float]:
    """A connector's own Prometheus counters in this process (vLLM lists only ``vllm:*``)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for family in REGISTRY.collect():
        if family.type != "counter" or family.name.startswith("vllm:"):
            continue
        if not family.name.startswith(CONNECTOR_METRIC_PREFIXES):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = _counter_key(family.name, dict(sample.labels))
                out[key] = out.get(key, 0.0) + float(sample.value)
    return out


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def run_workload(llm: Any, workload: Workload, name: str) -> PhaseResult:
    """Every conversation, turn by turn, one request at a time; greedy decoding."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0,
                            ignore_eos=True)
    tokenizer = llm.get_tokenizer()
    history = [
        tokenizer.encode(prompt_words(workload.system_seed(conv), workload.system_words),
                         add_special_tokens=False)
        for conv in range(workload.conversations)
    ]
    result = PhaseResult(name=name)
    before = snapshot_counters(llm)
    t0, c0 = time.perf_counter(), time.process_time()
    for turn in range(workload.turns):
        for conv in range(workload.conversations):
            user = tokenizer.encode(" ".join(workload.user_turn(conv, turn)),
                                    add_special_tokens=False)
            prompt = history[conv] + user
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            answer = list(out.outputs[0].token_ids)
            metrics = out.metrics
            ttft = float(getattr(metrics, "first_token_latency", 0.0) or 0.0)
            result.requests.append(RequestRecord(
                conv=conv, turn=turn, prompt_tokens=len(prompt),
                cached_tokens=int(out.num_cached_tokens or 0), ttft_s=ttft, output=answer))
            history[conv] = prompt + answer
    result.wall_s = time.perf_counter() - t0
    result.cpu_s = time.process_time() - c0
    result.counters = counter_delta(before, snapshot_counters(llm))
    return result


def reset_gpu_prefix_cache(llm: Any) -> bool:
    """Drop vLLM's GPU prefix cache (not the connector's tiers); retry while saves drain."""
    for _ in range(50):
        if llm.reset_prefix_cache(reset_connector=False):
            return True
        time.sleep(0.1)
    return False


def check_kvtier_settings(kv_transfer_config: dict[str, Any] | None) -> None:
    """Fail before vLLM is imported when kvtier's settings are bad: the check its connector
    runs at engine start (``ConnectorConfigError``, naming the key and the fix), without
    the ~30 s of an engine start first."""
    if not kv_transfer_config or \
            kv_transfer_config.get("kv_connector") != "TieredOffloadingConnector":
        return
    from connector.vllm_connector.config import load_config

    load_config(kv_transfer_config.get("kv_connector_extra_config"))


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    """Build the engine the spec describes and run its phases; returns JSON-ready data."""
    apply_cpu_engine_env()
    base = dict(spec["workload"])
    check_kvtier_settings(spec.get("kv_transfer_config"))
    progress(f"{spec['label']}: importing vLLM")
    t0 = time.perf_counter()
    from vllm import LLM

    overrides = {"disable_log_stats": False, **spec.get("engine_overrides", {})}
    kwargs = engine_kwargs(spec["model"], spec["model_dir"], **overrides)
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    progress(f"{spec['label']}: starting engine")
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    phases: list[dict[str, Any]] = []
    for phase in spec["phases"]:
        reset_ok = None
        if phase.get("reset_before"):
            reset_ok = reset_gpu_prefix_cache(llm)
        progress(f"{spec['label']}: running phase '{phase['name']}'")
        workload = Workload(**{**base, **phase.get("workload", {})})
        if phase.get("settle_s"):  # a benchmark's pause: background work of the last phase ends
            time.sleep(float(phase["settle_s"]))
        watch = phase.get("machine_threads", False)
        window_t0 = time.perf_counter()
        threads_before = thread_times(all_processes()) if watch else {}
        result = run_workload(llm, workload, phase["name"])
        if watch:
            result.machine_threads_s = busiest(thread_deltas(
                threads_before, thread_times(all_processes())))
            result.machine_window_s = time.perf_counter() - window_t0
        result.reset_ok = reset_ok
        phases.append(asdict(result))
    progress(f"{spec['label']}: shutting engine down")
    _shutdown(llm)
    return {"label": spec["label"], "startup_s": startup_s, "phases": phases}


def _shutdown(llm: Any) -> None:
    """Shut the engine (and its connector) down cleanly, so pending tier writes finish."""
    engine_core = getattr(llm.llm_engine, "engine_core", None)
    shutdown = getattr(engine_core, "shutdown", None)
    if callable(shutdown):
        shutdown()


def main(argv: list[str]) -> int:
    """Child entry: ``python -m connector.demo.workload SPEC.json OUT.json``."""
    if len(argv) != 2:
        print("usage: python -m connector.demo.workload SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    data = run_spec(spec)
    Path(argv[1]).write_text(json.dumps(data))
    # Skip interpreter teardown of the in-process engine (slow, and it can hang on exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run one vLLM CPU engine (with or without kvtier) over a scripted workload; print JSON.

Used by the connector's e2e tests to get a baseline without kvtier, a second engine process
on the same Redis, and engines with test-only switches, each in its own process::

    python -m tests.support.connector_runner '{"model": "llama", "extra": {...} | null,
        "steps": [["generate", "name", "prompt" | [token ids], cache_salt?,
                   {"max_tokens": n, "ignore_eos": bool}?], ["reset"],
                  ["batch", "name", [prompt | [token ids], ...]],
                  ["corrupt_redis", url, prefix], ["damage_rank", url, prefix, how],
                  ["reset_connector"], ["perturb_weights", seed], ["weight_version", v],
                  ["wait_redis", 0|1, timeout_s], ["wait_writes", timeout_s],
                  ["wait_backfills", timeout_s],
                  ["kill_pid", pid], ["stop_before_host_commits"], ["skip_host_commits", rank],
                  ["kill_engine"]],
        "max_tokens": 8, "logprobs": bool, "proxy_to": redis port (optional), "log_info": bool,
        "report_spin": bool (the worker's shared-memory queue spin in the result),
        "engine": {LLM keyword overrides, e.g. "max_num_seqs": 8} (optional)}'

``["batch", ...]`` submits every prompt in ONE ``llm.generate`` call (vLLM batches them in
the same steps); its outputs are named ``name/0``, ``name/1``, ... and the kvtier counter
delta of the whole call is on ``name/0`` and on an extra ``name`` entry.

The engine runs with vLLM's default executors (engine core and worker in their own
processes), so kvtier's counters are read the way an operator reads them: vLLM's Prometheus
metrics (``vllm:kvtier_*``, through ``LLM.get_metrics()``), summed over engines. After each
``generate``/``batch`` and at each ``snapshot`` the runner waits until every save planned so
far has its outcome (Redis writes included) in those metrics, so a delta belongs to the
request that caused it; at the end the CPU-tier gauges describe the tier at rest
(``tests.support.worker_probe``: events, not sleeps).

The last stdout line is ``RESULT {"outputs": [...], "stats": {...}}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any

from connector.demo.presets import TP2_ENV
from rigs.redis_keys import block_names
from tests.support import engine_host, worker_probe
from tests.support.vllm_engine import (
    apply_cpu_engine_env,
    hybrid_engine_kwargs,
    kvtier_transfer_config,
    llama_engine_kwargs,
)


def corrupt_redis(url: str, prefix: str) -> dict[str, int]:
    """Damage every value under ``prefix``: flip payload bytes of even keys; give odd keys
    the *untouched* value of another key (valid header and checksum, foreign key)."""
    import redis

    client = redis.Redis.from_url(url)
    names = block_names(client, prefix)
    originals = {name: client.get(name) for name in names}
    flipped = swapped = 0
    for i, name in enumerate(names):
        value = originals[name]
        if value is None:
            continue
        if i % 2 == 0 or len(names) == 1:
            data = bytearray(value)
            data[-1] ^= 0xFF
            data[len(data) // 2] ^= 0x5A
            client.set(name, bytes(data))
            flipped += 1
        else:
            other = originals[names[i - 1]]
            if other is not None and other != value:
                client.set(name, other)  # a valid value, but another block's (foreign)
                swapped += 1
    return {"flipped": flipped, "swapped": swapped}


def kill_and_reap(pid: int) -> bool:
    """SIGKILL ``pid`` and wait for the kernel to say it exited (its pidfd polls readable:
    an event, not a sleep); False when it was already gone."""
    import select
    import signal

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
        select.select([pidfd], [], [], 60.0)
    finally:
        os.close(pidfd)
    return True


def damage_one_rank(url: str, prefix: str, how: str) -> dict[str, int]:
    """Flip or delete the values of ONE tensor-parallel rank only.

    Each rank stores under its own fingerprint (``{prefix}:{fp}:{group}:{hash}``); the
    values of the lexicographically first fingerprint are damaged, the others kept.
    """
    import redis

    client = redis.Redis.from_url(url)
    names = block_names(client, prefix)
    fps = sorted({n.split(b":")[1] for n in names})
    victim = [n for n in names if n.split(b":")[1] == fps[0]]
    for name in victim:
        if how == "delete":
            client.delete(name)
            continue
        if how == "other_save":  # a valid value of another save (header re-packed, checksum ok)
            from offload_tiers import codec

            value = client.get(name)
            if value is not None:
                f = codec.parse_header(value)
                header = codec.HEADER.pack(f.magic, f.version, f.kind, 0, f.digest, f.group,
                                           f.num_tokens, f.hash_tag, f.length, f.checksum,
                                           (f.save_id % 0xFFFFFFFF) + 1)
                client.set(name, header + value[codec.HEADER_SIZE:])
            continue
        value = client.get(name)
        if value is not None:
            data = bytearray(value)
            data[-1] ^= 0xFF
            client.set(name, bytes(data))
    return {"fingerprints": len(fps), "damaged": len(victim), "kept": len(names) - len(victim)}


def perturb_weights(worker: Any, seed: int) -> int:
    """An in-place weight update, as an RLHF trainer makes one (run on every worker through
    ``LLM.collective_rpc``): seeded noise on every parameter; the number of tensors changed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    changed = 0
    with torch.no_grad():
        for param in worker.model_runner.model.parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            param.add_(noise.to(param.dtype) * 0.5 * float(param.float().std() or 1.0))
            changed += 1
    return changed


def kvtier_stats(llm: Any) -> dict[str, float]:
    """kvtier's counters and gauges as vLLM exports them (``vllm:kvtier_*``), by name."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:kvtier_"):
            continue
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            name = metric.name[len("vllm:kvtier_"):]
            out[name] = out.get(name, 0) + value
    return out


def multi_turn(generate: Any, reset: Any, first_prompt: str, turns: int,
               hooks: dict[int, Any] | None = None) -> list[str]:
    """A conversation: each turn's prompt is the last prompt, its answer and new words.

    ``reset()`` empties vLLM's prefix cache before every turn, so any hit comes from kvtier.
    ``hooks[i]()`` runs before turn ``i`` (fault injection).
    """
    from connector.demo.tiny_models import prompt_words

    prompt = first_prompt
    texts = []
    for turn in range(turns):
        if hooks and turn in hooks:
            hooks[turn]()
        reset()
        text = generate(f"turn{turn}", prompt)
        texts.append(text)
        prompt = f"{prompt}{text} {prompt_words(100 + turn, 21 + 10 * turn)}"
    return texts


def counters(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in stats.items() if not isinstance(v, dict)}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    apply_cpu_engine_env()
    from vllm import LLM

    from connector.demo.tiny_models import tiny_hybrid, tiny_llama

    extra = spec.get("extra")
    proxy = None
    if spec.get("proxy_to"):  # a loopback TCP proxy in this process, between engine and Redis
        from rigs.tcp_proxy import TcpProxy

        proxy = TcpProxy("127.0.0.1", int(spec["proxy_to"])).start()
        extra = dict(extra or {}, redis_url=f"redis://127.0.0.1:{proxy.port}/0")
    if spec.get("log_info"):
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    overrides: dict[str, Any] = dict(spec.get("engine") or {})
    # kvtier_drain: wait for the workers' Redis writes (an event, not a sleep);
    # kvtier_queue_spin_s: how the workers' queues wait (every engine, baselines too)
    overrides.setdefault("worker_extension_cls", worker_probe.PROBE_CLS)
    if extra is not None:
        overrides["kv_transfer_config"] = kvtier_transfer_config(extra)
        if spec.get("no_module_path"):  # rely on the vllm.general_plugins entry point
            overrides["kv_transfer_config"].pop("kv_connector_module_path")
    if any(step[0] == "perturb_weights" for step in spec["steps"]):
        # collective_rpc with a function, as RLHF examples run it (pickled to the workers).
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if int(overrides.get("tensor_parallel_size", 1)) > 1:
        for key, value in TP2_ENV.items():
            os.environ.setdefault(key, value)
    shared = shared_baseline_key(spec, overrides)
    reused = shared is not None and shared in _baselines
    try:
        if reused:
            llm = _baselines[shared]
            llm.reset_prefix_cache()  # as fresh as a new engine: nothing cached
        elif spec["model"] == "llama":
            llm = LLM(**llama_engine_kwargs(tiny_llama(), **overrides))
        else:
            llm = LLM(**hybrid_engine_kwargs(tiny_hybrid(), **overrides))
    except BaseException:
        if proxy is not None:
            proxy.stop()
        raise
    if shared is not None and not reused:
        _keep_baseline(shared, llm)
    try:
        result = {**drive(llm, spec, extra, proxy), "engine_reused": reused,
                  "engine_core_process": _engine_core_process_kind(llm),
                  "kv_transfer_config": overrides.get("kv_transfer_config")}
        if spec.get("report_spin"):  # the worker's queue spin (tests/support/idle_wait.py)
            result["busy_loop_s"] = llm.collective_rpc("kvtier_queue_spin_s")[0]
        return result
    finally:
        if proxy is not None:
            proxy.stop()
        if shared is None:
            engine_host.defer_shutdown(llm)


def _engine_core_process_kind(llm: Any) -> str:
    """How the engine core was started: ``SpawnProcess`` as vLLM's CPU platform does, or
    ``FastProcess`` from the engine host's fork server."""
    manager = getattr(llm.llm_engine.engine_core.resources, "engine_manager", None)
    processes = list(getattr(manager, "processes", ()))
    return type(processes[0]).__name__ if processes else "none"


#: Baseline engines (vLLM without kvtier) kept by the engine host for later specs, by
#: model and engine settings; at most two (llama and hybrid).
_baselines: dict[str, Any] = {}
_MAX_BASELINES = 2


def shared_baseline_key(spec: dict[str, Any], overrides: dict[str, Any]) -> str | None:
    """The key under which a baseline engine of ``spec`` is shared, or None (not shared).

    Only engines without kvtier, in the engine host, at TP=1, whose steps leave the model
    as it was (no weight updates): their outputs are a function of the prompt alone, and a
    prefix-cache reset makes them as fresh as a new engine."""
    if spec.get("extra") is not None or spec.get("proxy_to") \
            or os.environ.get("KVTIER_ENGINE_HOST") != "1" \
            or os.environ.get("KVTIER_TEST_SPAWN") == "1":  # spawned on purpose: its own
        return None
    if int(overrides.get("tensor_parallel_size", 1)) > 1:
        return None
    if any(step[0] in ("perturb_weights", "weight_version", "reset_connector")
           for step in spec["steps"]):
        return None
    return json.dumps([spec["model"], overrides], sort_keys=True)


def _keep_baseline(key: str, llm: Any) -> None:
    while len(_baselines) >= _MAX_BASELINES:
        engine_host.release_engine(_baselines.pop(next(iter(_baselines))))
    _baselines[key] = llm
    engine_host.keep_engine(llm)


def drive(llm: Any, spec: dict[str, Any], extra: dict[str, Any] | None,
          proxy: Any) -> dict[str, Any]:
    """Run ``spec``'s steps on ``llm``; outputs and kvtier's counters."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=int(spec.get("max_tokens", 8)), temperature=0.0,
                            logprobs=1 if spec.get("logprobs") else None)

    def stats() -> dict[str, Any]:
        flat = {k: int(v) if float(v).is_integer() else v for k, v in kvtier_stats(llm).items()}
        flat["cpu_tier"] = {"num_slots": flat.get("cpu_tier_slots", 0),
                            "entries": flat.get("cpu_tier_entries", 0),
                            "pinned": flat.get("cpu_tier_pinned", 0),
                            "reserved": flat.get("cpu_tier_reserved", 0),
                            "evictions": flat.get("cpu_evictions", 0)}
        flat["redis_tier"] = {"unavailable_events": flat.get("redis_unavailable_events", 0),
                              "recoveries": flat.get("redis_recoveries", 0)}
        return flat

    def poke() -> None:
        """One tiny request: the engine steps, so workers report and stats flow."""
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)

    def settle() -> None:
        """Every save planned so far has its outcome (Redis writes included) in the metrics,
        so a delta belongs to the request that caused it."""
        if extra is not None:
            worker_probe.drain(llm, lambda: kvtier_stats(llm), poke)
    outputs: list[dict[str, Any]] = []
    victims: list[int] = []  # worker pids of a "stop_before_host_commits" step

    def gen(name: str, prompt: str | list[int], salt: str | None = None,
            sampling: dict[str, Any] | None = None) -> str:
        before = counters(stats()) if extra is not None else {}
        request: Any = {"prompt_token_ids": prompt} if isinstance(prompt, list) \
            else {"prompt": prompt}
        if salt:
            request["cache_salt"] = salt
        this = params if not sampling else SamplingParams(
            max_tokens=int(sampling.get("max_tokens", params.max_tokens)), temperature=0.0,
            ignore_eos=bool(sampling.get("ignore_eos", False)), logprobs=params.logprobs)
        out = llm.generate([request], this, use_tqdm=False)[0]
        settle()
        after = counters(stats()) if extra is not None else {}
        delta = {k: after[k] - before.get(k, 0) for k in after
                 if isinstance(after[k], int) and after[k] != before.get(k, 0)}
        outputs.append({"name": name, "text": out.outputs[0].text,
                        "token_ids": list(out.outputs[0].token_ids),
                        "num_cached_tokens": out.num_cached_tokens,
                        "prompt_tokens": len(out.prompt_token_ids or ()), "delta": delta})
        if spec.get("logprobs"):
            completion = out.outputs[0]
            outputs[-1]["logprobs"] = [step[token].logprob for step, token in
                                       zip(completion.logprobs or (), completion.token_ids,
                                           strict=True)]
        return out.outputs[0].text

    def batch(name: str, prompts: list[str | list[int]]) -> None:
        before = counters(stats()) if extra is not None else {}
        requests: list[Any] = [{"prompt_token_ids": p} if isinstance(p, list) else {"prompt": p}
                               for p in prompts]
        outs = llm.generate(requests, params, use_tqdm=False)
        settle()
        full = stats() if extra is not None else {}
        after = counters(full)
        delta = {k: after[k] - before.get(k, 0) for k in after
                 if isinstance(after[k], int) and after[k] != before.get(k, 0)}
        outputs.append({"name": name, "delta": delta, "cpu_tier": full.get("cpu_tier", {})})
        for i, out in enumerate(outs):
            outputs.append({"name": f"{name}/{i}", "text": out.outputs[0].text,
                            "token_ids": list(out.outputs[0].token_ids),
                            "num_cached_tokens": out.num_cached_tokens,
                            "prompt_tokens": len(out.prompt_token_ids or ()),
                            "delta": delta if i == 0 else {}})

    for step in spec["steps"]:
        if step[0] == "batch":
            batch(step[1], step[2])
            continue
        if step[0] == "reset":
            llm.reset_prefix_cache()
            continue
        if step[0] == "reset_connector":  # what RLHF flows call after a weight update
            assert llm.reset_prefix_cache(reset_connector=True)
            continue
        if step[0] == "perturb_weights":
            changed = llm.collective_rpc(perturb_weights, args=(int(step[1]),))
            outputs.append({"name": f"perturb_weights-{step[1]}", "result": changed})
            continue
        if step[0] == "weight_version":
            llm.llm_engine.set_weight_version(str(step[1]))
            continue
        if step[0] == "corrupt_redis":
            outputs.append({"name": "corrupt_redis", "result": corrupt_redis(step[1], step[2])})
            continue
        if step[0] == "damage_rank":
            outputs.append({"name": f"damage_rank-{step[3]}",
                            "result": damage_one_rank(step[1], step[2], step[3])})
            continue
        if step[0] == "multi_turn":
            first_prompt, turns = step[1], int(step[2])
            reset = step[3] if len(step) > 3 else True
            multi_turn(lambda name, prompt: gen(name, prompt),
                       llm.reset_prefix_cache if reset else (lambda: None), first_prompt, turns)
            continue
        if step[0] in ("proxy", "wait_redis", "snapshot"):
            outputs.append(fault_step(step, proxy, stats, poke, settle))
            continue
        if step[0] == "kill_pid":  # SIGKILL another process (a daemon) mid-run; gone on return
            outputs.append({"name": f"kill_pid-{step[1]}", "result": kill_and_reap(int(step[1]))})
            continue
        if step[0] == "wait_writes":  # Redis takes writes again: the event, not the gauge
            outputs.append(wait_writes(gen, stats, float(step[1])))
            continue
        if step[0] == "wait_backfills":  # entries saved while Redis was down, sent to it
            tp = int(spec.get("engine", {}).get("tensor_parallel_size", 1))
            outputs.append(wait_backfills(stats, poke, tp, float(step[1])))
            continue
        if step[0] == "skip_host_commits":  # one TP rank's host saves never committed
            outputs.append({"name": "skip_host_commits",
                            "result": llm.collective_rpc("kvtier_skip_host_commits",
                                                         args=(int(step[1]),))})
            continue
        if step[0] == "stop_before_host_commits":  # host saves end copied, never committed
            victims = llm.collective_rpc("kvtier_stop_before_host_commits")
            outputs.append({"name": "stop_before_host_commits", "result": victims})
            continue
        if step[0] == "kill_engine":  # SIGKILL workers then engine core; the last step
            pids = list(victims) + engine_host.core_pids(llm)
            outputs.append({"name": "kill_engine", "result": [kill_and_reap(p) for p in pids]})
            return {"outputs": outputs, "stats": {}, "redis_tier": {}, "cpu_tier": {}}
        gen(step[1], step[2], step[3] if len(step) > 3 else None,
            step[4] if len(step) > 4 else None)
    if extra is not None:
        # At rest: every background write reported, and the CPU-tier gauges describe the
        # tier as it is now.
        settle()
        worker_probe.fresh_gauges(poke)
    full = stats() if extra is not None else {}
    return {"outputs": outputs, "stats": counters(full),
            "redis_tier": full.get("redis_tier", {}), "cpu_tier": full.get("cpu_tier", {})}


class Flapper:
    """RSTs every open connection of ``proxy`` every ``every_s`` seconds until ``stop()``;
    an exception in its thread fails the step that stops it."""

    def __init__(self, proxy: Any, every_s: float) -> None:
        self.proxy = proxy
        self.every_s = every_s
        self.connections_before = proxy.connections
        self.resets = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.every_s):
                self.resets += self.proxy.reset_all()
        except BaseException as exc:  # re-raised by stop(), in the runner's thread
            self.error = exc

    def stop(self, deadline_s: float = 300.0) -> int:
        """Stop once the client opened a connection while the resets went on (it kept
        reconnecting: the event the flapping is for, however long that takes)."""
        deadline = time.monotonic() + deadline_s  # only a client that never reconnects
        while (self.proxy.connections <= self.connections_before and self.error is None
               and time.monotonic() < deadline):
            time.sleep(0.02)  # polling interval
        self._stop.set()
        self._thread.join(60)  # one reset_all() at most: only a hung thread takes this long
        assert not self._thread.is_alive(), "the flapping thread did not stop"
        if self.error is not None:
            raise self.error
        return self.resets


def fault_step(step: list[Any], proxy: Any, stats: Any, poke: Any,
               settle: Any) -> dict[str, Any]:
    """``["proxy", "latency", s]``, ``["proxy", "reset"]``, ``["proxy", "mode", m]``,
    ``["proxy", "flap", every_s]`` ... ``["proxy", "steady"]``,
    ``["wait_redis", 0|1, timeout_s]`` (poll kvtier's gauge), ``["snapshot", name]`` (once
    every save planned so far has its outcome in the metrics)."""
    if step[0] == "proxy":
        assert proxy is not None, "spec has no proxy_to"
        if step[1] == "latency":
            proxy.latency_s = float(step[2])
        elif step[1] == "mode":
            proxy.mode = step[2]
        elif step[1] == "reset":
            return {"name": "proxy-reset", "reset": proxy.reset_all()}
        elif step[1] == "flap":  # RST every open connection every step[2] s until "steady"
            proxy.flapping = Flapper(proxy, float(step[2]))  # ("steady": once it reconnected)
        elif step[1] == "steady":
            return {"name": "proxy-steady", "resets": proxy.flapping.stop()}
        return {"name": f"proxy-{step[1]}"}
    if step[0] == "wait_redis":
        want, deadline = int(step[1]), time.monotonic() + float(step[2])
        start = time.monotonic()
        while stats().get("redis_available") != want and time.monotonic() < deadline:
            poke()  # the gauge comes with the workers' step reports
            time.sleep(0.05)  # polling interval; the deadline only ends a hung wait
        return {"name": f"wait_redis-{want}", "reached": stats().get("redis_available") == want,
                "waited_s": round(time.monotonic() - start, 3)}
    settle()
    full = stats()
    return {"name": step[1], "stats": counters(full), "redis_tier": full.get("redis_tier", {}),
            "proxy_connections": proxy.connections if proxy is not None else None}


def wait_writes(gen: Any, stats: Any, timeout_s: float) -> dict[str, Any]:
    """Run fresh 2-block prompts (token ids no other step uses) until one of them has every
    block it saved written to Redis (acknowledged): the link is healed and kvtier uses it
    again. After faults the availability gauge can still read 1 from before a failure
    kvtier has not met yet; a write that lands cannot. The result names that prompt (for
    another engine to read back). The deadline only ends a hung wait."""
    deadline = time.monotonic() + timeout_s
    tries = 0
    while True:
        tries += 1
        before = stats()
        prompt = [4 + (tries * 7919 + i * 104729) % 500 for i in range(64)]
        gen(f"wait_writes-{tries}", prompt)
        after = stats()
        saved, written = (after.get(k, 0) - before.get(k, 0)
                          for k in ("blocks_saved", "blocks_written_redis"))
        if written > 0 and written == saved:
            return {"name": "wait_writes", "reached": True, "tries": tries, "prompt": prompt,
                    "blocks_written": written}
        if time.monotonic() > deadline:
            return {"name": "wait_writes", "reached": False, "tries": tries}


def wait_backfills(stats: Any, poke: Any, tp: int, timeout_s: float) -> dict[str, Any]:
    """Step the engine until it has planned backfills (CPU-tier entries that never reached
    Redis, written once it answers again) and every rank answered every one planned so far
    (written or failed). The deadline only ends a hung wait."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats()
        planned, written, failed = (s.get(k, 0) for k in (
            "redis_backfills", "blocks_backfilled_redis", "redis_backfill_failures"))
        reached = planned > 0 and written + failed >= planned * tp
        if reached or time.monotonic() > deadline:
            return {"name": "wait_backfills", "reached": reached, "planned": planned,
                    "written": written, "failed": failed}
        poke()  # the engine steps: backfills are planned, and reports carry their outcomes


def run_in_subprocess(spec: dict[str, Any], timeout: float = 900,
                      env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``spec`` with its own engine (fresh engine core and workers, vLLM's default
    executors) in this test process's engine host, ``env`` set for it (its engine's
    processes inherit it); the parsed result, ``log`` included."""
    return engine_host.run_spec("tests.support.connector_runner:run", spec, timeout, env)


def main() -> None:
    result = run(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()

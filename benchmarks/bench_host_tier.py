"""The host tier (``kvtier daemon --cpu-bytes``): restore throughput and what DP=2 recomputes.

    python -m benchmarks.bench_host_tier [--quick] [--json PATH] [--skip-servers]

Two measurements, side by side with their reference in the same run:

1. **Restore GB/s from the shared segment vs memcpy.** A real daemon process; one client
   writes ``N`` slots of random bytes, another (subscribed: its mirror holds them) reads
   every slot back, each of these ways, against ``numpy.copyto`` of the same bytes between
   two private arrays (``memcpy``: the memory's limit), best of several repetitions,
   interleaved:

   * ``checked``: ``read_many_into`` into private memory: every shard's header checked,
     its bytes copied out in cache-sized chunks and the xxh3 checksum computed over each
     chunk of the copy while it is still in cache (copy-then-checksum, one pass over
     memory). JSON ``ratios.checked_restore_vs_memcpy_2MiB`` / ``_64KiB`` (aims: >= 0.8 and
     >= 0.6, issue 43).
   * ``in place + load`` (``verified``): as an x86-64 engine's worker restores into KV
     tensors laid out as vLLM's CPU backend lays out a layer (``[num_blocks, block
     bytes]`` per layer, 8 layers per slot): ``verify_many`` (each shard's checksum where
     it lies: the fetch), ``BlockTransfer.scatter`` straight from the segment and
     ``unchanged`` (the load): two passes over the segment. JSON
     ``ratios.restore_gbps_vs_memcpy`` (the worse slot size).
   * ``copy + load`` (``copied``): as a weakly ordered CPU's worker restores (aarch64;
     ``KVTIER_SEQLOCK_SOUND=0``): ``read_many_into`` into a fresh private buffer, then
     ``scatter`` from it into the KV tensors.
   * ``load``: the scatter alone, unchecked (what the check costs).
2. **Recomputed prompt tokens at DP=2.** vLLM's OpenAI server at ``--data-parallel-size 2``
   with kvtier, once with each engine core's own CPU tier and once with the host tier, the
   same conversations (each turn's prompt extends the last one; vLLM hands sequential
   requests to the engine cores in turn, so a conversation's next turn usually lands on the
   other core). Recomputed = prompt tokens - ``cached_tokens``. JSON
   ``ratios.recomputed_host_vs_per_engine``.

The machine's cores are shared by the client, the daemon and the servers: read ``load``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import best, load_1m, write_result
from connector.demo.presets import kvtier_transfer_config
from connector.demo.tiny_models import prompt_words, tiny_llama
from offload_tiers.host_tier.client import HostTierClient
from offload_tiers.shared_segment import digest
from rigs.daemon_proc import HostTierDaemon
from rigs.openai_server import OpenAIServer, complete

MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[host-tier {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


LAYERS = 8


def kv_cache(num_blocks: int, slot_bytes: int) -> tuple[dict[str, torch.Tensor], Any]:
    """KV tensors of ``num_blocks`` blocks whose bytes fill a slot (``LAYERS`` layers, each
    ``[num_blocks, slot_bytes / LAYERS]`` of float32, block-contiguous as vLLM's CPU
    backend lays a layer out) and a transfer over them with room for the slot's rows."""
    from connector.vllm_connector.layout import build_layout
    from connector.vllm_connector.transfer import BlockTransfer

    kv = {f"layer{i}": torch.zeros(num_blocks, slot_bytes // LAYERS // 4)
          for i in range(LAYERS)}
    layout = build_layout(kv, [(0, "attention", 32, list(kv))], num_blocks)
    slab = np.empty((1, layout.slot_bytes), dtype=np.uint8)  # unused: loads name a source
    return kv, BlockTransfer(kv, layout, slab)


def restore_throughput(slots: int, slot_bytes: int, reps: int) -> dict[str, Any]:
    """GB/s of verified reads out of the daemon's segment, of an unchecked copy out of it,
    and of memcpy between private arrays, on the same bytes."""
    tmp = Path(tempfile.mkdtemp(prefix="kvtier-host-bench-"))
    daemon = HostTierDaemon(tmp / "host.sock", f"bench-{uuid.uuid4().hex[:12]}",
                            slots=3 * slots, slot_bytes=slot_bytes).start()
    writer = HostTierClient(str(daemon.sock), label="bench writer", lease_batch=slots)
    reader = HostTierClient(str(daemon.sock), label="bench reader", subscribe=True,
                            lease_batch=1)
    try:
        writer.start()
        reader.start()
        assert writer.wait_until(lambda c: len(c._pool) >= slots, 60), writer.last_error
        rng = np.random.default_rng(0)
        src = rng.integers(0, 256, (slots, slot_bytes), dtype=np.uint8)
        keys = [digest(b"bench-%d" % i) for i in range(slots)]
        for key, row in zip(keys, src, strict=True):
            assert writer.write(key, row)
        assert reader.wait_until(lambda c: all(k in c.mirror for k in keys), 60)
        where = [reader.lookup(k) for k in keys]
        segment = reader.segment
        assert segment is not None and all(w is not None for w in where)
        seg_slots = [w.slot for w in where]  # type: ignore[union-attr]
        save_ids = [w.save_id for w in where]  # type: ignore[union-attr]
        kv, transfer = kv_cache(slots, slot_bytes)
        block_ids = list(range(slots))
        dst = np.empty_like(src)
        checked_dst = np.zeros_like(src)
        rows = list(range(slots))

        def checked() -> None:  # every shard copied out, its checksum over the copy
            if not all(segment.read_many_into(seg_slots, keys, save_ids, checked_dst)):
                raise AssertionError("a slot failed its check")

        def copied() -> None:  # a weakly ordered CPU's worker: copy-then-checksum, then load
            buf = np.empty((slots, slot_bytes), dtype=np.uint8)
            if not all(segment.read_many_into(seg_slots, keys, save_ids, buf)):
                raise AssertionError("a slot failed its check")
            transfer.scatter(0, block_ids, rows, source=buf)

        def verified() -> None:  # as an engine's worker restores: fetch (check), then load
            seqs = segment.verify_many(seg_slots, keys, save_ids, [slot_bytes] * slots)
            if None in seqs:
                raise AssertionError("a slot failed its check")
            transfer.scatter(0, block_ids, seg_slots, source=segment.payloads)
            if not all(segment.unchanged(seg_slots, seqs)):  # type: ignore[arg-type]
                raise AssertionError("a slot was written during the load")

        def unchecked() -> None:
            transfer.scatter(0, block_ids, seg_slots, source=segment.payloads)

        def memcpy() -> None:
            np.copyto(dst, src)

        fns = (("memcpy", memcpy), ("checked", checked), ("verified", verified),
               ("copied", copied), ("unchecked", unchecked))
        results = dict.fromkeys((name for name, _ in fns), 0.0)
        for _ in range(10):  # interleaved rounds; best of each
            for name, fn in fns:
                results[name] = max(results[name], src.nbytes / best(fn, reps) / 1e9)
        assert np.array_equal(checked_dst, src), "a checked read returned other bytes"
        for load in (verified, copied):
            for t in kv.values():
                t.zero_()
            load()
            loaded = np.concatenate([t.view(torch.uint8).numpy().reshape(slots, -1)
                                     for t in kv.values()], axis=1)
            assert np.array_equal(loaded, src), "a restore loaded other bytes"
        return {"slots": slots, "slot_bytes": slot_bytes, "bytes": int(src.nbytes),
                "gbps": {k: round(v, 3) for k, v in results.items()},
                "checked_vs_memcpy": results["checked"] / results["memcpy"],
                "restore_gbps_vs_memcpy": results["verified"] / results["memcpy"],
                "copied_vs_memcpy": results["copied"] / results["memcpy"],
                "unchecked_vs_memcpy": results["unchecked"] / results["memcpy"]}
    finally:
        writer.close()
        reader.close()
        daemon.kill()
        daemon.remove_files()


def conversations(n: int, turns: int) -> list[list[str]]:
    """``n`` conversations of ``turns`` prompts, each extending the one before."""
    out = []
    for c in range(n):
        prompt = prompt_words(500 + c, 150)
        turns_c = [prompt]
        for t in range(1, turns):
            prompt = prompt + " " + prompt_words(900 + 10 * c + t, 40)
            turns_c.append(prompt)
        out.append(turns_c)
    return out


def settle(server: OpenAIServer, daemon: HostTierDaemon, deadline_s: float = 300) -> None:
    """Until the daemon has received every host-tier write the workers committed (their
    count reaches /metrics with the next step: a short request steps both cores)."""
    deadline = time.monotonic() + deadline_s
    while True:
        complete(server, "hi")
        complete(server, "hi")
        written = server.metrics().get("vllm:kvtier_blocks_written_host", 0)
        tier = daemon.tier()
        if tier["commits"] + tier["duplicates_dropped"] + tier["commits_rejected"] >= written:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the daemon received fewer than {written} commits")


def dp2_recomputed(model_dir: Path, logs: Path, host: bool, convs: list[list[str]]
                   ) -> dict[str, Any]:
    """Prompt and cached tokens of the conversations, turn by turn (all conversations' turn
    t before any turn t+1, then the host tier settled), on an OpenAI server at DP=2."""
    daemon = None
    extra: dict[str, Any] = {"cpu_bytes": 64 * MiB}
    if host:
        daemon = HostTierDaemon(logs / "run" / "host.sock", f"bench-dp-{uuid.uuid4().hex[:8]}",
                                slots=1024, slot_bytes=64 * 1024).start()
        extra["host_tier_socket"] = str(daemon.sock)
    name = "host" if host else "per-engine"
    server = OpenAIServer(model_dir, logs / f"{name}.log",
                          kv_transfer_config=kvtier_transfer_config(extra), env={},
                          extra_args=["--data-parallel-size", "2",
                                      "--enable-prompt-tokens-details"])
    prompt_tokens = cached = 0
    try:
        log(f"{name}: starting the server (DP=2)")
        server.start(timeout_s=600)
        for t in range(len(convs[0])):
            for conv in convs:
                out = complete(server, conv[t])
                prompt_tokens += out["prompt_tokens"]
                cached += out["cached"]
            if daemon is not None:
                settle(server, daemon)
        metrics = server.metrics()
    finally:
        server.stop()
        if daemon is not None:
            daemon.kill()
            daemon.remove_files()
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "recomputed_tokens": prompt_tokens - cached,
            "hit_tokens_host": metrics.get("vllm:kvtier_hit_tokens_host", 0),
            "hit_tokens_cpu": metrics.get("vllm:kvtier_hit_tokens_cpu", 0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-servers", action="store_true",
                        help="only the restore throughput (no vLLM servers)")
    args = parser.parse_args()
    load_before = load_1m()
    out: dict[str, Any] = {"restore": {}, "ratios": {}}
    reps = 3 if args.quick else 7
    for label, slot_bytes, slots in (("block_2MiB", 2 * MiB, 64 if args.quick else 256),
                                     ("page_64KiB", 64 * 1024, 1024 if args.quick else 4096)):
        log(f"restore {label}: {slots} slots")
        out["restore"][label] = restore_throughput(slots, slot_bytes, reps)
    for label, r in out["restore"].items():
        out["ratios"][f"checked_restore_vs_memcpy_{label.split('_')[1]}"] = (
            r["checked_vs_memcpy"])
    worst = min(r["restore_gbps_vs_memcpy"] for r in out["restore"].values())
    out["ratios"]["restore_gbps_vs_memcpy"] = worst
    if not args.skip_servers:
        # an odd number: each turn of a conversation lands on the other engine core
        convs = conversations(5 if args.quick else 9, 3 if args.quick else 4)
        logs = Path(tempfile.mkdtemp(prefix="kvtier-host-bench-servers-"))
        dp = {name: dp2_recomputed(tiny_llama(), logs, host, convs)
              for name, host in (("per_engine", False), ("host", True))}
        out["dp2"] = dp
        per_engine = dp["per_engine"]["recomputed_tokens"]
        out["ratios"]["recomputed_host_vs_per_engine"] = (
            dp["host"]["recomputed_tokens"] / per_engine if per_engine else None)
    out["load"] = [load_before, load_1m()]
    print(f"\n{'GB/s (x memcpy)':<12} {'memcpy':>7} {'checked':>14} {'in place+load':>14} "
          f"{'copy+load':>14} {'load':>14}")
    for label, r in out["restore"].items():
        g = r["gbps"]
        cells = " ".join(f"{g[k]:>7.2f} ({g[k] / g['memcpy']:.2f}x)"
                         for k in ("checked", "verified", "copied", "unchecked"))
        print(f"{label:<12} {g['memcpy']:>7.2f} {cells}")
    if "dp2" in out:
        print(f"\n{'DP=2 server':<12} {'prompt tok':>11} {'cached':>8} {'recomputed':>11} "
              f"{'host hits':>10}")
        for name, r in out["dp2"].items():
            print(f"{name:<12} {r['prompt_tokens']:>11} {r['cached_tokens']:>8} "
                  f"{r['recomputed_tokens']:>11} {r['hit_tokens_host']:>10.0f}")
    print(f"\nratios: {json.dumps(out['ratios'])}  (load {out['load']})")
    write_result(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A real vLLM engine on the CPU with KV events on -> a real ``kvtier daemon`` process.

* tiny Llama: after a request, /lookup on the next request's block hashes equals the
  prefix vLLM itself reports as cached (``num_cached_tokens``); lookup by token ids (our
  own hashing, configured like the engine) agrees; ``reset_prefix_cache`` clears it.
* tiny hybrid (Mamba + attention), ``prefix_match_unit=32``: the partial entry is PARTIAL
  with the right ``num_tokens`` in every group, never a full block; the fine-grained look-up
  equals vLLM's ``num_cached_tokens`` (which includes the partial hit).
* tiny Llama with requests in vLLM's ``kv_cache_report_mode="full"`` (a reused prefix is
  announced again, evicted once): a daemon told the mode answers 0 after the eviction, as
  vLLM does; one that is not counts the re-announcement.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rigs import engine_starts
from rigs.daemon_proc import DaemonProcess
from rigs.ports import free_port
from tests.support.vllm_engine import (
    apply_cpu_engine_env,
    hybrid_engine_kwargs,
    llama_engine_kwargs,
)

pytestmark = pytest.mark.e2e


def vllm_chain(llm: Any, token_ids: list[int], unit: int) -> list[int]:
    """The request's block hashes exactly as vLLM computes them (its own functions)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    algo = llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo
    fn = get_hash_fn_by_name(algo)
    parent = None
    out = []
    for i in range(len(token_ids) // unit):
        parent = kcu.hash_block_tokens(fn, parent, token_ids[i * unit:(i + 1) * unit], None)
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


class EngineRig:
    def __init__(self, kwargs_fn: Any, model_dir: Path, daemon_args: list[str],
                 more_daemons: tuple[list[str], ...] = (), **engine: Any) -> None:
        """``more_daemons``: the flags of further daemons on the same stream."""
        apply_cpu_engine_env()
        self.port, self.replay_port = free_port(), free_port()
        self.daemons = [DaemonProcess(
            "--endpoint", f"tcp://*:{self.port},tcp://*:{self.replay_port}", *args).start()
            for args in (daemon_args, *more_daemons)]
        self.daemon = self.daemons[0]
        from vllm import LLM
        from vllm.config import KVEventsConfig

        events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                endpoint=f"tcp://*:{self.port}",
                                replay_endpoint=f"tcp://*:{self.replay_port}", topic="")
        # In-process engine (the shortcut, on purpose): ``settle`` reads vLLM's own publisher
        # to know when the daemon has caught up. The connector's e2e tests run vLLM's default
        # executors; this module is about the daemon mirroring vLLM's events. The variable is
        # read when the engine is built, and restored right after for the other tests.
        previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            engine_starts.record("in-process engine (daemon e2e)")
            self.llm = LLM(**kwargs_fn(model_dir, kv_events_config=events, **engine))
        finally:
            if previous is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous

    def run(self, token_ids: list[int], report_mode: str | None = None) -> int:
        from vllm import SamplingParams

        extra = {"kv_cache_report_mode": report_mode} if report_mode else None
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=extra)
        out = self.llm.generate({"prompt_token_ids": token_ids}, params, use_tqdm=False)
        return out[0].num_cached_tokens

    def settle(self, daemon: DaemonProcess | None = None) -> dict[str, Any]:
        """Wait until the daemon has applied every batch vLLM has published so far."""
        daemon = daemon or self.daemon
        pub = self.llm.llm_engine.engine_core.engine_core.scheduler.kv_event_publisher
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if pub._event_queue.unfinished_tasks:  # still being sent by vLLM's thread
                time.sleep(0.02)
                continue
            published = pub._buffer[-1][0] + 1 if pub._buffer else 0
            s = daemon.stats()
            src = s["sources"][0]
            if src["next_seq"] == published and not src["replaying"]:
                return s
            time.sleep(0.05)
        raise AssertionError(f"daemon did not catch up: {daemon.stats()}")

    def close(self) -> None:
        for d in self.daemons:
            d.kill()
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: S110 - best-effort teardown of an in-process engine
            pass
        del self.llm
        gc.collect()


@pytest.fixture
def llama_rig(tiny_llama_dir: Path) -> Iterator[EngineRig]:
    rig = EngineRig(llama_engine_kwargs, tiny_llama_dir,
                    ["--config", str(_token_hashing_cfg(tiny_llama_dir.parent, 32))])
    yield rig
    rig.close()


def _token_hashing_cfg(where: Path, unit: int) -> Path:
    path = where / f"kvtier-daemon-test-{unit}-{free_port()}.yaml"
    path.write_text("publishers: [{endpoint: 'tcp://*:1'}]\n"
                    f"token_hashing: {{algo: sha256, hash_block_size: {unit}}}\n")
    return path


def test_llama_lookup_equals_vllm_num_cached_tokens(llama_rig: EngineRig) -> None:
    rig, d = llama_rig, llama_rig.daemon
    first = list(range(10, 110))  # 100 tokens: 3 full blocks of 32 get cached
    second = first + list(range(300, 330))  # 130 tokens: 4 full blocks
    assert rig.run(first) == 0
    rig.settle()
    chain = vllm_chain(rig.llm, second, 32)
    looked = d.lookup(chain)
    by_tokens = d.post("/lookup", {"token_ids": second})[1]
    cached = rig.run(second)
    assert cached == 96
    assert looked["GPU"] == {"tokens": cached, "full_blocks": 3, "partial": False}
    assert looked["any"]["tokens"] == cached and looked["CPU"]["tokens"] == 0
    assert by_tokens == looked  # our token hashing == vLLM's

    # A third request after the second one: its 4 blocks are now cached on the GPU.
    rig.settle()
    third = second + list(range(400, 440))
    looked = d.lookup(vllm_chain(rig.llm, third, 32))
    assert looked["GPU"]["tokens"] == rig.run(third) == 128

    # reset_prefix_cache -> AllBlocksCleared (published with the next step) -> nothing cached.
    rig.settle()
    assert rig.llm.reset_prefix_cache()
    rig.run(list(range(450, 470)))
    s = rig.settle()
    assert s["publishers"][next(iter(s["publishers"]))]["cleared_events"] >= 1
    assert d.lookup(vllm_chain(rig.llm, third, 32))["GPU"]["tokens"] == rig.run(third) == 0


def test_hybrid_partial_entries_are_partial_with_right_num_tokens(tiny_hybrid_dir: Path) -> None:
    rig = EngineRig(hybrid_engine_kwargs, tiny_hybrid_dir, [])
    try:
        d = rig.daemon
        first = list(range(10, 110))  # 100 tokens: block 0 (64) full, partial entry at 96
        second = first + list(range(300, 330))  # 130 tokens
        rig.run(first)
        s = rig.settle()
        groups = sorted({int(k.rsplit("/", 1)[1]) for k in s["index"]["block_sizes"]})
        assert len(groups) >= 2  # hybrid: attention + Mamba groups
        block = next(iter(s["index"]["block_sizes"].values()))
        assert block == 64  # learned from the stream (vLLM raised attention to 64)
        fine = vllm_chain(rig.llm, second, 32)  # one hash per prefix_match_unit
        for g in groups:
            status, body = d.post("/entries", {"block_hashes": fine, "group_idx": g})
            assert status == 200
            by_hash = {e["block_hash"]: e for e in body["entries"]}
            assert by_hash[fine[1]]["kind"] == "FULL" and by_hash[fine[1]]["num_tokens"] == 64
            assert by_hash[fine[2]]["kind"] == "PARTIAL"
            assert by_hash[fine[2]]["num_tokens"] == 96
            for e in body["entries"]:
                if e["kind"] == "FULL":
                    assert e["num_tokens"] % 64 == 0  # a partial is never a full block
        coarse = [fine[1], fine[3]]  # block-granularity chain (hash at each block end)
        looked_fine = {g: d.lookup(fine, group=g, hash_block_size=32) for g in groups}
        looked_coarse = d.lookup(coarse, group=groups[0])
        cached = rig.run(second)
        assert cached == 96  # vLLM's own answer includes the partial hit
        for g in groups:
            assert looked_fine[g]["GPU"] == {"tokens": cached, "full_blocks": 1,
                                             "partial": True}
        assert looked_coarse["GPU"] == {"tokens": 64, "full_blocks": 1, "partial": False}
        assert s["index"]["by_medium_kind"].get("GPU/PARTIAL", 0) >= len(groups)
    finally:
        rig.close()


def test_llama_full_report_mode_reannouncements_leave_no_stale_entries(
        tiny_llama_dir: Path) -> None:
    # 12 blocks of 32 tokens: four 100-token fillers evict the first prompt's blocks.
    rig = EngineRig(llama_engine_kwargs, tiny_llama_dir, [],
                    (["--kv-cache-report-mode", "full"],),
                    num_gpu_blocks_override=12, max_model_len=256)
    try:
        plain, told = rig.daemons
        prompt = list(range(10, 110))  # 3 full blocks of 32
        assert rig.run(prompt, "full") == 0
        assert rig.run(prompt, "full") == 96  # reused: vLLM announces the 3 blocks again
        for i in range(4):
            rig.run(list(range(110 + 100 * i, 210 + 100 * i)), "full")  # vocabulary: 512
        chain = vllm_chain(rig.llm, prompt, 32)
        stats = {d: rig.settle(d) for d in rig.daemons}
        looked = {d: d.lookup(chain)["GPU"]["tokens"] for d in rig.daemons}
        cached = rig.run(prompt)  # what vLLM itself has left of it
        assert cached == 0  # evicted by the fillers (each block removed once)
        assert looked[told] == cached  # told the mode: nothing stale
        pubs = {d: next(iter(stats[d]["publishers"].values())) for d in rig.daemons}
        print(f"KVTIER-FULL-MODE vllm_cached={cached} told={looked[told]} "
              f"plain={looked[plain]} reannounced={pubs[plain]['reannounced_events']} "
              f"removed_events={pubs[plain]['removed_events']} "
              f"entries_told={stats[told]['index']['entries']} "
              f"entries_plain={stats[plain]['index']['entries']}")
        for d in rig.daemons:
            assert pubs[d]["reannounced_events"] >= 1  # detected either way
        # Not told: the re-announcement's reference outlives the eviction (documented; the
        # daemon warns and counts it instead).
        assert looked[plain] == 96
    finally:
        rig.close()

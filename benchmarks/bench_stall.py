"""Does kvtier stall decoding? One stream decodes while others restore and store long prefixes.

vLLM's OpenAI-compatible server runs as a subprocess, as users run it
(``python -m vllm.entrypoints.openai.api_server``, vLLM's default multiprocess executors:
API server, engine core and worker are three processes), with the tiny Llama on the CPU
backend (float32, eager, block 32). The client drives it over HTTP with concurrent
streaming completions (``httpx`` async). Side by side in one run:

  none     vLLM alone: warm the prefixes, ``POST /reset_prefix_cache``, measure
           (the restoring requests recompute their prefixes)
  native   vLLM's OffloadingConnector with the CPU transfer worker in
           ``connector/native_tier/cpu_offload.py``: warm, reset, measure (its CPU tier
           serves the prefixes)
  kvtier   TieredOffloadingConnector with ``redis_url`` pointing at a loopback latency
           proxy (its own process, ``rigs/tcp_proxy.py``, +``--rtt-ms`` per round
           trip; ``--rtt-ms 0``: no proxy) in front of Redis, write_mode "back" (the
           default): warm the prefixes in one server, wait until Redis holds them, stop it,
           start a new server process and
           measure: every prefix comes from Redis (asynchronous probe, then an
           asynchronous fetch in the worker's I/O threads)

  kvtier-daemon  (only when named in ``--configs``) kvtier with Redis reached through a
           new host-tier daemon (``kvtier daemon --cpu-bytes``, ``host_tier_redis``: the
           daemon reads and writes Redis behind the same proxy, the worker process opens no
           Redis connection), its prefixes warmed under a prefix of its own
  kvtier-local  (only when named) kvtier as ``kvtier`` (Redis behind the proxy), its
           prefixes warmed in the measured server and vLLM's prefix cache reset, as for
           native: its CPU tier serves the restores, the workload native gets
  none-again, native-again  (only when named) A/A controls: a second server of ``none`` or
           ``native``, set up alike and measured in the same rounds. Its ITL p99 over the
           first's (JSON ``aa_controls``) is what this benchmark reads between two identical
           servers: the yardstick for kvtier's ratio over native's

The measured servers are up at once (idle ones cost nothing once their queues stop
spinning) and take turns round by round, the order rotated per round: round ``r`` of every
config runs the same prompts within seconds of the others', so load from elsewhere on the
machine falls on all of them alike.

A round: one *decoding stream* (short prompt, long ``max_tokens``, ``ignore_eos``; when it
reaches the model's length another starts, so the whole window has one) runs;
once it decodes steadily, ``restores`` requests (a warmed prefix + a new suffix) and
``stores`` requests (a new long prompt nothing holds: kvtier saves it, to Redis too) start
at a fixed interval, interleaved. The *window* runs from the first of them sent to the last
one done, and at least ``min_window_s`` (4 s quick, 6 s full: every config's window has as
many decode steps beside the same prefill steps, when it serves them sooner); every gap
between two chunk arrivals of the decoding stream that ends inside the window is one
*client* inter-token latency sample (pooled over the rounds); ``client idle ITL`` is the
same stream before the window. A warm-up round (its own prefixes) runs first
on every measured server and is not counted.

The headline ITL is the engine's: vLLM's own ``vllm:inter_token_latency_seconds``
histogram (every request's tokens, timed by the engine core's step timestamps), scraped
from ``/metrics`` when the window opens and when it closes, with finer buckets than vLLM's
(``--custom-histogram-buckets``, :data:`ITL_BUCKETS_S`: 0.5 ms steps up to 20 ms); its
percentiles are interpolated within a bucket. The client's chunk gaps also measure when the
client and the API server got a core: on this 2-core machine they arrive in bursts (a
client ITL p50 of 0.02 ms in a run of 2026-12-04), so they are reported beside it, not
used for the ratios' headline.

Every server prefills at most 256 tokens per step (``--max-num-batched-tokens``, chunked
prefill, as latency-minded deployments run). With vLLM's default budget a 1024-token prompt
is one step ~10x a decode step, prefill steps are about 1 % of the window's ITL samples, and
the p99 falls between the two modes: one config's per-round p99 ranged 8-102 ms in one
run of 2026-12-04. ``--max-num-batched-tokens 0`` runs vLLM's default.

Each round also gives its own ratios against vLLM alone's same round (ITL p99 and p50,
storing and restoring TTFT p50): their median and range (JSON
``connectors.<name>.round_ratios``) say how far one run's pooled ratio can be trusted.
``itl_aims`` (JSON and the last lines): kvtier's ITL p99 over native's and over vLLM
alone's, pooled and as the median of per-round ratios, against the aims (<= 1.0 and <=
1.2); a run where any config had an error or a round without a decoding stream at its end
judges nothing (``valid`` false). Each aim's ``paired``, and each A/A control's: the
geometric mean of the per-round ITL p99 ratios and its 95 % interval
(``benchmarks/paired.py``), what this many rounds resolve; ``p50_paired`` the same of the
ITL p50.

Where the CPU went: around every round the client reads every thread's run time on the
machine (``/proc/PID/task/TID/schedstat``) and splits the round's CPU-seconds by role (JSON
``summary.cpu_cores_by_role``, cores busy per second of round, and
``cpu_ms_per_step_by_role``, per engine step of the measured server): the measured server's
engine core, worker main thread (OpenMP thread 0 too), other worker threads, kvtier's own
threads (``kvtier-*``) and API server; the idle servers, the latency proxy,
``redis-server``, the client, and the rest of the machine.

Reported per config: ITL p50/p99 (engine), client ITL p50/p99 and idle p50,
restoring requests' TTFT p50/p90 and cached
tokens (``--enable-prompt-tokens-details``), store requests' TTFT p50, kvtier's
``vllm:kvtier_*`` counters. Ratios are against ``none``; JSON ``ratios`` holds kvtier's
(headline ``itl_p99_vs_no_connector``) plus native's under ``native_*``, and
``connectors.<name>.ratios`` each connector's.

With ``--hook-calls`` each connector's engine steps are also compared at the same work
(``benchmarks/hook_steps.py``: decode-only steps, steps with a long prefill chunk, the
rest), kvtier's p50 and p99 over native's per kind (JSON ``engine_step_ratios``): the
pooled ITL p99 also moves with how each engine's schedule spread the other requests over
the window (a round whose requests waited seconds for their first token has fewer chunk
steps beside the decoding stream), these do not. (In the runs before 2026-12-07's night
such waits were the client's: see "Every server" below.)

Redis is a private ``redis-server`` on a loopback port, started for the run and stopped
after it (``--redis-url``: another one). The latency proxy and that server stand in for a
network and a Redis host, which on a deployment take none of the engine host's cores; here
they share the 2 cores with the engines. ``--stand-ins-nice N`` runs both at ``nice N``
(default 0, as every run so far). At 10 they took only what the engines left, and in the
one run of it (2026-12-07) the starved proxy timed kvtier's Redis link and presence feed
out: kvtier's ITL p99 1.32x native's, its p50 1.38x.

The client, the proxy and the server share the machine's cores (2 here): run it on a quiet
machine, repeat it, and read ``load`` (1-min load average before/after each config).

Every server gets ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (``--reserved-cpus``; see
``server_env``), and runs in this process's session (``rigs.openai_server.spawn_group``),
with the client, the proxy and ``redis-server``: with the kernel's autogroups a server in a
session of its own, busy decoding, kept the others off the CPU for 3-4 s at a time, so
that the client's requests reached the engines seconds late and bunched (every earlier
run's TTFTs, vLLM alone's included) and kvtier's Redis stand-ins timed out.

Usage: python -m benchmarks.bench_stall [--quick] [--json PATH] [--redis-url URL]
       [--stand-ins-nice N]
       [--rtt-ms MS] [--configs none,native,kvtier[,kvtier-daemon,kvtier-local,
       none-again,native-again]] [--rounds N]
       [--gap-s S] [--reserved-cpus N|vllm] [--log-dir DIR] [--hook-calls]
       [--kvtier-extra JSON]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks import hook_steps
from benchmarks.e2e_engine import KV_CACHE_BYTES, SMALL_KV_ENV, wait_for_memory
from benchmarks.harness import load_1m, say, write_result
from benchmarks.paired import paired_ratio
from connector.demo.cli import delete_redis_prefix
from connector.demo.host_daemon import DemoHostTier
from connector.demo.presets import kvtier_transfer_config
from connector.demo.thread_times import all_processes, process_tree, thread_times
from connector.demo.tiny_models import prompt_words, tiny_llama
from offload_tiers.redis.presence_feed import is_announce_stream
from rigs.openai_server import OpenAIServer
from rigs.ports import free_port
from rigs.redis_server import RedisServer

REPO_ROOT = Path(__file__).resolve().parent.parent

BLOCK = 32
CPU_BYTES = 512 << 20
NATIVE_EXTRA = {
    "spec_name": "CpuPeerOffloadingSpec",
    "spec_module_path": "connector.native_tier.cpu_offload",
    "cpu_bytes_to_use": CPU_BYTES,
}
CONFIGS = ("none", "native", "kvtier")
#: Run only when named in --configs: kvtier with Redis reached through the host-tier daemon
#: (``host_tier_redis``: the worker process opens no Redis connection), and the A/A
#: controls: a second server of ``none`` or ``native``, set up alike and measured in the same
#: rounds, whose ratio to the first is what the benchmark reads between two identical servers.
OPTIONAL_CONFIGS = ("kvtier-daemon", "kvtier-local", "none-again", "native-again")
AGAIN = "-again"


def warms_in_place(config: str) -> bool:
    """Whether the measured server warms its own prefixes and resets vLLM's prefix cache
    (its connector's CPU tier then serves them), rather than restore them from Redis."""
    return config == "kvtier-local" or not config.startswith("kvtier")


def base_config(config: str) -> str:
    """The config an A/A control repeats (``native-again``: ``native``); else itself."""
    return config.removesuffix(AGAIN)
HOST_SLOT_BYTES = 1 << 20
#: Niceness of the latency proxy and the private redis-server: they stand in for a network
#: and a Redis host, which on a deployment take none of the engine host's cores.
STAND_INS_NICE = 0
# vLLM's inter-token latency histogram, finer than its defaults (10, 25, 50, 75 ms, ...) so
# that its percentiles resolve a step: 0.5 ms up to 20 ms, 1 ms up to 60, 5 ms up to 200.
ITL_BUCKETS_S = tuple(
    [round(0.0005 * i, 4) for i in range(1, 41)] + [round(0.001 * i, 3) for i in range(21, 61)]
    + [round(0.005 * i, 3) for i in range(13, 41)] + [0.25, 0.5, 1.0, 2.0, 5.0, 10.0])
ITL_METRIC = "vllm:inter_token_latency_seconds_bucket"


@dataclass(frozen=True)
class Shape:
    """The workload of one run (token counts: the tiny models' tokenizer is word-level)."""

    rounds: int
    restores: int  # per round
    stores: int  # per round
    prefix_tokens: int  # warmed prefix of a restoring request (block-aligned)
    suffix_tokens: int  # new tokens after it
    store_tokens: int  # prompt of a storing request (nothing holds it)
    other_max_tokens: int  # answer length of restoring / storing requests
    interval_s: float  # between two request starts in the window
    decode_prompt_tokens: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 16
    # vLLM's token budget per step (chunked prefill): a 1024-token prompt is prefilled over 4
    # steps. Without it, one step prefills the whole prompt (~10x a decode step) and the ITL
    # p99 lands between the two modes: a round's p99 was 8 ms or 90 ms in the same config.
    max_num_batched_tokens: int = 256
    # The shortest window: a round's window runs at least this long, however soon its last
    # request is done. A config that serves the requests sooner would otherwise have fewer
    # decode steps beside the same prefill steps, and so a higher p99 for being faster (one
    # run of 2026-12-07: windows of 1.9 s in one config, 8.3 s in another, same prompts).
    min_window_s: float = 0.0


FULL = Shape(rounds=16, restores=6, stores=6, prefix_tokens=1536, suffix_tokens=40,
             store_tokens=1536, other_max_tokens=8, interval_s=0.25, min_window_s=6.0)
QUICK = Shape(rounds=6, restores=4, stores=4, prefix_tokens=1024, suffix_tokens=40,
              store_tokens=1024, other_max_tokens=8, interval_s=0.25, min_window_s=4.0)
WARMUP_ROUND = -1


# ---------------------------------------------------------------------------- prompts
def _seed(kind: str, rnd: int, i: int) -> int:
    base = {"restore": 10_000, "store": 20_000, "decode": 30_000, "suffix": 40_000}[kind]
    return base + 100 * (rnd + 2) + i


def restore_prefix(rnd: int, i: int, shape: Shape) -> str:
    return prompt_words(_seed("restore", rnd, i), shape.prefix_tokens)


def restore_prompt(rnd: int, i: int, shape: Shape) -> str:
    """A warmed prefix and a suffix nothing holds: only the prefix can hit."""
    return restore_prefix(rnd, i, shape) + " " + prompt_words(_seed("suffix", rnd, i),
                                                              shape.suffix_tokens)


def store_prompt(rnd: int, i: int, shape: Shape) -> str:
    return prompt_words(_seed("store", rnd, i), shape.store_tokens)


def decode_prompt(rnd: int, shape: Shape) -> str:
    return prompt_words(_seed("decode", rnd, 0), shape.decode_prompt_tokens)


# ---------------------------------------------------------------------------- HTTP client
@dataclass
class StreamResult:
    """One streamed completion: arrival time of each chunk with text, usage, timing."""

    sent: float
    arrivals: list[float]
    words: list[int]  # tokens per chunk (word-level tokenizer: words in the chunk's text)
    cached_tokens: int = 0
    completion_tokens: int = 0
    done: float = 0.0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str,
                            max_tokens: int, started: asyncio.Event | None = None,
                            steady_after: int = 0) -> StreamResult:
    """POST /v1/completions with ``stream=True``; records when each chunk arrives."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    res = StreamResult(sent=time.perf_counter(), arrivals=[], words=[])
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    res.arrivals.append(now)
                    res.words.append(len(choices[0]["text"].split()))
                    if started is not None and len(res.arrivals) >= steady_after:
                        started.set()
                usage = chunk.get("usage")
                if usage:
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
    except asyncio.CancelledError:
        res.error = "cancelled"
    except (httpx.HTTPError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.done = time.perf_counter()
    if started is not None:
        started.set()
    return res


async def _complete_many(base: str, model: str, prompts: list[str], max_tokens: int,
                         parallel: int) -> list[StreamResult]:
    sem = asyncio.Semaphore(parallel)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def one(prompt: str) -> StreamResult:
            async with sem:
                return await stream_completion(client, model, prompt, max_tokens)
        return await asyncio.gather(*(one(p) for p in prompts))


def complete_many(server: OpenAIServer, prompts: list[str], max_tokens: int = 1,
                  parallel: int = 2) -> list[StreamResult]:
    results = asyncio.run(_complete_many(server.base, str(server.model_dir), prompts,
                                         max_tokens, parallel))
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"{len(bad)} warm-up requests failed: {bad[0]}")
    return results


# ---------------------------------------------------------------------------- one round
def itl_histogram(metrics_text: str) -> list[float]:
    """vLLM's inter-token latency histogram from ``/metrics``: cumulative counts per bound
    of :data:`ITL_BUCKETS_S`, then +Inf (summed over label sets)."""
    bounds = {f"{b:g}": i for i, b in enumerate(ITL_BUCKETS_S)}
    counts = [0.0] * (len(ITL_BUCKETS_S) + 1)
    for line in metrics_text.splitlines():
        if not line.startswith(ITL_METRIC):
            continue
        labels, _, value = line.rpartition(" ")
        le = labels.rsplit('le="', 1)[-1].split('"', 1)[0]
        i = len(ITL_BUCKETS_S) if le == "+Inf" else bounds.get(f"{float(le):g}")
        if i is None:
            raise ValueError(f"{ITL_METRIC}: bound {le} is not one of ITL_BUCKETS_S (was the "
                             "server started with itl_bucket_args()?)")
        counts[i] += float(value)
    return counts


def itl_bucket_args() -> list[str]:
    """Server arguments that make vLLM's ITL histogram use :data:`ITL_BUCKETS_S`."""
    return ["--custom-histogram-buckets",
            json.dumps({"inter_token_latency": list(ITL_BUCKETS_S)})]


def hist_percentile(counts: list[float], q: float) -> float:
    """Percentile ``q`` of a histogram of per-bucket counts (not cumulative; the last is
    +Inf), interpolated linearly within its bucket; nan when empty."""
    total = sum(counts)
    if total <= 0:
        return float("nan")
    rank = total * q / 100.0
    seen = 0.0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            lo = ITL_BUCKETS_S[i - 1] if i else 0.0
            hi = ITL_BUCKETS_S[i] if i < len(ITL_BUCKETS_S) else ITL_BUCKETS_S[-1]
            return lo + (hi - lo) * (rank - seen) / n
        seen += n
    return ITL_BUCKETS_S[-1]


@dataclass
class RoundResult:
    round: int
    window_s: float
    itl_window: list[float]
    itl_engine: list[float]  # per-bucket counts of vLLM's ITL histogram over the window
    itl_idle: list[float]
    decode_tokens_in_window: int
    decode_chunks_in_window: int
    restore_ttft: list[float]
    restore_cached: list[int]
    store_ttft: list[float]
    decode_streams: int  # one after another through the window (each ends at the model's length)
    errors: list[str]
    truncated: bool  # no decoding stream ran at the window's end (one failed)
    window_epoch: tuple[float, float] = (0.0, 0.0)  # the window, in epoch seconds


async def decode_until(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                       started: asyncio.Event, stop: asyncio.Event) -> list[StreamResult]:
    """The decoding stream: streamed completions one after another until ``stop``. One
    ends at the model's length (2k tokens, a few seconds here), and a round's window can
    outlast it: without the next, the window's end would have no decoding stream in it."""
    streams: list[StreamResult] = []
    while not stop.is_set():
        streams.append(await stream_completion(client, model, prompt, max_tokens,
                                               started=started, steady_after=40))
        if streams[-1].error:
            break
    return streams


async def _scrape_itl(base: str) -> list[float]:
    """vLLM's ITL histogram, on a connection of its own: a pooled one can have idled past
    the server's keep-alive (5 s) during a long window, and reusing it fails the round."""
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        return itl_histogram((await client.get("/metrics")).text)


async def _round(base: str, model: str, rnd: int, shape: Shape) -> RoundResult:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        steady, stop = asyncio.Event(), asyncio.Event()
        decode_max = shape.max_model_len - shape.decode_prompt_tokens - 1
        decoder = asyncio.create_task(decode_until(
            client, model, decode_prompt(rnd, shape), decode_max, steady, stop))
        await steady.wait()
        hist_start = await _scrape_itl(base)
        t_start, epoch_start = time.perf_counter(), time.time()
        others: list[tuple[str, asyncio.Task[StreamResult]]] = []
        plan = [("restore", i) for i in range(shape.restores)]
        plan += [("store", i) for i in range(shape.stores)]
        plan.sort(key=lambda item: (item[1], item[0] == "store"))  # r0 s0 r1 s1 ...
        for n, (kind, i) in enumerate(plan):
            delay = t_start + n * shape.interval_s / 2 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt = (restore_prompt(rnd, i, shape) if kind == "restore"
                      else store_prompt(rnd, i, shape))
            others.append((kind, asyncio.create_task(stream_completion(
                client, model, prompt, shape.other_max_tokens))))
        done = [(kind, await task) for kind, task in others]
        t_end = max(max(r.done for _, r in done), t_start + shape.min_window_s)
        if t_end > time.perf_counter():  # the decoding stream runs on to the shortest window
            await asyncio.sleep(t_end - time.perf_counter())
        epoch_end = epoch_start + (t_end - t_start)
        hist_end = await _scrape_itl(base)
        stop.set()
        decoder.cancel()
        streams = await decoder
    window = [(b - a, w) for dec in streams
              for a, b, w in zip(dec.arrivals, dec.arrivals[1:], dec.words[1:], strict=False)
              if t_start < b <= t_end]
    first = streams[0].arrivals
    idle = [b - a for a, b in zip(first, first[1:], strict=False) if b <= t_start]
    errors = [f"{kind}: {r.error}" for kind, r in done if r.error]
    errors += [f"decode: {d.error}" for d in streams if d.error not in (None, "cancelled")]
    last = streams[-1]
    return RoundResult(
        round=rnd, window_s=t_end - t_start, itl_window=[g for g, _ in window],
        itl_engine=_per_bucket(hist_start, hist_end),
        itl_idle=idle[8:],  # the first gaps of a stream are its own start-up
        decode_tokens_in_window=sum(w for _, w in window),
        decode_chunks_in_window=len(window),
        restore_ttft=[r.ttft for k, r in done if k == "restore" and r.ttft is not None],
        restore_cached=[r.cached_tokens for k, r in done if k == "restore"],
        store_ttft=[r.ttft for k, r in done if k == "store" and r.ttft is not None],
        decode_streams=len(streams),
        errors=errors, truncated=last.error != "cancelled" and last.done < t_end,
        window_epoch=(epoch_start, epoch_end))


def _per_bucket(start: list[float], end: list[float]) -> list[float]:
    """Per-bucket counts of what a cumulative histogram gained between two scrapes."""
    gained = [b - a for a, b in zip(start, end, strict=True)]
    return [c - p for p, c in zip([0.0, *gained[:-1]], gained, strict=True)]


def run_round(server: OpenAIServer, rnd: int, shape: Shape) -> RoundResult:
    return asyncio.run(_round(server.base, str(server.model_dir), rnd, shape))


# ---------------------------------------------------------------------------- configs
class Proxy:
    """``TcpProxy`` in its own process (its threads must not share the client's GIL)."""

    CODE = ("import sys, time; from rigs.tcp_proxy import TcpProxy; "
            "p = TcpProxy('127.0.0.1', int(sys.argv[1]), port=int(sys.argv[2])); "
            "p.latency_s = float(sys.argv[3]); p.start(); print('ready', flush=True); "
            "time.sleep(1e9)")

    def __init__(self, redis_url: str, rtt_s: float, nice: int = 0) -> None:
        target = httpx.URL(redis_url.replace("redis://", "http://"))
        self.port = free_port()
        self.proc = subprocess.Popen(
            [*(["nice", "-n", str(nice)] if nice else []), sys.executable, "-c", self.CODE,
             str(target.port or 6379), str(self.port), str(rtt_s / 2)], cwd=REPO_ROOT,
            stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("latency proxy did not start")
        db = redis_url.rstrip("/").rsplit("/", 1)[-1] if redis_url.count("/") > 2 else "0"
        self.url = f"redis://127.0.0.1:{self.port}/{db}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


#: The roles a round's CPU time is split into (JSON ``cpu_cores_by_role``), in table order.
CPU_ROLES = ("engine core", "worker main", "worker compute", "kvtier threads", "api server",
             "other servers", "proxy", "redis-server", "client", "rest of the machine")


def _role(process: str, thread: str, pid: int, measured: set[int], others: set[int],
          proxy: set[int]) -> str:
    """Which part of the machine one thread's run time belongs to. A measured server's
    threads by their process (vLLM names them ``VLLM::EngineCore``, ``VLLM::Worker``) and
    name (kvtier names its own threads ``kvtier-*``: ``offload_tiers/thread_names.py``)."""
    if pid in measured:
        if thread.startswith("kvtier"):
            return "kvtier threads"
        if "EngineCor" in process:
            return "engine core"
        if "Worker" in process:
            return "worker main" if "(main)" in thread else "worker compute"
        return "api server"
    if pid in others:
        return "other servers"
    if pid in proxy:
        return "proxy"
    if process == "redis-server":
        return "redis-server"
    if pid == os.getpid():
        return "client"
    return "rest of the machine"


STEPS_METRIC = "vllm:iteration_tokens_total_count"


def engine_steps(server: OpenAIServer) -> float:
    """The engine steps the server has reported (vLLM observes its tokens-per-step
    histogram once per step that produced outputs)."""
    return sum(float(line.rpartition(" ")[2]) for line in server.metrics_text().splitlines()
               if line.startswith(STEPS_METRIC))


class CpuLedger:
    """The machine's CPU time by role over one round (``/proc``, every thread): what the
    measured server's engine core, worker and kvtier threads ran, and what the rest of the
    machine (the idle servers, the proxy, ``redis-server``, this client) took meanwhile;
    with the round's wall time and the measured server's engine steps."""

    def __init__(self, servers: dict[str, OpenAIServer], proxy: Proxy | None) -> None:
        self.servers = servers
        self.trees = {name: set(process_tree(s.proc.pid)) for name, s in servers.items()
                      if s.proc is not None}
        self.proxy = {proxy.proc.pid} if proxy is not None else set()
        self._before: dict[int, tuple[str, str, float]] = {}
        self._pids: dict[int, int] = {}
        self._t0 = 0.0
        self._steps0 = 0.0

    def _read(self) -> dict[int, tuple[str, str, float]]:
        readings: dict[int, tuple[str, str, float]] = {}
        for pid in all_processes():
            for tid, reading in thread_times([pid]).items():
                readings[tid] = reading
                self._pids[tid] = pid
        return readings

    def start(self, measured: str) -> None:
        self._steps0 = engine_steps(self.servers[measured]) if measured in self.servers else 0
        self._before = self._read()
        self._t0 = time.monotonic()

    def stop(self, measured: str) -> dict[str, Any]:
        """``{"cpu_s": {role: seconds}, "wall_s": ..., "steps": ...}`` since :meth:`start`."""
        wall_s = time.monotonic() - self._t0
        after = self._read()
        steps = (engine_steps(self.servers[measured]) - self._steps0
                 if measured in self.servers else 0.0)
        mine = self.trees.get(measured, set())
        others = set().union(*(t for n, t in self.trees.items() if n != measured))
        cpu = dict.fromkeys(CPU_ROLES, 0.0)
        for tid, (process, thread, ran) in after.items():
            pid = self._pids[tid]
            role = _role(process, thread.rsplit(" @", 1)[0], pid, mine, others, self.proxy)
            cpu[role] += ran - (self._before[tid][2] if tid in self._before else 0.0)
        return {"cpu_s": cpu, "wall_s": wall_s, "steps": steps}


def server_env(reserved_cpus: int | None) -> dict[str, str | None]:
    """The same OpenMP binding for every config.

    vLLM's CPU worker binds its OpenMP threads to every allowed core but
    ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default: one per rank for the engine core, plus one
    more per rank whenever a ``kv_transfer_config`` is set, meant for NIXL). On a 2-core
    machine that default gives vLLM alone 1 OpenMP thread and any connector 2 (the
    reservation exceeds the cores and is dropped), threads that then fight the engine core
    and API server for the same 2 cores: connector runs decode ~3x slower with no connector
    code involved. Pinning the reservation measures the connectors, not the binding.
    Also a 256 MiB KV cache (``SMALL_KV_ENV`` + ``--kv-cache-memory-bytes``), so three
    servers fit beside other work.
    """
    env = dict(SMALL_KV_ENV)
    if reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    return env


def _server(model_dir: Path, log_dir: Path, name: str, shape: Shape,
            ktc: dict[str, Any] | None, env: dict[str, str | None]) -> OpenAIServer:
    wait_for_memory()
    say(f"{name}: starting server", tag="stall")
    t0 = time.monotonic()
    server = OpenAIServer(model_dir, log_dir / f"{name}.log", kv_transfer_config=ktc,
                          max_model_len=shape.max_model_len, max_num_seqs=shape.max_num_seqs,
                          extra_args=["--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                                      *_budget_args(shape), *itl_bucket_args()],
                          env=env).start(timeout_s=600)
    say(f"{name}: healthy after {time.monotonic() - t0:.0f} s (port {server.port})", tag="stall")
    return server


def _budget_args(shape: Shape) -> list[str]:
    """``--max-num-batched-tokens`` for the shape's budget (none for 0: vLLM's default)."""
    budget = shape.max_num_batched_tokens
    return ["--max-num-batched-tokens", str(budget)] if budget else []


def _reset(server: OpenAIServer) -> None:
    for _ in range(100):
        if server.post("/reset_prefix_cache").get("success") is not False:
            return
        time.sleep(0.1)
    raise RuntimeError("reset_prefix_cache kept failing")


def _warm_prompts(shape: Shape) -> list[str]:
    return [restore_prefix(rnd, i, shape) for rnd in [WARMUP_ROUND, *range(shape.rounds)]
            for i in range(shape.restores)]


def _redis_keys(url: str, prefix: str) -> int:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5.0)
    try:
        start = len(prefix) + 1
        return sum(1 for n in client.scan_iter(match=f"{prefix}:*", count=1000)
                   if not is_announce_stream(n[start:]))
    finally:
        client.close()


def _wait_for_redis(url: str, prefix: str, expect: int, timeout_s: float = 120) -> int:
    """Until Redis holds ``expect`` keys under ``prefix`` and the count stops moving."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        n = _redis_keys(url, prefix)
        if n >= expect and n == last:
            return n
        last = n
        time.sleep(0.5)
    return last


def _native_config() -> dict[str, Any]:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": dict(NATIVE_EXTRA)}


def _warm_kvtier_redis(model_dir: Path, log_dir: Path, shape: Shape,
                       env: dict[str, str | None],
                       settings: dict[str, Any], redis_url: str) -> int:
    """One kvtier server stores every prefix in Redis (straight, no proxy: the namespace
    does not depend on the URL), then stops; returns the keys Redis holds."""
    warm = _warm_prompts(shape)
    first = _server(model_dir, log_dir, "kvtier-warm", shape,
                    kvtier_transfer_config({**settings, "redis_url": redis_url}), env)
    try:
        say(f"kvtier: warming {len(warm)} prefixes of {shape.prefix_tokens} tokens", tag="stall")
        complete_many(first, warm)
        expect = len(warm) * (shape.prefix_tokens // BLOCK)
        held = _wait_for_redis(redis_url, settings["redis_prefix"], expect)
        say(f"kvtier: Redis holds {held} keys (>= {expect} expected); stopping that server",
            tag="stall")
        return held
    finally:
        first.stop()


def _timed(ktc: dict[str, Any], config: str, log_dir: Path, env: dict[str, str | None]
           ) -> tuple[dict[str, Any], dict[str, str | None]]:
    """The connector of ``ktc`` with every hook timed and each call recorded under
    ``log_dir/hooks-<config>`` (``benchmarks/hook_steps.py``)."""
    times = log_dir / f"hooks-{config}"
    times.mkdir(parents=True, exist_ok=True)
    timed = {**ktc, "kv_connector_module_path": "benchmarks.peers.timed_connector",
             "kv_connector": ("TimedNativeConnector" if base_config(config) == "native"
                              else "TimedTieredConnector")}
    return timed, {**env, "KVTIER_HOOK_TIMES_DIR": str(times), "KVTIER_HOOK_CALLS": "1"}


def run_all(configs: list[str], model_dir: Path, shape: Shape, log_dir: Path,
            redis_url: str, rtt_s: float, env: dict[str, str | None], gap_s: float,
            kvtier_extra: dict[str, Any] | None = None,
            hook_calls: bool = False, stand_ins_nice: int = 0) -> dict[str, dict[str, Any]]:
    """Every config's server up at once; the configs take turns, round by round.

    Round ``r`` of every config runs the same prompts within seconds of the others' round
    ``r`` (order rotated per round), so load from elsewhere on the machine falls on all of
    them alike. ``gap_s`` before each round lets the server that just ran stop spinning.
    ``hook_calls``: the connectors run timed (``benchmarks/peers/timed_connector.py``) and
    each config's steps in its windows are summarized (``hook_steps``).
    """
    runs: dict[str, dict[str, Any]] = {c: {"rounds": [], "load_before": load_1m()}
                                       for c in configs}
    servers: dict[str, OpenAIServer] = {}
    proxy: Proxy | None = None
    prefix = f"kvtier-stall-{uuid.uuid4().hex[:10]}"
    settings = {"cpu_bytes": CPU_BYTES, "redis_prefix": prefix, "redis_timeout_s": 5.0,
                **(kvtier_extra or {})}
    daemon_settings = {**settings, "redis_prefix": f"{prefix}-d"}
    local_settings = {**settings, "redis_prefix": f"{prefix}-l"}
    daemon: DemoHostTier | None = None
    try:
        if any(c.startswith("kvtier") for c in configs):
            proxy = Proxy(redis_url, rtt_s, stand_ins_nice) if rtt_s > 0 else None
        for config, s in (("kvtier", settings), ("kvtier-daemon", daemon_settings)):
            if config in configs:
                runs[config]["redis_keys_after_warm"] = _warm_kvtier_redis(
                    model_dir, log_dir, shape, env, s, redis_url)
        for config in configs:
            ktc = {"none": None, "native": _native_config()}.get(base_config(config))
            if config == "kvtier":
                say("kvtier: a new server process; " + (
                    f"Redis behind the proxy (+{rtt_s * 1e3:.1f} ms per round trip)"
                    if proxy is not None else "Redis direct (--rtt-ms 0: no proxy)"), tag="stall")
                ktc = kvtier_transfer_config(
                    {**settings, "redis_url": proxy.url if proxy is not None else redis_url})
            if config == "kvtier-local":
                say("kvtier-local: Redis behind the proxy as for kvtier; its prefixes warmed "
                    "in this server, then POST /reset_prefix_cache", tag="stall")
                ktc = kvtier_transfer_config(
                    {**local_settings, "redis_url": proxy.url if proxy is not None else redis_url})
            if config == "kvtier-daemon":
                daemon = _start_daemon(daemon_settings["redis_prefix"],
                                       proxy.url if proxy is not None else redis_url)
                say(f"kvtier-daemon: a new server process; Redis through the host-tier "
                    f"daemon (pid {daemon.pid})", tag="stall")
                ktc = kvtier_transfer_config(
                    {k: v for k, v in daemon_settings.items()
                     if k not in ("redis_prefix", "redis_timeout_s")}
                    | {"host_tier_socket": daemon.socket, "host_tier_redis": True})
            config_env = env
            if hook_calls and ktc is not None:
                ktc, config_env = _timed(ktc, config, log_dir, env)
            servers[config] = _server(model_dir, log_dir, config, shape, ktc, config_env)
            if warms_in_place(config):
                warm = _warm_prompts(shape)
                say(f"{config}: warming {len(warm)} prefixes, then POST /reset_prefix_cache",
                    tag="stall")
                complete_many(servers[config], warm)
                time.sleep(1.0)  # native: let the last stores finish before the reset
                _reset(servers[config])
        before = {c: servers[c].metrics() for c in configs}
        ledger = CpuLedger(servers, proxy)
        for rnd in [WARMUP_ROUND, *range(shape.rounds)]:
            k = rnd % len(configs) if rnd >= 0 else 0
            for config in configs[k:] + configs[:k]:
                time.sleep(gap_s)
                load = load_1m()
                ledger.start(config)
                res = run_round(servers[config], rnd, shape)
                cpu = ledger.stop(config)
                if rnd == WARMUP_ROUND:
                    continue
                runs[config]["rounds"].append({**asdict(res), "load_before": load,
                                               "cpu": cpu})
            if rnd >= 0:
                say(f"round {rnd + 1}/{shape.rounds}: " + "; ".join(
                    f"{c} ITL p50/p99 {hist_percentile(r['itl_engine'], 50) * 1e3:.1f}/"
                    f"{hist_percentile(r['itl_engine'], 99) * 1e3:.1f} ms, restore TTFT "
                    f"{_pct(r['restore_ttft'], 50) * 1e3:.0f} ms"
                    + (f" ERRORS {r['errors'][:2]}" if r["errors"] else "")
                    for c in configs for r in [runs[c]["rounds"][-1]])
                    + f" (load {load_1m():.1f})", tag="stall")
        for config in configs:
            after = servers[config].metrics()
            runs[config]["kvtier_counters"] = {
                k: after[k] - before[config].get(k, 0.0) for k in after
                if after[k] - before[config].get(k, 0.0)}
            runs[config]["load_after"] = load_1m()
            if hook_calls and base_config(config) != "none":
                runs[config]["hook_steps"] = hook_steps.summarize(
                    log_dir / f"hooks-{config}",
                    [tuple(r["window_epoch"]) for r in runs[config]["rounds"]])
    finally:
        for server in servers.values():
            server.stop()
        if daemon is not None:
            daemon.stop()
        if proxy is not None:
            proxy.stop()
            delete_redis_prefix(redis_url, prefix)
            delete_redis_prefix(redis_url, daemon_settings["redis_prefix"])
            delete_redis_prefix(redis_url, local_settings["redis_prefix"])
    return runs


_DAEMON_REDIS_ENV = "KVTIER_STALL_DAEMON_REDIS_URL"


def _start_daemon(redis_prefix: str, redis_url: str) -> DemoHostTier:
    """A new host-tier daemon (empty host tier) that reaches Redis at ``redis_url``."""
    return DemoHostTier(f"stall-{uuid.uuid4().hex[:8]}", CPU_BYTES, HOST_SLOT_BYTES,
                        redis_url_env=_DAEMON_REDIS_ENV, redis_prefix=redis_prefix,
                        secrets={_DAEMON_REDIS_ENV: redis_url}).start()


# ---------------------------------------------------------------------------- summary
def _pct(values: list[float], q: float) -> float:
    """Percentile by linear interpolation (numpy's default); nan for no values."""
    if not values:
        return float("nan")
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(run: dict[str, Any], shape: Shape) -> dict[str, Any]:
    rounds = run["rounds"]

    def pool(key: str) -> list[Any]:
        return [v for r in rounds for v in r[key]]

    itl, idle = pool("itl_window"), pool("itl_idle")
    restore, store, cached = pool("restore_ttft"), pool("store_ttft"), pool("restore_cached")
    engine = [sum(c) for c in zip(*(r["itl_engine"] for r in rounds), strict=True)]
    return {
        "itl_p50_ms": 1e3 * hist_percentile(engine, 50),
        "itl_p99_ms": 1e3 * hist_percentile(engine, 99),
        "itl_samples": sum(engine),
        "itl_p99_ms_per_round": [1e3 * hist_percentile(r["itl_engine"], 99) for r in rounds],
        "itl_p50_ms_per_round": [1e3 * hist_percentile(r["itl_engine"], 50) for r in rounds],
        "store_ttft_p50_ms_per_round": [1e3 * _pct(r["store_ttft"], 50) for r in rounds],
        "restore_ttft_p50_ms_per_round": [1e3 * _pct(r["restore_ttft"], 50) for r in rounds],
        "client_itl_p50_ms": 1e3 * _pct(itl, 50), "client_itl_p99_ms": 1e3 * _pct(itl, 99),
        "client_itl_max_ms": 1e3 * max(itl, default=float("nan")),
        "client_itl_samples": len(itl),
        "client_idle_itl_p50_ms": 1e3 * _pct(idle, 50),
        "client_itl_p50_vs_own_idle": (_pct(itl, 50) / _pct(idle, 50) if idle
                                       else float("nan")),
        "tokens_per_chunk": (sum(r["decode_tokens_in_window"] for r in rounds)
                             / max(1, sum(r["decode_chunks_in_window"] for r in rounds))),
        "restore_ttft_p50_ms": 1e3 * _pct(restore, 50),
        "restore_ttft_p90_ms": 1e3 * _pct(restore, 90),
        "store_ttft_p50_ms": 1e3 * _pct(store, 50),
        "restore_cached_tokens": sum(cached),
        "restore_prefix_tokens": shape.prefix_tokens * len(cached),
        "window_s_mean": statistics.mean(r["window_s"] for r in rounds),
        "errors": [e for r in rounds for e in r["errors"]],
        "truncated_rounds": sum(r["truncated"] for r in rounds),
        "load": [run["load_before"], run["load_after"]],
        # The rounds' CPU by role: cores busy per second of round (from its decoding
        # stream's start to its last request done), and milliseconds per engine step
        "cpu_cores_by_role": {role: sum(r["cpu"]["cpu_s"][role] for r in rounds)
                              / max(1e-9, sum(r["cpu"]["wall_s"] for r in rounds))
                              for role in CPU_ROLES},
        "cpu_ms_per_step_by_role": {role: 1e3 * sum(r["cpu"]["cpu_s"][role] for r in rounds)
                                    / max(1.0, sum(r["cpu"]["steps"] for r in rounds))
                                    for role in CPU_ROLES},
        "engine_steps": sum(r["cpu"]["steps"] for r in rounds),
        "hook_steps": run.get("hook_steps"),
    }


RATIO_KEYS = (("itl_p99_vs_no_connector", "itl_p99_ms"),
              ("itl_p50_vs_no_connector", "itl_p50_ms"),
              ("client_itl_p99_vs_no_connector", "client_itl_p99_ms"),
              ("client_itl_p50_vs_no_connector", "client_itl_p50_ms"),
              ("restore_ttft_p50_vs_no_connector", "restore_ttft_p50_ms"),
              ("store_ttft_p50_vs_no_connector", "store_ttft_p50_ms"))


def ratios_for(summary: dict[str, dict[str, Any]], config: str) -> dict[str, float | None]:
    ref = summary.get("none")
    mine = summary.get(config)
    out: dict[str, float | None] = {}
    for name, key in RATIO_KEYS:
        ok = ref is not None and mine is not None and ref[key] and ref[key] == ref[key]
        out[name] = mine[key] / ref[key] if ok else None
    return out


#: Ratios also taken round by round (name, per-round summary key).
ROUND_RATIO_KEYS = (("itl_p99_vs_no_connector", "itl_p99_ms_per_round"),
                    ("itl_p50_vs_no_connector", "itl_p50_ms_per_round"),
                    ("store_ttft_p50_vs_no_connector", "store_ttft_p50_ms_per_round"),
                    ("restore_ttft_p50_vs_no_connector", "restore_ttft_p50_ms_per_round"))


def round_ratios(summary: dict[str, dict[str, Any]], config: str,
                 against: str = "none") -> dict[str, dict[str, Any]]:
    """Each round's figure over ``against``'s in the same round (run within seconds of it):
    per round, their median and range. The spread says how much one pooled ratio of this
    run can be trusted. Keys keep the ``_vs_no_connector`` names whatever ``against`` is."""
    ref, mine = summary.get(against), summary.get(config)
    out: dict[str, dict[str, Any]] = {}
    if ref is None or mine is None:
        return out
    for name, key in ROUND_RATIO_KEYS:
        if key not in mine or key not in ref:  # a summary without it (built by hand)
            continue
        per = [m / r for m, r in zip(mine[key], ref[key], strict=True) if r and r == r]
        if per:
            out[name] = {"per_round": per, "median": statistics.median(per),
                         "min": min(per), "max": max(per)}
    return out


#: What issue #50 asks of kvtier's decode ITL p99, pooled and as the median of rounds:
#: (name, config compared with, bound).
ITL_AIMS = (("itl_p99_vs_native", "native", 1.0), ("itl_p99_vs_no_connector", "none", 1.2))


def itl_aims(summary: dict[str, dict[str, Any]], config: str = "kvtier") -> dict[str, Any]:
    """``config``'s ITL p99 against each aim, pooled and as the median of per-round ratios,
    and whether the run can judge it at all (every config ran every round without an
    error and with a decoding stream to its end)."""
    mine = summary.get(config)
    valid = all(not s["errors"] and not s["truncated_rounds"] for s in summary.values())
    out: dict[str, Any] = {"valid": valid}
    if mine is None:
        return out
    for name, ref, bound in ITL_AIMS:
        if ref not in summary:
            continue
        pooled = mine["itl_p99_ms"] / summary[ref]["itl_p99_ms"]
        median = round_ratios(summary, config, ref)["itl_p99_vs_no_connector"]["median"]
        out[name] = {"pooled": pooled, "median_of_rounds": median, "bound": bound,
                     "met": valid and pooled <= bound and median <= bound,
                     "paired": paired_ratio(mine["itl_p99_ms_per_round"],
                                            summary[ref]["itl_p99_ms_per_round"]),
                     "p50_paired": paired_ratio(mine.get("itl_p50_ms_per_round", []),
                                                summary[ref].get("itl_p50_ms_per_round", []))}
    return out


def aa_controls(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each A/A control's ITL p99 over the config it repeats, pooled and round by round:
    two identical servers, so any distance from 1 is the benchmark's own noise, the yardstick
    for reading kvtier over native's."""
    out: dict[str, dict[str, Any]] = {}
    for config in summary:
        base = base_config(config)
        if base == config or base not in summary:
            continue
        rr = round_ratios(summary, config, base)["itl_p99_vs_no_connector"]
        out[config] = {"against": base,
                       "pooled": summary[config]["itl_p99_ms"] / summary[base]["itl_p99_ms"],
                       "median_of_rounds": rr["median"], "per_round": rr["per_round"],
                       "min": rr["min"], "max": rr["max"],
                       "paired": paired_ratio(summary[config]["itl_p99_ms_per_round"],
                                              summary[base]["itl_p99_ms_per_round"]),
                       "p50_paired": paired_ratio(
                           summary[config].get("itl_p50_ms_per_round", []),
                           summary[base].get("itl_p50_ms_per_round", []))}
    return out


def engine_step_ratios(summary: dict[str, dict[str, Any]], config: str,
                       against: str = "native") -> dict[str, dict[str, float]]:
    """``config``'s engine steps over ``against``'s, kind by kind (``hook_steps``: steps
    compared at the same scheduled work): p50 and p99 ratios, and each side's step count."""
    mine = (summary.get(config) or {}).get("hook_steps") or {}
    ref = (summary.get(against) or {}).get("hook_steps") or {}
    out: dict[str, dict[str, float]] = {}
    for kind, m in mine.get("engine_steps", {}).items():
        r = ref.get("engine_steps", {}).get(kind)
        if r and r["p50"] and r["p99"]:
            out[kind] = {"p50": m["p50"] / r["p50"], "p99": m["p99"] / r["p99"],
                         "steps": m["steps"], f"{against}_steps": r["steps"]}
    return out


def _paired_text(p: dict[str, Any]) -> str:
    """A paired ratio as printed: geometric mean [95 % interval] (rounds)."""
    lo, hi = p["ci95"]
    if p["geo_mean"] is None:
        return "n/a"
    ci = f" [{lo:.2f}-{hi:.2f}]" if lo is not None else ""
    return f"{p['geo_mean']:.2f}{ci} ({p['rounds']} rounds)"


def render(summary: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]]) -> str:
    cols = [("ITL p50", "itl_p50_ms", "{:.1f}"), ("ITL p99", "itl_p99_ms", "{:.1f}"),
            ("client ITL p50", "client_itl_p50_ms", "{:.1f}"),
            ("client ITL p99", "client_itl_p99_ms", "{:.1f}"),
            ("client idle p50", "client_idle_itl_p50_ms", "{:.1f}"),
            ("restore TTFT p50", "restore_ttft_p50_ms", "{:.0f}"),
            ("restore TTFT p90", "restore_ttft_p90_ms", "{:.0f}"),
            ("store TTFT p50", "store_ttft_p50_ms", "{:.0f}")]
    head = (f"{'config':<13} " + " ".join(f"{c[0]:>16}" for c in cols)
            + f" {'cached/prefix':>15} {'p99 ×none':>10} {'p50 ×none':>10} {'load':>10}")
    lines = [head, "-" * len(head)]
    for config, s in summary.items():
        r = ratios.get(config, {})
        p99, p50 = r.get("itl_p99_vs_no_connector"), r.get("itl_p50_vs_no_connector")
        lines.append(
            f"{config:<13} " + " ".join(f"{c[2].format(s[c[1]]):>16}" for c in cols)
            + f" {s['restore_cached_tokens']:>7}/{s['restore_prefix_tokens']:<7}"
            + f" {p99 if p99 is not None else 1.0:>10.2f} {p50 if p50 is not None else 1.0:>10.2f}"
            + f" {s['load'][0]:>4.1f}/{s['load'][1]:<4.1f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload (~4 min)")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH")
    parser.add_argument("--json-runs", action="store_true",
                        help="also write every request's token arrival times to the JSON")
    parser.add_argument("--redis-url", default=os.environ.get("KVTIER_REDIS_URL"),
                        help="a Redis to use (default: a private redis-server on a loopback "
                             "port, started at --stand-ins-nice and stopped at the end)")
    parser.add_argument("--stand-ins-nice", type=int, default=STAND_INS_NICE,
                        help="niceness of the latency proxy and the private redis-server, "
                             f"which stand in for a network and a Redis host (default "
                             f"{STAND_INS_NICE}; 0: as the engines)")
    parser.add_argument("--rtt-ms", type=float, default=4.0,
                        help="latency the proxy adds per Redis round trip (default 4; 0: no proxy, "
                             "kvtier reads Redis directly)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=None, help="override the shape's rounds")
    parser.add_argument("--reserved-cpus", default="1",
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server (default 1; "
                             "'vllm': vLLM's own default, which differs with a connector)")
    parser.add_argument("--gap-s", type=float, default=1.5,
                        help="pause before each round (the server that ran stops spinning)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="vLLM's token budget per step (default: the shape's, 256; 0: "
                             "vLLM's own, which prefills a 1024-token prompt in one step)")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--hook-calls", action="store_true",
                        help="run the connectors with every hook timed and report where each "
                             "config's worker steps spent their time (benchmarks/hook_steps.py)")
    parser.add_argument("--kvtier-extra", default="{}", metavar="JSON",
                        help="more kvtier settings, e.g. '{\"async_saves\": false}'")
    args = parser.parse_args(argv)
    env = server_env(None if args.reserved_cpus == "vllm" else int(args.reserved_cpus))

    shape = QUICK if args.quick else FULL
    if args.rounds:
        shape = Shape(**{**asdict(shape), "rounds": args.rounds})
    if args.max_num_batched_tokens is not None:
        shape = Shape(**{**asdict(shape), "max_num_batched_tokens": args.max_num_batched_tokens})
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in CONFIGS + OPTIONAL_CONFIGS:
            parser.error(f"unknown config {c!r}: expected some of "
                         f"{', '.join(CONFIGS + OPTIONAL_CONFIGS)}")
    log_dir = Path(args.log_dir or f"/tmp/kvtier-bench-stall-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_llama()
    t0 = time.monotonic()
    kvtier_extra = json.loads(args.kvtier_extra)
    if not isinstance(kvtier_extra, dict):
        parser.error("--kvtier-extra: a JSON object of kvtier settings")
    private = None
    if args.redis_url is None:
        private = RedisServer(log_dir / "redis", nice=args.stand_ins_nice).start()
    try:
        runs = run_all(configs, model_dir, shape, log_dir,
                       args.redis_url or private.url, args.rtt_ms / 1e3, env, args.gap_s,
                       kvtier_extra, hook_calls=args.hook_calls,
                       stand_ins_nice=args.stand_ins_nice)
    finally:
        if private is not None:
            private.stop()
    summary = {c: summarize(r, shape) for c, r in runs.items()}
    per = {c: ratios_for(summary, c) for c in summary if c != "none"}
    ratios: dict[str, Any] = dict(per.get("kvtier", {}))
    for name, value in per.get("native", {}).items():
        ratios[f"native_{name}"] = value
    by_round = {c: round_ratios(summary, c) for c in summary if c != "none"}
    aims = itl_aims(summary)
    aims_daemon = itl_aims(summary, "kvtier-daemon") if "kvtier-daemon" in summary else None
    aims_local = itl_aims(summary, "kvtier-local") if "kvtier-local" in summary else None
    controls = aa_controls(summary)

    budget = shape.max_num_batched_tokens or "vLLM's default"
    print(f"\nbench_stall — vLLM 0.32 CPU OpenAI server, tiny Llama, token budget {budget} "
          f"per step; {shape.rounds} rounds x "
          f"({shape.restores} restores of a {shape.prefix_tokens}-token prefix + "
          f"{shape.suffix_tokens} new, {shape.stores} stores of {shape.store_tokens} tokens, "
          f"one every {shape.interval_s / 2:.3f} s) beside one decoding stream; kvtier's "
          f"Redis +{args.rtt_ms:g} ms per round trip")
    print(render(summary, per))
    for config, s in summary.items():
        if s["errors"] or s["truncated_rounds"]:
            print(f"  {config}: errors {s['errors'][:3]}, truncated rounds "
                  f"{s['truncated_rounds']}")
    for config in (c for c in ("kvtier", "kvtier-daemon", "kvtier-local") if c in runs):
        c = runs[config]["kvtier_counters"]
        print(f"{config} counters over the measured rounds: " + ", ".join(
            f"{k.removeprefix('vllm:kvtier_')}={v:g}" for k, v in sorted(c.items())
            if any(w in k for w in ("hit_tokens", "written_redis", "drops", "errors",
                                    "failed", "blocks_saved", "misses", "probe_waits",
                                    "presence_known_absent", "presence_not_ready"))))
    print("CPU by role over the rounds: cores busy per second of round | ms per engine step")
    print(f"  {'role':<20}" + "".join(f"{c:>17}" for c in summary))
    for role in CPU_ROLES:
        print(f"  {role:<20}" + "".join(
            f"{s['cpu_cores_by_role'][role]:>8.2f} |{s['cpu_ms_per_step_by_role'][role]:>6.2f}"
            for s in summary.values()))
    print(f"  {'engine steps':<20}" + "".join(f"{s['engine_steps']:>17.0f}"
                                              for s in summary.values()))
    steps = {c: s["hook_steps"] for c, s in summary.items() if s["hook_steps"]}
    if steps:
        print("worker steps in the windows (timed hooks): pre / forward / post, and the "
              "forward's time off the CPU")
        print("\n".join(hook_steps.render(steps)))
        for config in (c for c in ("kvtier", "kvtier-daemon") if c in steps):
            for kind, r in engine_step_ratios(summary, config).items():
                print(f"  {config} engine step, {kind}, over native's: p50 {r['p50']:.2f}, "
                      f"p99 {r['p99']:.2f} ({r['steps']:.0f} and {r['native_steps']:.0f} "
                      "steps)")
    print("ratios (kvtier; native_*: native)")
    for key, value in ratios.items():
        print(f"  {key:<42} {value:.3f}" if value is not None else f"  {key:<42} n/a")
    print("round by round (each round over vLLM alone's same round): median [min-max]")
    for config, rr in by_round.items():
        for key, r in rr.items():
            print(f"  {config:<13} {key:<34} {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]")
    for config, judged in (("kvtier", aims), ("kvtier-daemon", aims_daemon),
                           ("kvtier-local", aims_local)):
        if judged is None:
            continue
        print(f"{config}'s ITL p99 against its aims (pooled; median of rounds; bound):"
              + ("" if judged["valid"] else
                 " NOT JUDGED: a config had errors or truncated rounds"))
        for name, a in judged.items():
            if name != "valid":
                print(f"  {name:<26} {a['pooled']:.2f}; {a['median_of_rounds']:.2f}; "
                      f"<= {a['bound']:g}: {'met' if a['met'] else 'not met'}; "
                      f"paired over rounds {_paired_text(a['paired'])}; its ITL p50, paired "
                      f"{_paired_text(a['p50_paired'])}")
    if controls:
        print("A/A controls: a second identical server's ITL p99 over the first's "
              "(pooled; median of rounds [min-max])")
    for config, a in controls.items():
        print(f"  {config:<13} over {a['against']:<8} {a['pooled']:.2f}; "
              f"{a['median_of_rounds']:.2f} [{a['min']:.2f}-{a['max']:.2f}]; paired over "
              f"rounds {_paired_text(a['paired'])}; ITL p50 paired "
              f"{_paired_text(a['p50_paired'])}")
    print(f"total {time.monotonic() - t0:.0f} s; server logs in {log_dir}")
    if args.json_path:
        out = {"ratios": ratios, "itl_aims": aims,
               **({"itl_aims_daemon": aims_daemon} if aims_daemon is not None else {}),
               **({"itl_aims_local": aims_local} if aims_local is not None else {}),
               **({"aa_controls": controls} if controls else {}),
               "connectors": {c: {"ratios": per.get(c), "round_ratios": by_round.get(c),
                                  "summary": summary[c]} for c in summary},
               "shape": asdict(shape), "rtt_ms": args.rtt_ms, "server_env": env,
               "redis": "private" if private is not None else "given",
               "stand_ins_nice": args.stand_ins_nice,
               "kvtier_extra": kvtier_extra,
               "elapsed_s": time.monotonic() - t0}
        if "kvtier" in runs:  # what the connector counted over the measured rounds
            out["kvtier_counters"] = runs["kvtier"]["kvtier_counters"]
        if steps:
            out["engine_step_ratios"] = {c: engine_step_ratios(summary, c) for c in steps
                                         if c.startswith("kvtier")}
        if "kvtier-daemon" in runs:
            out["kvtier_daemon_counters"] = runs["kvtier-daemon"]["kvtier_counters"]
        if "kvtier-local" in runs:
            out["kvtier_local_counters"] = runs["kvtier-local"]["kvtier_counters"]
        if args.json_runs:  # every token's arrival time: large
            out["runs"] = runs
        write_result(args.json_path, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

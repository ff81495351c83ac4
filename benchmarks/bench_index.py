"""The daemon as a routing index: ingest rate, /score latency, side by side with Dynamo's indexer.

    python -m benchmarks.bench_index [--quick] [--json PATH] [--engines 8,64] [--blocks N]
                                     [--peer-venv DIR | --no-peer]
                                     [--no-agreement | --agreement-only] [--re-record]

Four measurements, each printed and written to JSON (``ratios`` and ``agreement`` included).
Every block hash is a 64-bit value spread as vLLM's are (:func:`vllm_hash`), never a run of
consecutive integers (a Python dict would keep those in neighbouring slots):

1. **ingest** (one process): the same full-attention event stream (stores of 16-64 hashes
   chained on live requests, removals of old ones; block size 16) applied by kvtier's ingest
   (vLLM's msgpack payloads: decode + classify + index) and, when it runs here, by Dynamo's
   ``RadixTree.apply_event`` (its JSON events, encoded before the clock starts). Hash updates
   per second of wall time and per CPU-second (``per core``: Dynamo's tree works on a thread
   of its own, so its CPU time can exceed its wall time). Best of several repetitions.
2. **query** (in process): requests against a 1M-block index (``--blocks``): the synthetic
   workload (4k-token requests, 256 hashes; chains of 256 blocks, each whole on one engine,
   its first half on the next) at each ``--engines`` count (default 8 and 64), and the
   trace-shaped one (:func:`trace_stream`: 64 engines, Zipf-popular long system prompts and
   documents, multi-turn conversations); kvtier's ``score_engines`` (every engine, every
   medium, ranked) and Dynamo's ``find_matches``; p50/p99 over 2,000 requests, the best of
   several rounds (as for ingest: bursts of a shared machine are not the index's).
   Full-block answers are compared per run.
3. **HTTP** (real ``kvtier daemon`` process): ``POST /score`` (256 hashes) on one keep-alive
   connection, closed loop, while another process publishes events over ZMQ at
   ``--rate`` hash updates/s; requests/s, p50/p99, and the ingest rate the daemon reached.
4. **agreement** (:mod:`index_agreement`): real vLLM event streams (tiny Llama; tiny hybrid
   with PARTIAL entries), recorded once under ``.kvtier/index-agreement/`` (two small
   in-process CPU engines, one at a time; ``--re-record`` to record again), fed to both
   indexes; per request kvtier's and Dynamo's answer against vLLM's ``num_cached_tokens``.

The peer (``ai-dynamo-runtime``, PyPI) lives in its own venv (default
``.kvtier/venv-bench-dynamo``, git-ignored), installed on first use with a time limit; it is
never a dependency of kvtier. Where it cannot install or run, the output and the JSON say
why (the pip error). The peer side runs this file under the peer's Python with
``--peer-worker``: that path uses the standard library and ``dynamo`` only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import write_result

ROOT = Path(__file__).resolve().parents[1]
B = 16  # block size (tokens); the hash unit too
QUERY_BLOCKS = 256  # a 4k-token request
ENGINES = 8  # the synthetic workload's default; --engines runs more counts
PEER_PACKAGE = "ai-dynamo-runtime==1.6.1"
DEFAULT_PEER_VENV = ROOT / ".kvtier" / "venv-bench-dynamo"

Event = tuple[str, int, list[int], int | None]  # (op "store"/"remove", engine, hashes, parent)
_M64 = (1 << 64) - 1


def vllm_hash(n: int) -> int:
    """The block hash of sequence number ``n``: 64 bits spread as vLLM's are (its int hashes
    are sha256 digests cut to 64 bits). splitmix64's finalizer, a bijection: no collisions.

    The streams number blocks consecutively; fed as they are, a Python dict (an int hashes to
    itself) would hold a chain's blocks in neighbouring slots, a locality real hashes never
    give, and the walks would be timed with warm caches."""
    z = (n + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def as_vllm_hashes(ev: Event) -> Event:
    """``ev`` with its sequence numbers as block hashes (:func:`vllm_hash`)."""
    op, engine, hashes, parent = ev
    return op, engine, list(map(vllm_hash, hashes)), None if parent is None else vllm_hash(parent)


def _hashed(events: list[Event], queries: list[list[int]]
            ) -> tuple[list[Event], list[list[int]]]:
    return list(map(as_vllm_hashes, events)), [list(map(vllm_hash, q)) for q in queries]


# -- the event streams (standard library only: both sides build them the same way) --------

def ingest_stream(n_batches: int, seed: int = 0) -> Iterator[list[Event]]:
    """Batches of a busy engine: chained stores of 16-64 hashes, removals of tails."""
    rng = random.Random(seed)
    next_hash = 1
    resident: list[int] = []
    chains: list[int] = []  # last hash of live requests
    for _ in range(n_batches):
        batch: list[Event] = []
        for _ in range(rng.randint(4, 8)):
            n = rng.randint(16, 64)
            if rng.random() < 0.65 or len(resident) < n:
                parent = rng.choice(chains) if chains and rng.random() < 0.7 else None
                hashes = list(range(next_hash, next_hash + n))
                next_hash += n
                batch.append(("store", 0, hashes, parent))
                resident.extend(hashes)
                chains.append(hashes[-1])
                if len(chains) > 256:
                    chains.pop(0)
            else:  # the newest go, leaves first, as vLLM evicts a freed request's tail
                gone, resident[-n:] = resident[-n:], []
                batch.append(("remove", 0, gone[::-1], None))
                chains = [c for c in chains if c < gone[0]]
        yield list(map(as_vllm_hashes, batch))


def index_stream(n_blocks: int, engines: int = ENGINES,
                 seed: int = 1) -> tuple[list[Event], list[list[int]]]:
    """Synthetic: stores filling an index of ``n_blocks`` blocks over ``engines`` engines
    (chains of :data:`QUERY_BLOCKS`; each whole on one engine, its first half on the next),
    and the query chains (stored ones, some cut short and continued with hashes nobody
    holds)."""
    rng = random.Random(seed)
    half = QUERY_BLOCKS // 2
    n_chains = n_blocks // (QUERY_BLOCKS + half)
    events: list[Event] = []
    chains: list[list[int]] = []
    base = 10**12
    for c in range(n_chains):
        hashes = list(range(base + c * QUERY_BLOCKS, base + (c + 1) * QUERY_BLOCKS))
        events.append(("store", c % engines, hashes, None))
        events.append(("store", (c + 1) % engines, hashes[:half], None))
        chains.append(hashes)
    queries = []
    fresh = 2 * base
    for i in range(2000):
        chain = list(rng.choice(chains))
        cut = rng.choice((QUERY_BLOCKS, QUERY_BLOCKS, rng.randrange(1, QUERY_BLOCKS)))
        chain[cut:] = range(fresh + i * QUERY_BLOCKS, fresh + i * QUERY_BLOCKS + len(chain) - cut)
        queries.append(chain)
    return _hashed(events, queries)


class _Hashes:
    """Fresh block hashes, and the fixed chains of shared prefixes (by id)."""

    def __init__(self) -> None:
        self.next = 3 * 10**12
        self.prefixes: dict[Any, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        self.next += n
        return list(range(self.next - n, self.next))

    def prefix(self, pid: Any, n: int) -> list[int]:
        if pid not in self.prefixes:
            self.prefixes[pid] = self.fresh(n)
        return self.prefixes[pid]


def _zipf(rng: random.Random, n: int, s: float = 1.1) -> int:
    return rng.choices(range(n), weights=[1 / (k + 1) ** s for k in range(n)])[0]


def _trace_request(rng: random.Random, hs: _Hashes) -> list[tuple[Any, list[int]]]:
    """One request's chain in parts: a long shared system prompt (16 of them, Zipf-popular,
    512-1.5k tokens), often a shared document or few-shot prefix (64 per system prompt, Zipf,
    128 tokens-1k), then its own turn (256 tokens-2.5k)."""
    s = _zipf(rng, 16)
    parts: list[tuple[Any, list[int]]] = [(("sys", s), hs.prefix(("sys", s), 32 + 4 * s))]
    if rng.random() < 0.6:
        d = _zipf(rng, 64)
        parts.append((("doc", s, d), hs.prefix(("doc", s, d), 8 + (d * 7) % 56)))
    parts.append((None, hs.fresh(rng.randint(16, 160))))
    return parts


def trace_stream(n_blocks: int, engines: int,
                 seed: int = 2) -> tuple[list[Event], list[list[int]]]:
    """Trace-shaped: requests (:func:`_trace_request`) land on random engines until
    ``n_blocks`` blocks are stored; an engine announces only what it does not hold yet, its
    parent the last block it holds (as vLLM's block pool). Queries: half a new request, half
    a past conversation's next turn (its whole chain, then 8-32 new blocks)."""
    rng = random.Random(seed)
    hs = _Hashes()
    held: set[tuple[int, Any]] = set()
    events: list[Event] = []
    convs: list[list[int]] = []
    stored = 0
    while stored < n_blocks:
        e = rng.randrange(engines)
        parent = None
        chain: list[int] = []
        for pid, hashes in _trace_request(rng, hs):
            if pid is None or (e, pid) not in held:
                events.append(("store", e, hashes, parent))
                stored += len(hashes)
                held.add((e, pid))
            chain += hashes
            parent = hashes[-1]
        if len(convs) < 20_000:
            convs.append(chain)
        else:
            convs[rng.randrange(len(convs))] = chain
    queries = []
    for _ in range(2000):
        if rng.random() < 0.5:
            queries.append([h for _pid, part in _trace_request(rng, hs) for h in part])
        else:
            queries.append(rng.choice(convs) + hs.fresh(rng.randint(8, 32)))
    return _hashed(events, queries)


WORKLOADS: dict[str, Callable[[int, int], tuple[list[Event], list[list[int]]]]] = {
    "synthetic": lambda n, e: index_stream(n, e), "trace": trace_stream}


def workload_runs(engine_counts: list[int]) -> list[tuple[str, int]]:
    """The query stage's runs: the synthetic workload at each engine count, then the trace
    at the largest."""
    return [("synthetic", e) for e in engine_counts] + [("trace", max(engine_counts))]


def updates_of(batches: list[list[Event]]) -> int:
    return sum(len(e[2]) for b in batches for e in b)


def percentiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"p50_us": s[len(s) // 2] * 1e6, "p99_us": s[min(len(s) - 1, len(s) * 99 // 100)] * 1e6,
            "n": len(s)}


def best_round(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Query latency over several rounds of the same requests: the best p50 and the best
    p99 (as ingest takes the best repetition: a shared machine's bursts are not the index's),
    with every round's figures."""
    return {"p50_us": min(r["p50_us"] for r in rounds), "p99_us": min(r["p99_us"] for r in rounds),
            "n": rounds[0]["n"], "rounds": rounds}


# -- the peer side: runs under the peer venv's Python, standard library + dynamo only -------

def _dynamo_json(ev: Event, event_id: int) -> bytes:
    op, _engine, hashes, parent = ev
    if op == "store":
        data: dict[str, Any] = {"stored": {"parent_hash": parent, "blocks": [
            {"block_hash": h, "tokens_hash": h} for h in hashes]}}
    else:
        data = {"removed": {"block_hashes": hashes}}
    return json.dumps({"event_id": event_id, "data": data}).encode()


def peer_worker(spec_path: str, out_path: str) -> int:
    """Dynamo's RadixTree fed the same streams; results as JSON to ``out_path``."""
    from dynamo.llm import RadixTree

    spec = json.loads(Path(spec_path).read_text())
    batches = list(ingest_stream(spec["n_batches"]))
    encoded = [(e[1], _dynamo_json(e, i)) for i, e in enumerate(e for b in batches for e in b)]
    best_wall = best_cpu = float("inf")
    for _ in range(spec["reps"]):
        tree = RadixTree()
        w0, c0 = time.perf_counter(), time.process_time()
        for worker, payload in encoded:
            tree.apply_event(worker, payload)
        tree.find_matches([1])  # same thread as apply_event: returns once all are applied
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
        del tree
    out: dict[str, Any] = {"ingest_wall_s": best_wall, "ingest_cpu_s": best_cpu, "queries": {}}
    for name, engines in spec["runs"]:
        events, queries = WORKLOADS[name](spec["index_blocks"], engines)
        tree = RadixTree()
        for i, ev in enumerate(events):
            tree.apply_event(ev[1], _dynamo_json(ev, i))
        tree.find_matches([1])
        rounds, answers = [], []
        for _ in range(spec.get("query_rounds", 1)):
            lat = []
            for q in queries:
                t0 = time.perf_counter()
                scores = tree.find_matches(q).scores
                lat.append(time.perf_counter() - t0)
                if not rounds:
                    answers.append({str(w[0] if isinstance(w, tuple) else w): n
                                    for w, n in scores.items()})
            rounds.append(percentiles(lat))
        del tree
        out["queries"][f"{name}/{engines}"] = {**best_round(rounds), "answers": answers[:500]}
    Path(out_path).write_text(json.dumps(out))
    return 0


def peer_python(venv: Path, install: bool) -> Path | dict[str, str]:
    """The peer venv's Python, installing the peer first if needed (bounded);
    ``{"error": why}`` when it cannot."""
    py = venv / "bin" / "python"
    probe = "import dynamo.llm as l; assert hasattr(l, 'RadixTree')"
    ok = py.exists() and subprocess.run([py, "-c", probe], capture_output=True).returncode == 0
    if not ok and install:
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True,
                           capture_output=True, timeout=120)
            r = subprocess.run([py, "-m", "pip", "install", PEER_PACKAGE], capture_output=True,
                               text=True, timeout=300)
        except subprocess.TimeoutExpired:
            return {"error": f"pip install {PEER_PACKAGE} did not finish in 300 s"}
        except subprocess.CalledProcessError as exc:
            return {"error": f"python -m venv failed: {exc.stderr.decode()[-2000:]}"}
        if r.returncode != 0:
            return {"error": f"pip install {PEER_PACKAGE} failed: {r.stderr[-2000:]}"}
        ok = subprocess.run([py, "-c", probe], capture_output=True).returncode == 0
    if not ok:
        return {"error": f"{py} has no dynamo.llm.RadixTree (installed: {install})"}
    return py


def run_peer(py: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`peer_worker` under the peer's Python; ``{"error": why}`` when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        sp, op = Path(tmp, "spec.json"), Path(tmp, "out.json")
        sp.write_text(json.dumps(spec))
        r = subprocess.run([py, "-m", "benchmarks.bench_index", "--peer-worker", str(sp), str(op)],
                           cwd=ROOT, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            return {"error": f"the peer worker failed: {r.stderr[-2000:]}"}
        out = json.loads(op.read_text())
    out["package"] = PEER_PACKAGE
    return out


# -- kvtier's side ---------------------------------------------------------------------------

def _payloads(batches: list[list[Event]]) -> list[bytes]:
    from connector.events.wire import BlockRemoved, BlockStored, KVEventBatch, encode_batch

    out = []
    for batch in batches:
        events: list[Any] = [
            BlockStored(h, p, [1] * (B * len(h)), B, None, "GPU", None, group_idx=0)
            if op == "store" else BlockRemoved(h, "GPU", group_idx=0)
            for op, _e, h, p in batch]
        out.append(encode_batch(KVEventBatch(1.0, events)))
    return out


def kvtier_ingest(batches: list[list[Event]], reps: int) -> dict[str, float]:
    from connector.daemon.ingest import Ingestor

    payloads = _payloads(batches)
    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        ing = Ingestor(block_sizes={0: B})
        w0, c0 = time.perf_counter(), time.process_time()
        for p in payloads:
            ing.ingest("bench", 0, p, now=0.0)
        best_wall = min(best_wall, time.perf_counter() - w0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return {"ingest_wall_s": best_wall, "ingest_cpu_s": best_cpu}


def kvtier_query(name: str, engines: int, n_blocks: int,
                 rounds_n: int = 1) -> tuple[dict[str, Any], list[dict[str, int]]]:
    """``score_engines`` (every engine, every medium, ranked) over workload ``name``."""
    from connector.daemon.ingest import Ingestor
    from connector.events.score import score_engines

    events, queries = WORKLOADS[name](n_blocks, engines)
    ing = Ingestor(block_sizes={0: B})
    for op, engine, hashes, parent in events:
        ing.ingest(f"engine{engine}", 0, _payloads([[(op, engine, hashes, parent)]])[0], 0.0)
    index = ing.index
    rounds, answers = [], []
    for _ in range(rounds_n):
        lat = []
        for q in queries:
            t0 = time.perf_counter()
            ranked = score_engines(index, q)
            lat.append(time.perf_counter() - t0)
            if not rounds:
                answers.append({s.publisher.removeprefix("engine").removesuffix("#dp0"):
                                s.media["GPU"].tokens // B
                                for s in ranked if s.media["GPU"].tokens})
        rounds.append(percentiles(lat))
    return {**best_round(rounds), "entries": index.n_entries, "nodes": len(index.nodes),
            "engines": engines, "query_blocks_mean": sum(map(len, queries)) / len(queries)}, \
        answers


# -- HTTP /score under ingest ----------------------------------------------------------------

QUERY_CHAIN = [vllm_hash(n) for n in range(10**12, 10**12 + QUERY_BLOCKS)]  # resident throughout


def _publisher(port: int, stats_url: str, n_batches: int, seconds: float, rate: int,
               queues: tuple[Any, Any, Any]) -> None:
    """Child process: bind a PUB, wait for the daemon's SUB, preload (the query's chain
    first), wait for ``go``, then publish at ``rate`` hash updates/s for ``seconds``; puts
    what it sent on ``done``."""
    ready, go, done = queues
    import urllib.request

    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 1_000_000)
    pub.bind(f"tcp://127.0.0.1:{port}")

    def received() -> int:
        with urllib.request.urlopen(stats_url, timeout=10) as r:  # noqa: S310 (loopback)
            return json.loads(r.read())["sources"][0]["received"]

    while received() == 0:  # one-frame probes until the SUB is there (counted malformed)
        pub.send_multipart([b"probe"])
        time.sleep(0.05)
    batches = [[("store", 0, QUERY_CHAIN, None)], *ingest_stream(n_batches, seed=7)]
    payloads = _payloads(batches)
    per_batch = updates_of(batches) / len(batches)
    seq = 0
    for p in payloads[: len(payloads) // 2]:  # preload: half the stream, flat out
        pub.send_multipart((b"", seq.to_bytes(8, "big"), p))
        seq += 1
    ready.put(seq)
    go.get(timeout=600)
    interval = per_batch / rate
    t_next = start = time.monotonic()
    sent = 0
    i = len(payloads) // 2
    while time.monotonic() - start < seconds and i < len(payloads):
        pub.send_multipart((b"", seq.to_bytes(8, "big"), payloads[i]))
        seq += 1
        sent += updates_of([batches[i]])
        i += 1
        t_next += interval
        if (sleep := t_next - time.monotonic()) > 0:
            time.sleep(sleep)
    done.put({"batches": seq, "updates": sent, "seconds": time.monotonic() - start})
    pub.close(linger=1000)
    ctx.term()


def _score_loop(port: int, body: bytes, until: Callable[[], bool]) -> list[float]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    lat = []
    while not until():
        t0 = time.perf_counter()
        conn.request("POST", "/score", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        lat.append(time.perf_counter() - t0)
        assert resp.status == 200
    conn.close()
    return lat


def http_under_ingest(rate: int, seconds: float) -> dict[str, Any]:
    import multiprocessing as mp
    import queue

    from rigs.daemon_proc import DaemonProcess
    from rigs.ports import free_port

    port = free_port()
    daemon = DaemonProcess("--endpoint", f"tcp://*:{port}", "--no-replay-on-start",
                           "--block-size", f"0={B}").start()
    ctx = mp.get_context("fork")
    ready, go, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    n_batches = int(2.6 * rate * seconds / 240) + 2000  # ~240 updates a batch; half preload
    proc = ctx.Process(target=_publisher, args=(port, daemon.base + "/stats", n_batches,
                                                seconds, rate, (ready, go, done)))
    proc.start()
    try:
        preload = ready.get(timeout=300)
        daemon.wait_for(lambda s: s["sources"][0]["next_seq"] >= preload, timeout=300,
                        what="preload applied")
        body = json.dumps({"block_hashes": QUERY_CHAIN}).encode()
        _status, answer = daemon.post("/score", {"block_hashes": QUERY_CHAIN})
        idle = _score_loop(daemon.http_port, body, _for(2.0))
        s0 = daemon.stats()
        result: dict[str, Any] = {}
        go.put(True)

        def finished() -> bool:
            try:
                result.update(done.get_nowait())
                return True
            except queue.Empty:
                return False

        t0 = time.perf_counter()
        busy = _score_loop(daemon.http_port, body, finished)
        wall = time.perf_counter() - t0
        s1 = daemon.stats()
        final = daemon.wait_for(lambda s: s["sources"][0]["next_seq"] >= result["batches"],
                                timeout=600, what="the stream applied")
        drain = time.perf_counter() - t0 - wall
    finally:
        proc.join(timeout=60)
        daemon.terminate()
    applied = (s1["index"]["hash_stores"] + s1["index"]["hash_removals"]
               + s1["index"]["unknown_removals"]) - (s0["index"]["hash_stores"]
               + s0["index"]["hash_removals"] + s0["index"]["unknown_removals"])
    return {"target_updates_per_s": rate, "sent_updates_per_s": result["updates"] / wall,
            "applied_updates_per_s": applied / wall, "seconds": wall,
            "entries": s1["index"]["entries"], "requests_per_s": len(busy) / wall,
            "busy": percentiles(busy), "idle": percentiles(idle), "drain_s": drain,
            "cached_tokens": answer["engines"][0]["cached_tokens"],
            "missing_batches": final["sources"][0]["missing_batches"]}


def _for(seconds: float) -> Callable[[], bool]:
    end = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= end


# -- report ----------------------------------------------------------------------------------

def agreement(ours: list[dict[str, int]], theirs: list[dict[str, int]]) -> dict[str, int]:
    """Queries whose per-engine full-block counts agree (Dynamo omits zero scores)."""
    same = sum(1 for a, b in zip(ours, theirs, strict=False)
               if a == {k: v for k, v in b.items() if v})
    return {"compared": min(len(ours), len(theirs)), "agree": same}


def report(res: dict[str, Any]) -> None:
    k, p, h = res["kvtier"], res.get("dynamo", {}), res["http"]
    u = res["ingest_updates"]
    print(f"ingest: {u:,} hash updates (best of {res['reps']}); load "
          f"{' / '.join(f'{a[0]:.1f}' for a in res['load'])}")
    print(f"{'':<44}{'kvtier':>12}{'dynamo':>12}{'ratio':>8}")
    rows = [("ingest hash updates/s (wall)", u / k["ingest_wall_s"],
             u / p["ingest_wall_s"] if "ingest_wall_s" in p else None),
            ("ingest hash updates/CPU-s", u / k["ingest_cpu_s"],
             u / p["ingest_cpu_s"] if "ingest_cpu_s" in p else None)]
    for run, q in k["queries"].items():
        theirs = p.get("queries", {}).get(run, {})
        label = f"{run}: {q['entries'] / 1e6:.1f}M blocks, {q['query_blocks_mean']:.0f}-block q"
        rows.append((f"{label} p50 (us)", q["p50_us"], theirs.get("p50_us")))
        rows.append((f"{label} p99 (us)", q["p99_us"], theirs.get("p99_us")))
    for name, a, b in rows:
        ratio = "" if b is None else f"{a / b:.2f}"
        print(f"{name:<44}{a:>12,.0f}{'' if b is None else f'{b:,.0f}':>12}{ratio:>8}")
    if "error" in p:
        print(f"dynamo: not run: {p['error']}")
    else:
        print("full blocks equal to Dynamo's:", json.dumps(p["agreement_by_run"]))
    print(f"HTTP /score while ingesting (target {h['target_updates_per_s']:,}/s, reached "
          f"{h['applied_updates_per_s']:,.0f}/s applied, {h['entries']:,} entries): "
          f"{h['requests_per_s']:,.0f} req/s, p50 {h['busy']['p50_us'] / 1000:.2f} ms, "
          f"p99 {h['busy']['p99_us'] / 1000:.2f} ms (idle: p50 "
          f"{h['idle']['p50_us'] / 1000:.2f} ms, p99 {h['idle']['p99_us'] / 1000:.2f} ms)")
    print("ratios:", json.dumps({n: round(v, 3) for n, v in res["ratios"].items()}))


def agreement_stage(py: Path | dict[str, str] | None, again: bool) -> dict[str, Any]:
    """Stage 4 (:mod:`benchmarks.index_agreement`): vLLM's own recorded streams (tiny Llama,
    tiny hybrid) fed to both indexes, each answer against vLLM's ``num_cached_tokens``;
    prints the tables and returns them."""
    from benchmarks import index_agreement

    res = index_agreement.agreement(py if isinstance(py, Path) else None, again=again)
    if isinstance(py, dict):
        for r in res.values():
            r.setdefault("dynamo", {}).update(py)
    index_agreement.report(res)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller run (smoke)")
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--rate", type=int, default=100_000, help="HTTP stage: hash updates/s")
    ap.add_argument("--seconds", type=float, default=10.0, help="HTTP stage: duration")
    ap.add_argument("--engines", default="8,64",
                    help="query stage: engine counts of the synthetic workload, comma-separated "
                         "(the trace workload runs at the largest)")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="query stage: index size")
    ap.add_argument("--peer-venv", type=Path, default=DEFAULT_PEER_VENV)
    ap.add_argument("--no-peer", action="store_true", help="skip Dynamo's indexer")
    ap.add_argument("--no-peer-install", action="store_true", help="never pip install")
    ap.add_argument("--no-agreement", action="store_true",
                    help="skip the agreement stage (it runs two tiny vLLM engines)")
    ap.add_argument("--agreement-only", action="store_true",
                    help="only the agreement stage: vLLM's recorded streams, both indexes")
    ap.add_argument("--re-record", action="store_true",
                    help="record the vLLM event streams again (default: reuse them)")
    ap.add_argument("--peer-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer_worker:
        return peer_worker(*args.peer_worker)
    py = (None if args.no_peer
          else peer_python(args.peer_venv, not args.no_peer_install))
    if args.agreement_only:
        res = {"agreement": agreement_stage(py, args.re_record)}
        write_result(args.json, res)
        return 0
    counts = [int(e) for e in args.engines.split(",")]
    # --quick: a smaller ingest stream, but enough repetitions and rounds that the best of
    # them is not a burst of a shared machine (each repetition takes ~0.1 s)
    spec = {"n_batches": 1000 if args.quick else 3000, "reps": 7 if args.quick else 9,
            "index_blocks": args.blocks, "query_rounds": 5 if args.quick else 7,
            "runs": workload_runs(counts)}
    batches = list(ingest_stream(spec["n_batches"]))
    res: dict[str, Any] = {"ingest_updates": updates_of(batches), "reps": spec["reps"],
                           "spec": spec, "cpus": os.cpu_count(), "load": [os.getloadavg()]}
    kv = kvtier_ingest(batches, spec["reps"])
    kv["queries"], ours = {}, {}
    for name, engines in spec["runs"]:
        run = f"{name}/{engines}"
        kv["queries"][run], ours[run] = kvtier_query(name, engines, spec["index_blocks"],
                                                     spec["query_rounds"])
    kv["query"] = kv["queries"][f"synthetic/{counts[0]}"]
    res["kvtier"] = kv
    res["load"].append(os.getloadavg())
    peer = (py if isinstance(py, dict) else {"error": "skipped (--no-peer)"} if py is None
            else run_peer(py, spec))
    res["load"].append(os.getloadavg())
    res["dynamo"] = _peer_summary(peer, ours, counts[0])
    res["http"] = http_under_ingest(args.rate, 3.0 if args.quick else args.seconds)
    res["load"].append(os.getloadavg())
    res["ratios"] = ratios(res, peer)
    report(res)
    if not args.no_agreement:
        res["agreement"] = agreement_stage(py, args.re_record)
    write_result(args.json, res)
    return 0


def _peer_summary(peer: dict[str, Any], ours: dict[str, list[dict[str, int]]],
                  engines: int) -> dict[str, Any]:
    """The peer's figures without its answers, with the full-block agreement per run."""
    out = {k: v for k, v in peer.items() if k != "queries"}
    if "queries" in peer:
        out["queries"] = {run: {k: v for k, v in q.items() if k != "answers"}
                          for run, q in peer["queries"].items()}
        out["query"] = out["queries"][f"synthetic/{engines}"]
        out["agreement_by_run"] = {run: agreement(ours[run], q["answers"])
                                   for run, q in peer["queries"].items()}
        out["full_block_agreement"] = out["agreement_by_run"][f"synthetic/{engines}"]
    return out


def ratios(res: dict[str, Any], peer: dict[str, Any]) -> dict[str, float]:
    """The headline ratios: HTTP figures; ingest and query against the peer, per run (the
    first synthetic run unsuffixed)."""
    h, kv = res["http"], res["kvtier"]
    out = {"score_http_requests_per_s": h["requests_per_s"],
           "score_http_p99_ms": h["busy"]["p99_us"] / 1000,
           "ingest_applied_during_http_per_s": h["applied_updates_per_s"]}
    if "error" in peer:
        return out
    out["ingest_vs_dynamo"] = peer["ingest_cpu_s"] / kv["ingest_cpu_s"]
    out["ingest_wall_vs_dynamo"] = peer["ingest_wall_s"] / kv["ingest_wall_s"]
    first = next(iter(kv["queries"]))
    for run, q in kv["queries"].items():
        theirs = peer["queries"][run]
        suffix = "" if run == first else "_" + run.replace("/", "_")
        out["query_p99_vs_dynamo" + suffix] = q["p99_us"] / theirs["p99_us"]
        out["query_p50_vs_dynamo" + suffix] = q["p50_us"] / theirs["p50_us"]
    return out


if __name__ == "__main__":
    sys.exit(main())

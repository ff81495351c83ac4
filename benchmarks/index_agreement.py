"""Where kvtier's index and Dynamo's RadixTree answer differently, on vLLM's own event stream.

Rules it keeps:

* **Recorded, not synthesised.** ``record`` runs a real vLLM CPU engine (in process, KV events
  on, one engine at a time) over a fixed workload and keeps every batch exactly as vLLM put it
  on the wire (read back through vLLM's own replay socket), plus, per request, the token ids,
  vLLM's own block-hash chain, the last batch published before it ran (the cut) and vLLM's
  ``num_cached_tokens``. Streams live under ``.kvtier/`` (git-ignored); nothing is committed.
* **Truth is vLLM's.** Each request after the first pass is asked of both indexes as they stood
  at its cut; ``num_cached_tokens`` says what was really cached then.
* **kvtier** ingests the payloads as the daemon does (decode, classify, index) and answers with
  ``score_engines`` over the chain kvtier hashes from the token ids (one hash per hash unit).
* **Dynamo** sees the events as its vLLM ZMQ listener converts them (ai-dynamo
  ``kv_router`` ``convert_event`` / ``create_stored_blocks``, 1.6): ``group_idx`` and
  ``kv_cache_spec_kind`` ignored; a stored block whose ``block_size`` is not the router's
  ``kv_block_size`` is not published, nor is anything after it in that event; ``tokens_hash``
  = Dynamo's ``compute_block_hash_for_seq`` of the block's tokens. It is asked with
  ``compute_block_hash_for_seq(prompt, kv_block_size)``, and its block count is turned into
  tokens. That side runs under the peer venv's Python (standard library + ``dynamo`` only).

Workload (``WORKLOAD``): three prompts whose lengths are not block multiples; new requests
(one sharing a prompt's first block then diverging, fillers); then the three prompts again and
one extended past a prompt's end (its hit ends in that prompt's tail), and a prompt cut inside
one (a hybrid engine may hold its attention blocks there but no Mamba state). Rows: the new
requests and the second pass.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".kvtier" / "index-agreement"
MODELS = ("llama", "hybrid")
ASKED = ("new", "second")  # the passes whose requests both indexes are asked
FORMAT = 2  # bump when the recorded shape changes


def _tokens(start: int, n: int) -> list[int]:
    """``n`` distinct-looking token ids (vocabulary 512, specials 0-3 avoided)."""
    return [4 + (start * 131 + i * 37) % 500 for i in range(n)]


A, B, C = _tokens(1, 100), _tokens(2, 150), _tokens(3, 77)
WORKLOAD: list[tuple[str, str, list[int]]] = [  # (name, pass, token ids)
    ("A", "first", A), ("B", "first", B), ("C", "first", C),
    ("D=A[:64]+new", "new", A[:64] + _tokens(4, 50)),
    ("F1", "new", _tokens(5, 120)), ("F2", "new", _tokens(6, 90)),
    ("A", "second", A), ("B", "second", B), ("C", "second", C),
    ("A+40", "second", A + _tokens(7, 40)), ("B[:100]", "second", B[:100]),
]
"""Ids stay below the tiny models' vocabulary (512)."""


# -- recording (kvtier's venv, real vLLM) ----------------------------------------------------

class _Replay:
    """vLLM's replay socket, read with its own protocol: send a start seq, receive batches
    until the end marker (seq -1)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)

    def since(self, start: int) -> list[tuple[int, bytes]]:
        self.sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            if not self.sock.poll(10_000):
                raise TimeoutError("vLLM's replay socket did not answer in 10 s")
            _e, _topic, seq_b, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq < 0:
                return out
            out.append((seq, payload))

    def settled(self, have: list[tuple[int, bytes]]) -> None:
        """Append to ``have`` until nothing new arrives for 0.5 s (the engine is idle, so
        vLLM's publisher thread has sent every batch once the buffer stops growing)."""
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 0.5:
            new = self.since(have[-1][0] + 1 if have else 0)
            if new:
                have.extend(new)
                quiet_since = time.monotonic()
            time.sleep(0.1)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def _vllm_chain(llm: Any, token_ids: list[int], unit: int) -> list[int]:
    """The request's block hashes as vLLM computes them (its own functions)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    fn = get_hash_fn_by_name(llm.llm_engine.vllm_config.cache_config.prefix_caching_hash_algo)
    parent, out = None, []
    for i in range(len(token_ids) // unit):
        parent = kcu.hash_block_tokens(fn, parent, token_ids[i * unit:(i + 1) * unit], None)
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


def record(model: str, out: Path) -> dict[str, Any]:
    """Run ``WORKLOAD`` on a real in-process vLLM engine with KV events; write the stream."""
    from connector.demo.presets import apply_cpu_engine_env, engine_kwargs
    from connector.demo.tiny_models import tiny_hybrid, tiny_llama
    from rigs.ports import free_port

    apply_cpu_engine_env()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # this process is only the recorder
    model_dir = tiny_llama() if model == "llama" else tiny_hybrid()
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig

    port, rport = free_port(), free_port()
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"tcp://*:{port}", replay_endpoint=f"tcp://*:{rport}",
                            topic="")
    more = {"num_gpu_blocks_override": 16, "max_model_len": 256} if model == "llama" else {}
    llm = LLM(**engine_kwargs(model, str(model_dir), kv_events_config=events, **more))
    cc = llm.llm_engine.vllm_config.cache_config
    unit = 32  # the hash unit: block size 32 (llama); prefix_match_unit=32 (hybrid)
    replay = _Replay(f"tcp://127.0.0.1:{rport}")
    batches: list[tuple[int, bytes]] = []
    requests = []
    params = SamplingParams(max_tokens=1, temperature=0.0)
    try:
        for name, phase, toks in WORKLOAD:
            replay.settled(batches)
            res = llm.generate({"prompt_token_ids": toks}, params, use_tqdm=False)
            requests.append({"name": name, "pass": phase, "token_ids": toks,
                             "cut_seq": batches[-1][0] if batches else -1,
                             "num_cached_tokens": res[0].num_cached_tokens,
                             "vllm_chain": _vllm_chain(llm, toks, unit)})
        replay.settled(batches)
    finally:
        replay.close()
    import vllm

    rec = {"format": FORMAT, "model": model, "vllm": vllm.__version__,
           "block_size": cc.block_size, "unit": unit, "algo": cc.prefix_caching_hash_algo,
           "engine": {k: v for k, v in more.items()},
           "batches": [[s, base64.b64encode(p).decode()] for s, p in batches],
           "requests": requests}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec))
    return rec


def recorded(model: str, where: Path = DEFAULT_DIR, again: bool = False) -> dict[str, Any]:
    """The recorded stream of ``model``: read from ``where``, recorded first (in a child
    process: one engine at a time, never in the benchmark's process) when missing."""
    path = where / f"{model}.json"
    if again or not path.exists() or json.loads(path.read_text()).get("format") != FORMAT:
        r = subprocess.run([sys.executable, "-m", "benchmarks.index_agreement", "--record", model,
                            str(path.resolve())], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"recording {model} failed: {r.stderr[-3000:]}")
    return json.loads(path.read_text())


# -- the events both indexes are fed ---------------------------------------------------------

def plain_events(rec: dict[str, Any]) -> list[tuple[int, list[dict[str, Any]]]]:
    """``(seq, events)`` of every recorded batch, decoded with kvtier's wire structs into
    plain dicts (the peer's Python has no msgpack)."""
    from connector.events.wire import AllBlocksCleared, BlockStored, decode_batch

    out = []
    for seq, b64 in rec["batches"]:
        evs = []
        for e in decode_batch(base64.b64decode(b64)).events:
            if isinstance(e, BlockStored):
                evs.append({"type": "stored", "hashes": list(e.block_hashes),
                            "parent": e.parent_block_hash, "token_ids": list(e.token_ids),
                            "block_size": e.block_size, "group": e.group_idx,
                            "kind": e.kv_cache_spec_kind, "medium": e.medium})
            elif isinstance(e, AllBlocksCleared):
                evs.append({"type": "cleared"})
            else:
                evs.append({"type": "removed", "hashes": list(e.block_hashes),
                            "group": e.group_idx, "medium": e.medium})
        out.append((seq, evs))
    return out


def stream_shape(events: list[tuple[int, list[dict[str, Any]]]]) -> dict[str, int]:
    """Counts by (type, group, spec kind, announced block size): what the stream holds."""
    counts: dict[str, int] = {}
    for _s, evs in events:
        for e in evs:
            key = (f"{e['type']} group={e.get('group')} kind={e.get('kind')} "
                   f"block_size={e.get('block_size')}")
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


# -- kvtier's answers ------------------------------------------------------------------------

def kvtier_answers(rec: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Per asked request (:data:`ASKED`): kvtier's GPU prefix (tokens, partial) at its cut,
    and whether kvtier's token hashing equals vLLM's chain; the block sizes kvtier learned
    (per group) from the stream."""
    from connector.daemon.ingest import Ingestor
    from connector.events.score import score_engines
    from connector.events.token_hashing import TokenHasher

    hasher = TokenHasher(rec["algo"], rec["unit"])
    ing = Ingestor()
    batches = [(s, base64.b64decode(p)) for s, p in rec["batches"]]
    done = 0
    out = []
    for req in rec["requests"]:
        while done < len(batches) and batches[done][0] <= req["cut_seq"]:
            ing.ingest("vllm", 0, batches[done][1], now=0.0)
            done += 1
        if req["pass"] not in ASKED:
            continue
        chain = hasher.chain(req["token_ids"])
        ranked = score_engines(ing.index, chain, unit=rec["unit"])
        gpu = ranked[0].media["GPU"] if ranked else None
        out.append({"tokens": gpu.tokens if gpu else 0, "partial": bool(gpu and gpu.partial),
                    "chain_equals_vllm": chain == req["vllm_chain"],
                    "note": ranked[0].note if ranked else "no engine"})
    return out, {f"group {g}": b for (_p, g), b in sorted(ing.sizes.learned.items())}


# -- Dynamo's answers (peer venv: standard library + dynamo only) ----------------------------

def dynamo_answers(spec: dict[str, Any]) -> dict[str, Any]:
    """Feed Dynamo's RadixTree the converted events; answer each asked request at its cut.
    ``spec``: ``events`` (:func:`plain_events`), ``requests``, ``kv_block_size``, ``asked``."""
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    kb = spec["kv_block_size"]
    tree = RadixTree()
    dropped = {"partial_blocks": 0, "other_size_blocks": 0, "kept_blocks": 0}
    event_id = 0

    def apply(e: dict[str, Any]) -> None:
        nonlocal event_id
        if e["type"] == "stored":
            blocks = []
            for i, h in enumerate(e["hashes"]):  # create_stored_blocks: break at a misfit
                toks = e["token_ids"][i * e["block_size"]:(i + 1) * e["block_size"]]
                if e["block_size"] != kb or len(toks) < kb:
                    key = "partial_blocks" if 0 < e["block_size"] < kb else "other_size_blocks"
                    dropped[key] += len(e["hashes"]) - i
                    break
                blocks.append({"block_hash": h,
                               "tokens_hash": compute_block_hash_for_seq(toks, kb)[0]})
            dropped["kept_blocks"] += len(blocks)
            data: Any = {"stored": {"parent_hash": e["parent"], "blocks": blocks}}
        elif e["type"] == "removed":
            data = {"removed": {"block_hashes": e["hashes"]}}
        else:
            data = "cleared"
        tree.apply_event(0, json.dumps({"event_id": event_id, "data": data}).encode())
        event_id += 1

    done, out, errors = 0, [], []
    events = spec["events"]
    for req in spec["requests"]:
        while done < len(events) and events[done][0] <= req["cut_seq"]:
            for e in events[done][1]:
                try:
                    apply(e)
                except Exception as exc:  # noqa: BLE001 - reported, per event, as the answer
                    errors.append(f"{e['type']} group={e.get('group')}: {exc}")
            done += 1
        if req["pass"] not in spec["asked"]:
            continue
        local = compute_block_hash_for_seq(req["token_ids"], kb)
        scores = tree.find_matches(local).scores
        blocks = max(scores.values(), default=0)
        out.append({"tokens": blocks * kb, "blocks": blocks})
    return {"answers": out, "conversion": dropped, "errors": errors[:10],
            "n_errors": len(errors)}


def run_dynamo(py: Path, rec: dict[str, Any], kv_block_size: int) -> dict[str, Any]:
    """:func:`dynamo_answers` under the peer venv's Python ``py``; ``{"error": why}`` if it
    cannot run."""
    import tempfile

    spec = {"events": plain_events(rec), "requests": rec["requests"],
            "kv_block_size": kv_block_size, "asked": ASKED}
    with tempfile.TemporaryDirectory() as tmp:
        sp, op = Path(tmp, "spec.json"), Path(tmp, "out.json")
        sp.write_text(json.dumps(spec))
        r = subprocess.run([str(py), "-m", "benchmarks.index_agreement", "--dynamo", str(sp),
                            str(op)], cwd=ROOT, capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            return {"error": f"Dynamo's side failed: {r.stderr[-2000:]}"}
        return json.loads(op.read_text())


# -- the comparison --------------------------------------------------------------------------

def _why(row: dict[str, Any], kb: int, unit: int, mamba: bool) -> str:
    """What differs in one row and which answer is right (vLLM's ``num_cached_tokens``)."""
    truth, k, d = row["vllm_num_cached_tokens"], row["kvtier"], row["dynamo"]
    notes = []
    if d is not None and d != truth:
        if truth % kb and d == truth - truth % kb:
            notes.append(f"vLLM's hit ends in a PARTIAL entry at {truth} (inside a "
                         f"{kb}-token block); Dynamo did not publish it (block_size {unit} "
                         f"!= kv_block_size {kb}) and returns the full blocks before it, "
                         f"{d} tokens")
        elif d > truth and mamba:
            notes.append(f"Dynamo claims {d}, vLLM had {truth}: Dynamo merges the attention "
                         f"and Mamba groups into one tree (group_idx ignored), so attention "
                         f"blocks count without the Mamba state vLLM needs at that end")
        else:
            notes.append(f"Dynamo {d} vs vLLM {truth}")
    if k != truth:
        notes.append(f"kvtier {k} vs vLLM {truth}")
    right = [n for n, v in (("kvtier", k), ("dynamo", d)) if v == truth]
    return "; ".join(notes) + (f" -> right: {', '.join(right) or 'neither'}" if notes else "")


def compare(rec: dict[str, Any], peer_py: Path | None) -> dict[str, Any]:
    """Per asked request: truth, kvtier, Dynamo; counts of agreement (whole answers, and on
    full blocks: answers floored to the attention block size). Where the hash unit is not
    the block size, Dynamo is also run with ``kv_block_size`` = the hash unit."""
    events = plain_events(rec)
    kb, unit = rec["block_size"], rec["unit"]  # the engine's block size: Dynamo's kv_block_size
    mamba = any(e.get("kind") == "mamba" for _s, evs in events for e in evs)
    ours, learned = kvtier_answers(rec)
    peer = run_dynamo(peer_py, rec, kb) if peer_py else {"error": "skipped (--no-peer)"}
    at_unit = run_dynamo(peer_py, rec, unit) if peer_py and unit != kb else None
    asked = [r for r in rec["requests"] if r["pass"] in ASKED]
    rows = []
    for i, r in enumerate(asked):
        k = ours[i]
        d = peer["answers"][i]["tokens"] if "answers" in peer else None
        row = {"request": r["name"], "pass": r["pass"], "prompt_tokens": len(r["token_ids"]),
               "vllm_num_cached_tokens": r["num_cached_tokens"], "kvtier": k["tokens"],
               "kvtier_partial": k["partial"], "dynamo": d,
               "kvtier_chain_equals_vllm": k["chain_equals_vllm"]}
        if at_unit and "answers" in at_unit:
            row[f"dynamo_kv_block_size_{unit}"] = at_unit["answers"][i]["tokens"]
        row["why"] = _why(row, kb, unit, mamba)
        rows.append(row)
    return {"model": rec["model"], "vllm": rec["vllm"], "block_size": kb, "unit": unit,
            "hash_algo": rec["algo"], "batches": len(rec["batches"]),
            "kvtier_learned_block_sizes": learned, "stream": stream_shape(events),
            "rows": rows, "counts": _counts(rows, kb),
            "dynamo": {k: v for k, v in peer.items() if k != "answers"},
            **({f"dynamo_kv_block_size_{unit}": {k: v for k, v in at_unit.items()
                                                 if k != "answers"}} if at_unit else {})}


def _counts(rows: list[dict[str, Any]], kb: int) -> dict[str, int]:
    truth = [r["vllm_num_cached_tokens"] for r in rows]
    out = {"requests": len(rows), "partial_tails": sum(t % kb != 0 for t in truth),
           "kvtier_equals_vllm": sum(r["kvtier"] == t for r, t in zip(rows, truth, strict=True)),
           "full_blocks_kvtier_equals_vllm": sum(
               r["kvtier"] // kb == t // kb for r, t in zip(rows, truth, strict=True))}
    if rows and rows[0]["dynamo"] is not None:
        out.update({
            "dynamo_equals_vllm": sum(r["dynamo"] == t for r, t in zip(rows, truth, strict=True)),
            "full_blocks_dynamo_equals_vllm": sum(
                r["dynamo"] // kb == t // kb for r, t in zip(rows, truth, strict=True)),
            "kvtier_equals_dynamo": sum(r["kvtier"] == r["dynamo"] for r in rows),
            "full_blocks_kvtier_equals_dynamo": sum(
                r["kvtier"] // kb == r["dynamo"] // kb for r in rows)})
    return out


def agreement(peer_py: Path | None, where: Path = DEFAULT_DIR,
              again: bool = False) -> dict[str, Any]:
    """:func:`compare` for every model in :data:`MODELS`; ``{"error": why}`` per model that
    could not be recorded."""
    out: dict[str, Any] = {}
    for model in MODELS:
        try:
            out[model] = compare(recorded(model, where, again), peer_py)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out[model] = {"error": str(exc)}
    return out


def report(res: dict[str, Any]) -> None:
    """The agreement tables, one per model, with what differs and which answer is right."""
    print("agreement: vLLM's recorded KV events fed to kvtier's ingest and to Dynamo's "
          "RadixTree (events converted as Dynamo's vLLM ZMQ listener does: group_idx ignored, "
          "a block whose block_size is not kv_block_size dropped with the rest of its event); "
          "each request asked at the point of the stream where vLLM ran it; truth: vLLM's "
          "num_cached_tokens")
    for model, r in res.items():
        if "error" in r:
            print(f"agreement {model}: not run: {r['error']}")
            continue
        alt = f"dynamo_kv_block_size_{r['unit']}"
        print(f"agreement on vLLM's own event stream: {model} (vLLM {r['vllm']}, attention "
              f"block {r['block_size']}, hash unit {r['unit']}, {r['batches']} batches)")
        print(f"  {'request':<14}{'pass':<8}{'prompt':>7}{'vLLM cached':>12}{'kvtier':>8}"
              f"{'dynamo':>8}" + (f"{'dynamo@' + str(r['unit']):>11}" if alt in r else ""))
        for row in r["rows"]:
            d = "-" if row["dynamo"] is None else str(row["dynamo"])
            line = (f"  {row['request']:<14}{row['pass']:<8}{row['prompt_tokens']:>7}"
                    f"{row['vllm_num_cached_tokens']:>12}{row['kvtier']:>8}{d:>8}")
            if alt in row:
                line += f"{row[alt]:>11}"
            print(line + (" (kvtier: ends in a partial)" if row["kvtier_partial"] else ""))
        print("  counts:", json.dumps(r["counts"]))
        for row in r["rows"]:
            if row["why"]:
                print(f"  {row['request']}: {row['why']}")
        if not all(row["kvtier_chain_equals_vllm"] for row in r["rows"]):
            print("  kvtier's token hashing differs from vLLM's chain for some requests")
        for key in ("dynamo", alt):
            dyn = r.get(key)
            if dyn is None:
                continue
            if "error" in dyn:
                print(f"  {key}: not run: {dyn['error']}")
            else:
                print(f"  {key} conversion: {json.dumps(dyn['conversion'])}; apply_event "
                      f"errors: {dyn['n_errors']}{' ' + dyn['errors'][0] if dyn['errors'] else ''}")


def main(argv: list[str]) -> int:
    """``--record MODEL OUT`` (kvtier's venv) or ``--dynamo SPEC OUT`` (the peer's venv)."""
    if argv[:1] == ["--record"]:
        record(argv[1], Path(argv[2]))
        return 0
    if argv[:1] == ["--dynamo"]:
        spec = json.loads(Path(argv[1]).read_text())
        Path(argv[2]).write_text(json.dumps(dynamo_answers(spec)))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

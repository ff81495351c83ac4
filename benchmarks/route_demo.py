"""KV-aware routing with ``kvtier daemon``'s ``POST /score``, against round robin.

    python -m benchmarks.route_demo [--quick] [--json PATH] [--keep-logs DIR]

Two vLLM OpenAI servers (tiny Llama, CPU, block 32, prefix caching) publish KV events over
ZMQ; one ``kvtier daemon`` subscribes to both (publishers ``A`` and ``B``) and hashes token
ids as vLLM does (``token_hashing``: sha256, 32 tokens a hash). A multi-turn chat workload
(``--conversations`` x ``--turns``; each turn's prompt = the previous prompt + its answer +
new words; conversations take turns in a seeded shuffled order, as users arrive) runs twice,
each time from cold engines (``POST /reset_prefix_cache`` on both, a fresh daemon):

* ``round_robin``: request i goes to engine ``i % 2``;
* ``score``: the router asks the daemon ``POST /score`` with the prompt's token ids and sends
  the request to the best engine; ties (a new conversation: no engine holds it) go round
  robin. The router never waits for the daemon: it scores with what the index holds.

Each server's KV cache is ``--blocks`` blocks of 32 tokens (``--num-gpu-blocks-override``):
room for about half the conversations, so an engine that sees all of them evicts. Reported:
prompt tokens, cached prompt tokens (vLLM's ``usage.prompt_tokens_details.cached_tokens``)
per policy, and the ratio (JSON ``ratios.cached_tokens_score_vs_round_robin``). Requests are
sent one at a time, greedy, ``ignore_eos``: both policies see the same token ids.

Every process it starts ends with it (servers in their own process groups).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.harness import write_result
from connector.demo.tiny_models import prompt_words, tiny_llama
from rigs.daemon_proc import DaemonProcess
from rigs.openai_server import OpenAIServer
from rigs.ports import free_port

BLOCK = 32
ENGINES = ("A", "B")
POLICIES = ("round_robin", "score")


class Conversation:
    """One user's chat: the token ids of its next prompt."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids


@functools.cache
def _tokenizer(model_dir: Path) -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def tokenize(model_dir: Path, text: str) -> list[int]:
    """Token ids of ``text`` by the model's own tokenizer (``tokenizer.json``)."""
    return list(_tokenizer(model_dir).encode(text, add_special_tokens=False).ids)


def events_config(port: int, replay_port: int) -> str:
    """vLLM's ``--kv-events-config``: the server binds PUB and replay ROUTER."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}",
                       "topic": ""})


def start_servers(model_dir: Path, logs: Path, blocks: int,
                  ports: dict[str, tuple[int, int]]) -> dict[str, OpenAIServer]:
    """Both servers, started at once; on failure the ones started are stopped."""
    servers = {name: OpenAIServer(
        model_dir, logs / f"server-{name}.log", max_model_len=1024, max_num_seqs=4,
        extra_args=["--kv-events-config", events_config(*ports[name]),
                    "--num-gpu-blocks-override", str(blocks)]) for name in ENGINES}
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        futures = {name: pool.submit(s.start, 600) for name, s in servers.items()}
        errors = [f.exception() for f in futures.values()]
    if any(errors):
        for s in servers.values():
            s.stop()
        raise RuntimeError(f"a server did not start: {next(e for e in errors if e)}")
    return servers


def start_daemon(logs: Path, ports: dict[str, tuple[int, int]]) -> DaemonProcess:
    """A fresh ``kvtier daemon`` on both servers' streams, hashing token ids as vLLM does."""
    cfg = logs / f"daemon-{free_port()}.yaml"
    pubs = ", ".join(f"{{name: {n}, endpoint: 'tcp://*:{p}', replay_endpoint: 'tcp://*:{r}'}}"
                     for n, (p, r) in ports.items())
    cfg.write_text(f"publishers: [{pubs}]\n"
                   f"token_hashing: {{algo: sha256, hash_block_size: {BLOCK}}}\n")
    return DaemonProcess("--config", str(cfg), "--connect-host", "127.0.0.1",
                         "--no-replay-on-start").start(timeout=60)


def reset(server: OpenAIServer) -> None:
    """Empty the server's prefix cache (retried while a request is still finishing)."""
    for _ in range(100):
        if server.post("/reset_prefix_cache").get("success") is not False:
            return
        time.sleep(0.1)
    raise RuntimeError("reset_prefix_cache kept failing")


def complete(client: httpx.Client, server: OpenAIServer, ids: list[int],
             answer_tokens: int) -> tuple[list[int], int, int]:
    """One greedy completion of token ids: (answer ids, prompt tokens, cached prompt tokens)."""
    resp = client.post(f"{server.base}/v1/completions", json={
        "model": str(server.model_dir), "prompt": ids, "max_tokens": answer_tokens,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}, timeout=300)
    resp.raise_for_status()
    body = resp.json()
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return list(body["choices"][0]["token_ids"]), usage["prompt_tokens"], cached


def warm_up(client: httpx.Client, servers: dict[str, OpenAIServer],
            daemon: DaemonProcess) -> None:
    """One short request per server until the daemon has heard from both (ZMQ's late
    joiner), then both prefix caches emptied: the policy starts cold. vLLM announces the
    reset (``AllBlocksCleared``) on its next step: a prompt shorter than a block makes one."""
    deadline = time.monotonic() + 120
    for attempt in range(10**6):
        for s in servers.values():  # a new prompt each time: new blocks, new events
            complete(client, s, [5 + attempt % 500] * (2 * BLOCK), 1)
        heard = {p.split("#")[0] for p, st in daemon.stats()["publishers"].items()
                 if st["batches"]}
        if heard >= set(servers):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the daemon heard only {sorted(heard)}: {daemon.stats()}")
        time.sleep(0.5)
    for s in servers.values():
        reset(s)
        complete(client, s, [5] * (BLOCK // 2), 1)
    daemon.wait_for(lambda st: all(st["publishers"].get(f"{n}#dp0", {}).get("cleared_events")
                                   for n in servers) and st["index"]["entries"] == 0,
                    timeout=60, what="both prefix caches cleared, the index empty")


def pick(policy: str, i: int, rr: list[int], daemon: DaemonProcess,
         ids: list[int]) -> tuple[str, dict[str, int]]:
    """The engine for request ``i`` and what the daemon predicted (score policy)."""
    if policy == "round_robin":
        return ENGINES[i % len(ENGINES)], {}
    status, body = daemon.post("/score", {"token_ids": ids})
    if status != 200:
        raise RuntimeError(f"/score answered {status}: {body}")
    cached = {e["publisher"].split("#")[0]: e["cached_tokens"] for e in body["engines"]}
    top = body["engines"][0]["score"]
    best = [e["publisher"].split("#")[0] for e in body["engines"] if e["score"] == top]
    best = [e for e in ENGINES if e in best] or list(ENGINES)
    choice = best[rr[0] % len(best)] if len(best) > 1 else best[0]
    rr[0] += len(best) > 1
    return choice, cached


def run_policy(policy: str, args: argparse.Namespace, model_dir: Path,
               servers: dict[str, OpenAIServer], daemon: DaemonProcess) -> dict[str, Any]:
    """The workload once under ``policy``; per request and total figures."""
    rng = random.Random(args.seed)
    convs = [Conversation(tokenize(model_dir, prompt_words(100 + c, args.first_words)))
             for c in range(args.conversations)]
    rr = [0]
    requests: list[dict[str, Any]] = []
    with httpx.Client() as client:
        warm_up(client, servers, daemon)
        t0 = time.monotonic()
        for turn in range(args.turns):
            order = list(range(len(convs)))
            rng.shuffle(order)
            for c in order:
                conv = convs[c]
                engine, predicted = pick(policy, len(requests), rr, daemon, conv.ids)
                answer, prompt_tokens, cached = complete(client, servers[engine], conv.ids,
                                                         args.answer_tokens)
                requests.append({"conversation": c, "turn": turn, "engine": engine,
                                 "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                                 "predicted_cached_tokens": predicted.get(engine)})
                more = tokenize(model_dir, prompt_words(1000 * (c + 1) + turn, args.new_words))
                conv.ids = conv.ids + answer + more
        wall = time.monotonic() - t0
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)
    scored = [r for r in requests if r["predicted_cached_tokens"] is not None]
    return {"requests": requests, "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0, "wall_s": wall,
            # the daemon's cached_tokens for the chosen engine against vLLM's own count
            "predicted_exact": sum(r["predicted_cached_tokens"] == r["cached_tokens"]
                                   for r in scored), "predicted_of": len(scored),
            "per_engine": {e: sum(r["engine"] == e for r in requests) for e in ENGINES}}


def report(res: dict[str, Any]) -> None:
    w = res["workload"]
    print(f"{w['conversations']} conversations x {w['turns']} turns, {w['blocks']} KV blocks "
          f"of {BLOCK} tokens per engine, {len(ENGINES)} engines")
    print(f"{'policy':<14}{'requests':>10}{'prompt tok':>12}{'cached tok':>12}{'hit rate':>10}"
          f"{'A/B':>9}")
    for name in POLICIES:
        p = res["policies"][name]
        split = "/".join(str(p["per_engine"][e]) for e in ENGINES)
        print(f"{name:<14}{len(p['requests']):>10}{p['prompt_tokens']:>12,}"
              f"{p['cached_tokens']:>12,}{p['hit_rate']:>10.1%}{split:>9}")
    sc = res["policies"]["score"]
    print(f"/score's cached_tokens for the chosen engine = vLLM's cached_tokens in "
          f"{sc['predicted_exact']} of {sc['predicted_of']} requests")
    print("ratios:", json.dumps({k: round(v, 3) for k, v in res["ratios"].items()}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller run (4 x 3, smaller cache)")
    ap.add_argument("--json", help="write results to this path")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--blocks", type=int, help="KV-cache blocks per engine")
    ap.add_argument("--first-words", type=int, default=256, help="first prompt, in words")
    ap.add_argument("--new-words", type=int, default=64, help="words a turn adds")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-logs", type=Path, help="server and daemon logs here")
    args = ap.parse_args(argv)
    args.conversations = args.conversations or (4 if args.quick else 8)
    args.turns = args.turns or (3 if args.quick else 4)
    # ~19 blocks a conversation at its last turn (defaults): room for about half of them
    args.blocks = args.blocks or (48 if args.quick else 96)
    # SIGTERM ends the run through the finally blocks below (servers, daemon stopped)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logs = args.keep_logs or Path(tempfile.mkdtemp(prefix="kvtier-route-demo-"))
    logs.mkdir(parents=True, exist_ok=True)
    model_dir = tiny_llama()
    ports = {name: (free_port(), free_port()) for name in ENGINES}
    res: dict[str, Any] = {"workload": {k: getattr(args, k) for k in (
        "conversations", "turns", "blocks", "first_words", "new_words", "answer_tokens",
        "seed")}, "block_size": BLOCK, "policies": {}, "logs": str(logs)}
    t0 = time.monotonic()
    servers = start_servers(model_dir, logs, args.blocks, ports)
    print(f"servers up after {time.monotonic() - t0:.0f} s: "
          + ", ".join(f"{n} {s.base}" for n, s in servers.items()), flush=True)
    try:
        for policy in POLICIES:
            daemon = start_daemon(logs, ports)  # cold: a fresh index per policy
            try:
                res["policies"][policy] = run_policy(policy, args, model_dir, servers, daemon)
            finally:
                if daemon.proc is not None and daemon.proc.poll() is None:
                    daemon.terminate()
            p = res["policies"][policy]
            print(f"{policy}: {p['cached_tokens']:,} of {p['prompt_tokens']:,} prompt tokens "
                  f"cached ({p['wall_s']:.1f} s)", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    rr, sc = res["policies"]["round_robin"], res["policies"]["score"]
    res["ratios"] = {"cached_tokens_score_vs_round_robin":
                     sc["cached_tokens"] / rr["cached_tokens"] if rr["cached_tokens"] else
                     float("inf") if sc["cached_tokens"] else 1.0,
                     "hit_rate_score": sc["hit_rate"], "hit_rate_round_robin": rr["hit_rate"]}
    report(res)
    write_result(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

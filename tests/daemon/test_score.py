"""POST /score against a real ``kvtier daemon`` fed by vLLM's own ZmqEventPublisher.

Every wait is on the daemon's own counters (/stats: each source's ``next_seq`` reaches the
number of batches published), never on a clock. Engines are publishers (source + DP rank).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from connector.events import wire
from rigs.daemon_proc import DaemonProcess
from rigs.ports import free_port
from tests.daemon.vllm_required import import_vllm

pytestmark = pytest.mark.usefixtures("node_tables")  # the C node table and the dict

kv = import_vllm("vllm.distributed.kv_events")
kcu = import_vllm("vllm.v1.core.kv_cache_utils")
hashing = import_vllm("vllm.utils.hashing")

A, M = "full_attention", "mamba"


def stored(hashes: list[int], parent: int | None, block_size: int, *, medium: str = "GPU",
           group: int = 0, kind: str = A, ntok: int | None = None, cls: Any = None,
           **kw: Any) -> Any:
    """vLLM's BlockStored as its block pool (or kvtier's connector) shapes it."""
    n = block_size * len(hashes) if ntok is None else ntok
    return (cls or kv.BlockStored)(
        block_hashes=hashes, parent_block_hash=parent, token_ids=list(range(n)),
        block_size=block_size, lora_id=None, medium=medium, lora_name=None, group_idx=group,
        kv_cache_spec_kind=kind, **kw)


def placeholder(hashes: list[int], *, medium: str, group: int, kind: str = M) -> Any:
    """A state offloaded without a payload description (kvtier's Mamba announcements)."""
    return kv.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[],
                          block_size=0, lora_id=None, medium=medium, lora_name=None,
                          group_idx=group, kv_cache_spec_kind=kind)


def removed(hashes: list[int], *, medium: str = "GPU", group: int = 0, **kw: Any) -> Any:
    return kv.BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group, **kw)


class BlockStored033(kv.BlockStored, tag="BlockStored"):
    """vLLM 0.33's BlockStored: 0.32's fields plus ``lookahead_token_ids``."""

    lookahead_token_ids: list[int] | None = None


def _ports(n: int) -> int:
    """A port P with P..P+n-1 free (vLLM offsets DP rank r to P + r)."""
    return free_port(span=n)


class Engines:
    """One daemon subscribed to named engines, each published by vLLM's own ZmqEventPublisher
    at one DP rank (the daemon subscribes to ranks 0..rank of it)."""

    def __init__(self, ranks: dict[str, int], **config: Any) -> None:
        self.ranks = ranks
        self.ports = {name: (_ports(r + 1), _ports(r + 1)) for name, r in ranks.items()}
        entries = [{"name": name, "endpoint": f"tcp://*:{p}", "replay_endpoint": f"tcp://*:{q}",
                    "dp_size": ranks[name] + 1} for name, (p, q) in self.ports.items()]
        fd, self.config = tempfile.mkstemp(prefix="kvtier-score-", suffix=".yaml")
        with os.fdopen(fd, "w") as fh:
            json.dump({"publishers": entries, **config}, fh)  # JSON is YAML
        self.daemon = DaemonProcess("--config", self.config, "--no-replay-on-start",
                                    "--replay-timeout", "3")
        self.pubs: dict[str, Any] = {}
        self.sent = dict.fromkeys(ranks, 0)

    def publisher(self, name: str) -> str:
        return f"{name}#dp{self.ranks[name]}"

    def start(self) -> Engines:
        for name, (p, q) in self.ports.items():  # vLLM binds, the daemon connects
            self.pubs[name] = kv.ZmqEventPublisher(
                data_parallel_rank=self.ranks[name], endpoint=f"tcp://*:{p}",
                replay_endpoint=f"tcp://*:{q}")
        self.daemon.start()
        for name in self.ranks:
            self._handshake(name)
        return self

    def _source(self, stats: dict[str, Any], name: str) -> dict[str, Any]:
        return next(s for s in stats["sources"]
                    if s["name"] == name and s["rank"] == self.ranks[name])

    def _handshake(self, name: str) -> None:
        """A PUB drops what it sends before the SUB's subscription reaches it: send one-frame
        probes on vLLM's PUB (before its thread first uses it) until the daemon counts one."""
        base = self._source(self.daemon.stats(), name)["received"]
        for _ in range(400):
            self.pubs[name]._pub.send_multipart([b"kvtier-test-handshake"])
            try:
                self.daemon.wait_for(lambda s: self._source(s, name)["received"] > base,
                                     timeout=0.25, what=f"{name}'s handshake probe")
                return
            except AssertionError:
                continue
        raise AssertionError(f"the daemon never received a probe from {name}")

    def publish(self, name: str, *events: Any) -> None:
        self.pubs[name].publish(kv.KVEventBatch(ts=time.time(), events=list(events)))
        self.sent[name] += 1

    def settle(self) -> dict[str, Any]:
        """Wait until every published batch is applied; return that /stats snapshot."""
        def done(s: dict[str, Any]) -> bool:
            return all(self._source(s, n)["next_seq"] == self.sent[n]
                       and not self._source(s, n)["replaying"] for n in self.ranks)
        return self.daemon.wait_for(done, what=f"batches applied: {self.sent}")

    def score(self, body: Any) -> dict[str, Any]:
        status, out = self.daemon.post("/score", body)
        assert status == 200, out
        return out

    def by_engine(self, body: Any) -> dict[str, dict[str, Any]]:
        return {e["publisher"]: e for e in self.score(body)["engines"]}

    def close(self) -> None:
        for p in self.pubs.values():
            p.shutdown()
        self.daemon.kill()
        os.unlink(self.config)


@pytest.fixture
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    ranks, config = request.param
    e = Engines(ranks, **config).start()
    yield e
    e.close()


def order(out: dict[str, Any]) -> list[str]:
    return [e["publisher"] for e in out["engines"]]


@pytest.mark.parametrize("engines", [({"a": 0, "b": 1}, {})], indirect=True)
def test_two_engines_ranked_and_weights_decide(engines: Engines) -> None:
    a, b = engines.publisher("a"), engines.publisher("b")  # b is DP rank 1 of its source
    chain = [11, 12, 13, 14]
    engines.publish("a", stored([11, 12, 13], None, 16))  # 48 tokens on the GPU
    engines.publish("b", stored([11], None, 16),  # 16 on the GPU, 64 in its CPU tier
                    stored([11, 12, 13, 14], None, 16, medium="CPU", ownership="kvtier"))
    engines.settle()

    out = engines.score({"block_hashes": chain})
    assert order(out) == [b, a]  # 16 x 1.0 + 48 x 0.8 = 54.4 > 48
    e = {x["publisher"]: x for x in out["engines"]}
    assert e[a]["tokens"] == {"GPU": 48, "CPU": 0, "STORAGE": 0} and e[a]["score"] == 48
    assert e[b]["tokens"] == {"GPU": 16, "CPU": 64, "STORAGE": 0}
    assert e[b]["score"] == pytest.approx(16 + 0.8 * 48) and e[b]["cached_tokens"] == 64
    assert out["weights"] == {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}

    out = engines.score({"block_hashes": chain, "weights": {"cpu": 0.5}})  # 16 + 24 < 48
    assert order(out) == [a, b] and out["engines"][1]["score"] == pytest.approx(40)

    # The engine's CPU copy goes; the GPU copy of b drops too: a alone holds anything.
    engines.publish("b", removed([11, 12, 13, 14], medium="CPU", ownership="kvtier"),
                    removed([11]))
    engines.settle()
    out = engines.score({"block_hashes": chain})
    assert order(out) == [a, b] and out["engines"][1]["score"] == 0
    # A chain nobody holds: every engine listed, all zero, ranked by name.
    out = engines.score({"block_hashes": [99, 98]})
    assert order(out) == [a, b] and {x["score"] for x in out["engines"]} == {0}


@pytest.mark.parametrize("engines", [({"t": 0}, {})], indirect=True)
def test_gpu_cpu_storage_tokens_each_count_once_at_their_best_tier(engines: Engines) -> None:
    t = engines.publisher("t")
    engines.publish("t", stored([21], None, 16),
                    stored([21, 22], None, 16, medium="CPU", ownership="kvtier"),
                    stored([21, 22, 23, 24], None, 16, medium="STORAGE", ownership="kvtier"))
    engines.settle()
    chain = [21, 22, 23, 24, 25]
    e = engines.by_engine({"block_hashes": chain})[t]
    assert e["tokens"] == {"GPU": 16, "CPU": 32, "STORAGE": 64}
    assert e["score"] == pytest.approx(16 * 1.0 + 16 * 0.8 + 32 * 0.5)
    e = engines.by_engine({"block_hashes": chain,
                           "weights": {"GPU": 1, "CPU": 0, "STORAGE": 1}})[t]
    assert e["score"] == 64  # Redis holds all 64 at weight 1: the CPU tier adds nothing
    e = engines.by_engine({"block_hashes": chain, "weights": {"STORAGE": 2}})[t]
    assert e["score"] == 128  # weighted above the GPU now: every token counts at 2


@pytest.mark.parametrize("engines", [({"p": 0, "q": 0}, {"block_sizes": {0: 64}})],
                         indirect=True)
def test_partial_tail_ends_the_prefix_exactly(engines: Engines) -> None:
    """Block 64, hash unit 16: chain hash i covers 16 (i + 1) tokens."""
    p, q = engines.publisher("p"), engines.publisher("q")
    h = [0, *range(101, 113)]  # h[i] covers 16 i tokens
    engines.publish("p", stored([h[4]], None, 64),  # FULL, 64 tokens
                    stored([h[5]], h[4], 16),  # PARTIAL at 80, then one at 96
                    stored([h[6]], h[5], 16), removed([h[5]]),
                    stored([h[12]], h[8], 64))  # FULL at 192: never reached (no block 1)
    engines.publish("q", stored([h[4]], None, 64))
    s = engines.settle()
    assert s["index"]["by_medium_kind"]["GPU/PARTIAL"] == 1
    chain = h[1:]
    out = engines.score({"block_hashes": chain, "hash_block_size": 16})
    assert order(out) == [p, q]
    e = {x["publisher"]: x for x in out["engines"]}
    assert e[p]["tokens"]["GPU"] == 96 and e[p]["partial"]["GPU"] is True  # not 80, not 128
    assert e[q]["tokens"]["GPU"] == 64 and e[q]["partial"]["GPU"] is False
    # A request that diverges after 80 tokens: the partial at 96 is not its prefix.
    other = [*h[1:6], 777, 778, 779, *h[9:]]
    assert engines.by_engine({"block_hashes": other, "hash_block_size": 16})[p]["tokens"] == {
        "GPU": 64, "CPU": 0, "STORAGE": 0}
    # Block-granular chain (the default unit is the block size): whole blocks only.
    assert engines.by_engine({"block_hashes": [h[4], h[8]]})[p]["tokens"]["GPU"] == 64


HYBRID = {"block_sizes": {0: 64, 1: 64}, "token_hashing": {"algo": "sha256",
                                                           "hash_block_size": 32}}


def vllm_chain(tokens: list[int], unit: int) -> list[int]:
    """The block hashes vLLM's own code computes (sha256, no PYTHONHASHSEED) as on the wire."""
    fn = hashing.get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)
    parent, out = None, []
    for i in range(len(tokens) // unit):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * unit:(i + 1) * unit], None)
        out.append(kcu.maybe_convert_block_hash(parent))
    return out


@pytest.mark.parametrize("engines", [({"hybrid": 0, "attn": 0}, HYBRID)], indirect=True)
def test_hybrid_engine_counts_only_where_every_group_restores(
        engines: Engines, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 0 attention, group 1 Mamba (block 64, hash unit 32): a prefix counts only up to
    an end where the attention blocks (and the partial entry inside a block) and the Mamba
    state at exactly that end are all resident."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    hyb, att = engines.publisher("hybrid"), engines.publisher("attn")
    tokens = [(i * 7919) % 50_000 for i in range(200)]
    h = [0, *vllm_chain(tokens, 32)]  # h[i] covers 32 i tokens; 6 hashes
    attention = [stored([h[2], h[4]], None, 64, ntok=128),  # FULL at 64, 128
                 stored([h[5]], h[4], 32)]  # PARTIAL at 160
    engines.publish("hybrid", *attention, stored([h[2]], None, 64, group=1, kind=M))
    engines.publish("attn", *attention)
    engines.settle()
    body = {"token_ids": tokens}
    out = engines.score(body)
    e = {x["publisher"]: x for x in out["engines"]}
    assert out["unit"] == 32 and e[hyb]["groups"] == [0, 1] and e[att]["groups"] == [0]
    assert e[att]["tokens"]["GPU"] == 160 and e[att]["partial"]["GPU"] is True
    assert e[hyb]["tokens"]["GPU"] == 64  # the only Mamba state is at 64
    assert order(out) == [att, hyb]

    # The Mamba state at 160 (vLLM's partial shape in group 1): 160 restorable, a partial end.
    engines.publish("hybrid", stored([h[5]], h[4], 32, group=1, kind=M))
    engines.settle()
    e = engines.by_engine(body)[hyb]
    assert e["tokens"]["GPU"] == 160 and e["partial"]["GPU"] is True
    # The state at 160 leaves, one at 128 arrives: 128, a whole-block end.
    engines.publish("hybrid", removed([h[5]], group=1), stored([h[4]], h[2], 64, group=1,
                                                               kind=M))
    engines.settle()
    e = engines.by_engine(body)[hyb]
    assert e["tokens"]["GPU"] == 128 and e["partial"]["GPU"] is False
    # Asked for the attention group only, the hybrid engine is walked as attention alone.
    assert engines.by_engine({**body, "group_idx": 0})[hyb]["tokens"]["GPU"] == 160

    # kvtier's CPU tier: attention blocks as vLLM shapes them, Mamba states as placeholders.
    engines.publish("hybrid", stored([h[2], h[4]], None, 64, ntok=128, medium="CPU"),
                    placeholder([h[2]], medium="CPU", group=1))
    engines.settle()
    e = engines.by_engine(body)[hyb]
    assert e["tokens"] == {"GPU": 128, "CPU": 64, "STORAGE": 0}
    assert e["score"] == 128  # the CPU's 64 tokens are on the GPU already


@pytest.mark.parametrize("engines", [({"e": 0}, {"block_sizes": {0: 64}})], indirect=True)
def test_store_with_unknown_parent_is_cut_at_the_gap(engines: Engines) -> None:
    """vLLM #58119: a store names a parent that was never announced. The index keeps it (as an
    orphan) and a score never counts past a hash of the chain that is not resident."""
    pub = engines.publisher("e")
    h = [0, *range(201, 213)]  # unit 16: h[i] covers 16 i tokens
    chain = h[1:]
    body = {"block_hashes": chain, "hash_block_size": 16}
    engines.publish("e", stored([h[4]], None, 64),
                    stored([h[7]], h[6], 16),  # PARTIAL at 112; h[6] (96) never announced
                    stored([h[12]], h[8], 64))  # FULL at 192; block 2 (h[8]) never announced
    s = engines.settle()
    assert s["index"]["orphans"] >= 1 and s["index"]["invalid_events"] == 0
    assert s["decode_errors"] == 0 and s["publishers"][pub]["invalid_events"] == 0
    e = engines.by_engine(body)[pub]
    # The partial's own hash is the chain's hash at 112: it ends the prefix there. Block 2 is
    # missing, so the FULL entry at 192 is never reached.
    assert e["tokens"]["GPU"] == 112 and e["partial"]["GPU"] is True
    lookup = engines.daemon.lookup(chain, hash_block_size=16)["GPU"]
    assert lookup["tokens"] == 112

    # The missing block arrives: the orphan gets its position and the chain is whole to 192.
    engines.publish("e", stored([h[8]], h[4], 64))
    engines.settle()
    e = engines.by_engine(body)[pub]
    assert e["tokens"]["GPU"] == 192 and e["partial"]["GPU"] is False
    # A parent nobody will ever announce, in a group the engine already has: still no harm.
    engines.publish("e", stored([5001, 5002], 4999, 64, ntok=128))
    s = engines.settle()
    assert s["index"]["invalid_events"] == 0
    assert engines.by_engine(body)[pub]["tokens"]["GPU"] == 192


@pytest.mark.parametrize("engines", [({"new": 0, "old": 0}, {})], indirect=True)
def test_vllm_033_block_stored_decodes_beside_032(engines: Engines) -> None:
    """0.33's BlockStored adds ``lookahead_token_ids``: sent by vLLM's publisher, it decodes
    and counts like 0.32's."""
    new, old = engines.publisher("new"), engines.publisher("old")
    engines.publish("new", stored([31, 32], None, 16, cls=BlockStored033,
                                  lookahead_token_ids=[7, 8, 9]),
                    stored([33], 32, 16, cls=BlockStored033))
    engines.publish("old", stored([31, 32], None, 16))
    s = engines.settle()
    assert s["decode_errors"] == 0
    assert s["publishers"][new]["stored_events"] == 2
    assert s["publishers"][new]["invalid_events"] == 0
    out = engines.score({"block_hashes": [31, 32, 33]})
    assert [(e["publisher"], e["tokens"]["GPU"]) for e in out["engines"]] == [
        (new, 48), (old, 32)]
    # The same event in the older array form with 0.33's extra trailing field.
    ev = stored([31], None, 16, cls=BlockStored033, lookahead_token_ids=[1])
    arr = ["BlockStored", *(getattr(ev, f) for f in BlockStored033.__struct_fields__)]
    payload = msgspec.msgpack.encode([1.0, [arr], 0])
    for decoded in (wire.decode_batch(payload), wire.BatchDecoder().decode(payload)):
        assert decoded.events[0].block_hashes == [31]
        assert decoded.events[0].kv_cache_spec_kind == A


@pytest.mark.parametrize("engines", [({"x": 0}, {"token_hashing": {"hash_block_size": 16}})],
                         indirect=True)
def test_bad_bodies_get_400_naming_the_field(engines: Engines) -> None:
    engines.publish("x", stored([1, 2], None, 16))
    engines.settle()
    d = engines.daemon
    for body, field in [
        (b"{not json", "not valid JSON"),
        ([1, 2], "JSON object"),
        ({}, "'block_hashes' or 'token_ids'"),
        ({"block_hashes": "x"}, "'block_hashes'"),
        ({"block_hashes": [1, True]}, "block_hashes[1]"),
        ({"block_hashes": ["zz"]}, "block_hashes[0]"),
        ({"token_ids": [1, -2]}, "'token_ids'"),
        ({"token_ids": "abc"}, "'token_ids'"),
        ({"token_ids": [1], "block_hashes": [1]}, "'token_ids'"),
        ({"block_hashes": [1], "hash_block_size": 0}, "'hash_block_size'"),
        ({"block_hashes": [1], "hash_block_size": 24}, "'hash_block_size'"),
        ({"block_hashes": [1], "group_idx": "0"}, "'group_idx'"),
        ({"block_hashes": [1], "group_idx": [0, -1]}, "'group_idx'"),
        ({"block_hashes": [1], "group_idx": []}, "'group_idx'"),
        ({"block_hashes": [1], "weights": [1.0]}, "'weights'"),
        ({"block_hashes": [1], "weights": {"GPU": -1}}, "'weights.GPU'"),
        ({"block_hashes": [1], "weights": {"CPU": "high"}}, "'weights.CPU'"),
        ({"block_hashes": [1], "weights": {"CPU": True}}, "'weights.CPU'"),
        ({"block_hashes": [1], "bogus": 1}, "bogus"),
    ]:
        status, out = d.post("/score", body)
        assert status == 400 and field in out["error"], (body, out)
    assert engines.score({"block_hashes": [1, 2]})["engines"][0]["tokens"]["GPU"] == 32


def test_score_follows_the_index_between_calls() -> None:
    """What scoring caches per engine (groups, block sizes, entry dicts) follows the index: a
    block size learned later, a new medium, a dict emptied and refilled, a cleared engine."""
    from connector.events.index import STORE, KVIndex, Run
    from connector.events.score import score_engines
    from offload_tiers.keys import BlockKind

    idx = KVIndex()
    gpu, cpu = ("e#dp0", "GPU", 0, None), ("e#dp0", "CPU", 0, None)
    chain = [11, 12, 13, 14]

    def tokens() -> dict[str, int]:
        (s,) = score_engines(idx, chain, unit=16)
        return {m: p.tokens for m, p in s.media.items() if p.tokens}

    idx.store(Run(STORE, gpu, chain[:2], None, 16, 16, BlockKind.FULL))
    assert score_engines(idx, chain, unit=16)[0].note == "block size of group 0 not known yet"
    idx.sizes.learned[("e#dp0", 0)] = 32
    assert tokens() == {"GPU": 32}
    idx.store(Run(STORE, cpu, chain, None, 16, 16, BlockKind.FULL))
    assert tokens() == {"GPU": 32, "CPU": 64}
    idx.remove(gpu, chain[:2])
    assert tokens() == {"CPU": 64}
    idx.store(Run(STORE, gpu, chain[:2], None, 16, 16, BlockKind.FULL))
    assert tokens() == {"GPU": 32, "CPU": 64}
    idx.clear("e#dp0", ["CPU"])
    assert tokens() == {"GPU": 32}

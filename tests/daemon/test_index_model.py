"""Hypothesis stateful test: classifier + index against a small reference model.

A world of prompts hashed like vLLM (one chain hash per ``U`` tokens; a full block of
``B`` tokens is named by the hash at its end). Several publishers announce full chunks,
partial entries, repeats, out-of-order children, removals (known and unknown), clears and
partial->full promotions, interleaved at random. After every step the index's refcounts
equal the reference (a multiset where residency is refcounted: GPU; a set where it is one
entry per key: CPU and STORAGE, and GPU of ``pubB``, configured as
``kv_cache_report_mode: full``), and look-ups equal (configured block size) or never exceed
(learned block size) the reference answer. ``AllBlocksCleared`` clears GPU only.
"""

from __future__ import annotations

import hashlib
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from connector.events.classify import Classifier
from connector.events.index import ANY, GroupSizes, KVIndex, ResidencyPolicy
from connector.events.wire import BlockRemoved, BlockStored
from tests.support.events import apply, scan_entry_counts

U = 8  # hash unit (prefix_match_unit)
B = 32  # physical block size of group 0
PROMPT_UNITS = 12  # prompts of 96 tokens: 3 blocks
PUBS = ("pubA#dp0", "pubA#dp1", "pubB#dp0")
MEDIA = ("GPU", "CPU", "STORAGE")
SET_MEDIA = {"pubA": {"CPU", "STORAGE"}, "pubB": {"GPU", "CPU", "STORAGE"}}


def is_set(pub: str, medium: str) -> bool:
    return medium in SET_MEDIA[pub.split("#")[0]]


def chain(prompt: int) -> list[int]:
    """Unit chain hashes of a prompt: element k covers (k+1)*U tokens."""
    out = []
    for k in range(1, PROMPT_UNITS + 1):
        digest = hashlib.blake2b(f"{prompt}:{k}".encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "big"))
    return out


PROMPTS = {p: chain(p) for p in range(4)}


def hash_at(prompt: int, tokens: int) -> int:
    return PROMPTS[prompt][tokens // U - 1]


class IndexModel(RuleBasedStateMachine):
    configured = True
    dict_table = False  # the index's node table: C where built (node_table), or a dict

    def __init__(self) -> None:
        super().__init__()
        sizes = GroupSizes({0: B} if self.configured else None)
        self.index = KVIndex(sizes, policy=ResidencyPolicy(by_source=SET_MEDIA))
        if self.dict_table:
            self.index.nodes = {}  # empty still: the pure-Python path, as KVTIER_PURE_PYTHON_INDEX
        self.classifier = Classifier(self.index)
        self.ref: dict[tuple[str, str], Counter[int]] = {}
        self.truth_kind: dict[int, str] = {}

    def _apply(self, pub: str, event: object) -> None:
        run = self.classifier.classify(pub, event)
        assert run is not None
        apply(self.index, run)

    def _ref(self, pub: str, medium: str) -> Counter[int]:
        return self.ref.setdefault((pub, medium), Counter())

    def _announce(self, pub: str, medium: str, hashes: list[int]) -> None:
        c = self._ref(pub, medium)
        for h in hashes:
            c[h] = 1 if is_set(pub, medium) else c[h] + 1

    def _removed(self, pub: str, medium: str, hashes: list[int]) -> None:
        c = self.ref[(pub, medium)]
        for h in hashes:
            c[h] = 0 if is_set(pub, medium) else c[h] - 1
            if c[h] == 0:
                del c[h]

    @rule(pub=st.sampled_from(PUBS), medium=st.sampled_from(MEDIA),
          prompt=st.sampled_from(list(PROMPTS)), start=st.integers(0, 2),
          nblocks=st.integers(1, 3))
    def store_full(self, pub: str, medium: str, prompt: int, start: int, nblocks: int) -> None:
        nblocks = min(nblocks, 3 - start)
        hashes = [hash_at(prompt, (start + i + 1) * B) for i in range(nblocks)]
        parent = hash_at(prompt, start * B) if start else None
        self._apply(pub, BlockStored(hashes, parent, [0] * (B * nblocks), B, None, medium,
                                     None, group_idx=0))
        self._announce(pub, medium, hashes)
        for h in hashes:
            self.truth_kind[h] = "FULL"

    @rule(pub=st.sampled_from(PUBS), medium=st.sampled_from(MEDIA),
          prompt=st.sampled_from(list(PROMPTS)), units=st.integers(1, PROMPT_UNITS))
    def store_partial(self, pub: str, medium: str, prompt: int, units: int) -> None:
        tokens = units * U
        if tokens % B == 0:
            tokens -= U
        h = hash_at(prompt, tokens)
        parent = hash_at(prompt, tokens - U) if tokens > U else None
        self._apply(pub, BlockStored([h], parent, [0] * U, U, None, medium, None,
                                     group_idx=0))
        self._announce(pub, medium, [h])
        self.truth_kind[h] = "PARTIAL"

    @precondition(lambda self: any(self.ref.values()))
    @rule(data=st.data())
    def remove_some(self, data: st.DataObject) -> None:
        keys = sorted(k for k, c in self.ref.items() if c)
        pub, medium = data.draw(st.sampled_from(keys))
        c = self.ref[(pub, medium)]
        hashes = data.draw(st.lists(st.sampled_from(sorted(c)), min_size=1, max_size=4,
                                    unique=True))
        self._apply(pub, BlockRemoved(hashes, medium, group_idx=0))
        self._removed(pub, medium, hashes)

    @precondition(lambda self: any(self.ref.values()))
    @rule(data=st.data(), stranger=st.integers(1, 2**64 - 1))
    def remove_mixed(self, data: st.DataObject, stranger: int) -> None:
        """A removal mixing resident hashes with one never announced there."""
        keys = sorted(k for k, c in self.ref.items() if c)
        pub, medium = data.draw(st.sampled_from(keys))
        c = self.ref[(pub, medium)]
        if stranger in c:
            return
        hashes = data.draw(st.lists(st.sampled_from(sorted(c)), min_size=1, max_size=3,
                                    unique=True))
        before = self.index.unknown_removals
        self._apply(pub, BlockRemoved([*hashes, stranger], medium, group_idx=0))
        assert self.index.unknown_removals == before + 1
        self._removed(pub, medium, hashes)

    @rule(pub=st.sampled_from(PUBS), medium=st.sampled_from(MEDIA),
          h=st.integers(1, 2**64 - 1))
    def remove_unknown(self, pub: str, medium: str, h: int) -> None:
        known = self._ref(pub, medium)
        if h in known:
            return
        before = self.index.unknown_removals
        self._apply(pub, BlockRemoved([h], medium, group_idx=0))
        assert self.index.unknown_removals == before + 1

    @rule(pub=st.sampled_from(PUBS), medium=st.sampled_from(MEDIA),
          prompt=st.sampled_from(list(PROMPTS)), block=st.integers(0, 2))
    def promote(self, pub: str, medium: str, prompt: int, block: int) -> None:
        """vLLM's partial->full promotion: BlockRemoved(partial) then BlockStored(full)."""
        partial_tokens = block * B + B - U
        hp = hash_at(prompt, partial_tokens)
        c = self._ref(pub, medium)
        if c[hp] == 0:
            self.store_partial(pub, medium, prompt, partial_tokens // U)
        self._apply(pub, BlockRemoved([hp], medium, group_idx=0))
        self._removed(pub, medium, [hp])
        self.store_full(pub, medium, prompt, block, 1)

    @rule(pub=st.sampled_from(PUBS))
    def clear(self, pub: str) -> None:
        run = self.classifier.classify(pub, _cleared())
        apply(self.index, run)
        for key in [k for k in self.ref if k[0] == pub and k[1] == "GPU"]:
            del self.ref[key]  # vLLM's GPU reset: the publisher's CPU/STORAGE copies stay

    @invariant()
    def refcounts_match(self) -> None:
        for (pub, medium), c in self.ref.items():
            for h, n in c.items():
                assert self.index.refcount((pub, medium, 0, None), h) == n
        total = sum(len(c) for c in self.ref.values())
        assert self.index.n_entries == total
        assert self.index.entry_counts() == scan_entry_counts(self.index)

    def _truth(self, prompt: int, media: tuple[str, ...]) -> tuple[int, int, bool]:
        resident = set()
        for (_pub, medium), c in self.ref.items():
            if medium in media:
                resident.update(c)
        full = 0
        while full < 3 and hash_at(prompt, (full + 1) * B) in resident:
            full += 1
        partial = 0
        for t in range(full * B + U, min(full * B + B, PROMPT_UNITS * U + 1), U):
            if hash_at(prompt, t) in resident and self.truth_kind.get(hash_at(prompt, t)) \
                    == "PARTIAL":
                partial = t
        if partial:
            return partial, full, True
        return full * B, full, False

    @invariant()
    def lookups_match_reference(self) -> None:
        for prompt in PROMPTS:
            fine = self.index.lookup(PROMPTS[prompt], group=0, unit=U)
            coarse = self.index.lookup([hash_at(prompt, (i + 1) * B) for i in range(3)],
                                       group=0)
            for medium in (*MEDIA, ANY):
                media = MEDIA if medium == ANY else (medium,)
                tokens, full, partial = self._truth(prompt, media)
                got = fine[medium]
                if self.configured:
                    assert (got.tokens, got.full_blocks, got.partial) == (tokens, full, partial)
                    assert coarse[medium].tokens == full * B
                else:  # learned block size: may know less, never more
                    assert got.tokens <= tokens and got.full_blocks <= full
                    assert coarse[medium].tokens <= full * B
                    if got.full_blocks:
                        assert got.full_blocks * B <= full * B


def _cleared() -> object:
    from connector.events.wire import AllBlocksCleared

    return AllBlocksCleared()


class LearnedIndexModel(IndexModel):
    configured = False


class DictIndexModel(IndexModel):
    dict_table = True


class DictLearnedIndexModel(LearnedIndexModel):
    dict_table = True


_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestIndexModelConfigured = IndexModel.TestCase
TestIndexModelConfigured.settings = _settings
TestIndexModelLearned = LearnedIndexModel.TestCase
TestIndexModelLearned.settings = _settings
TestIndexModelConfiguredDict = DictIndexModel.TestCase
TestIndexModelConfiguredDict.settings = _settings
TestIndexModelLearnedDict = DictLearnedIndexModel.TestCase
TestIndexModelLearnedDict.settings = _settings

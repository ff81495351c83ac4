"""The mutants RELIABILITY.md names, each with the tests that must fail under it.

A mutant is a monkeypatch of one production check, applied in a pytest subprocess by
:mod:`tests.mutants.apply` (``KVTIER_MUTANT=<name>``). Patches import production modules
lazily, so reading this table imports nothing from kvtier. Hypothesis tests in ``kills``
run with a pinned seed (see :mod:`tests.mutants.apply`), so a verdict is the same on every run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest


class Mutant(NamedTuple):
    name: str
    claim: str  # where RELIABILITY.md claims it
    patch: Callable[[pytest.MonkeyPatch], None]
    kills: tuple[str, ...]  # pytest node ids; every test they select must fail


def _codec_ignores_kind_and_num_tokens(mp: pytest.MonkeyPatch) -> None:
    """check_header judges the header against the key's kind/num_tokens as stored, i.e.
    never rejects a value for another kind or another num_tokens."""
    from offload_tiers import codec
    from offload_tiers.keys import BlockKind

    original = codec.check_header

    def check_header(key: Any, header: Any, **kw: Any) -> tuple[int, int]:
        if memoryview(header).nbytes >= codec.HEADER_SIZE:
            f = codec.parse_header(header)
            if f.kind in (int(BlockKind.FULL), int(BlockKind.PARTIAL)) and f.num_tokens:
                key = dataclasses.replace(key, kind=BlockKind(f.kind), num_tokens=f.num_tokens)
        return original(key, header, **kw)

    mp.setattr(codec, "check_header", check_header)


def _classifier_partial_as_full(mp: pytest.MonkeyPatch) -> None:
    """Every PARTIAL store the classifier hands the index is counted as FULL."""
    from connector.events import classify

    original = classify.Classifier.classify

    def patched(self: Any, publisher: Any, event: Any) -> Any:
        run = original(self, publisher, event)
        if run is not None and run.op == classify.STORE and run.kind == classify.PARTIAL:
            run = run._replace(kind=classify.FULL)
        return run

    mp.setattr(classify.Classifier, "classify", patched)


def _policy_is_set(value: bool) -> Callable[[pytest.MonkeyPatch], None]:
    def patch(mp: pytest.MonkeyPatch) -> None:
        from connector.events.index import ResidencyPolicy

        mp.setattr(ResidencyPolicy, "is_set", lambda self, key: value)

    return patch


def _clear_all_media(mp: pytest.MonkeyPatch) -> None:
    """AllBlocksCleared drops the publisher's entries on every medium, not GPU only."""
    from connector.events.index import KVIndex

    original = KVIndex.clear
    mp.setattr(KVIndex, "clear", lambda self, publisher, mediums=None: original(self, publisher))


def _first_learned_block_size(mp: pytest.MonkeyPatch) -> None:
    """A look-up without ``publisher`` walks every publisher with the first block size learned."""
    from connector.events.index import KVIndex

    original = KVIndex._size_classes

    def patched(self: Any, group: int, publisher: Any) -> dict[int, Any]:
        classes = original(self, group, publisher)
        if publisher is None and len(classes) > 1:
            return {next(iter(classes)): None}
        return classes

    mp.setattr(KVIndex, "_size_classes", patched)


def _lookup_without_expiry(mp: pytest.MonkeyPatch) -> None:
    """The daemon's look-up skips ``index.expire`` (entries past their TTL are claimed)."""
    from connector.daemon.service import Daemon
    from connector.events.index import KVIndex

    original = Daemon.lookup

    def lookup(self: Any, req: Any) -> Any:
        with pytest.MonkeyPatch.context() as inner:
            inner.setattr(KVIndex, "expire", lambda index, now: 0)
            return original(self, req)

    mp.setattr(Daemon, "lookup", lookup)


def _janitor_plain_unlink(mp: pytest.MonkeyPatch) -> None:
    """The conditional delete (type, length, header unchanged) becomes a plain UNLINK."""
    from offload_tiers.redis import janitor as redis_janitor

    mp.setattr(redis_janitor, "_LUA_DELETE_IF_SAME", "return redis.call('UNLINK', KEYS[1])")


def _pacer_never_sleeps(mp: pytest.MonkeyPatch) -> None:
    """The janitor's pacer keeps its books but its sleep does nothing."""
    from offload_tiers.redis.janitor import Pacer

    original = Pacer.__init__

    def init(self: Any, rate: float, clock: Any, sleep: Any) -> None:
        original(self, rate, clock, lambda seconds: None)

    mp.setattr(Pacer, "__init__", init)


def _glob_unescaped(mp: pytest.MonkeyPatch) -> None:
    """The janitor's SCAN MATCH pattern is built from the prefix without escaping."""
    from offload_tiers.redis import janitor as redis_janitor

    mp.setattr(redis_janitor, "_glob_escape", lambda raw: raw)


CODEC = "tests/tiers/test_codec.py"
REDIS_SM = "tests/tiers/test_redis_stateful.py"
MODEL = "tests/daemon/test_index_model.py"
POLICY = "tests/daemon/test_index_policy.py"
CLASSIFY = "tests/daemon/test_classify.py"
JANITOR = "tests/daemon/test_redis_janitor.py"
BOTH_MODELS = (f"{MODEL}::TestIndexModelConfigured::runTest",
               f"{MODEL}::TestIndexModelLearned::runTest")

MUTANTS: dict[str, Mutant] = {m.name: m for m in [
    Mutant("codec-kind-num-tokens", "Redis tier (hypothesis, stateful) rows",
           _codec_ignores_kind_and_num_tokens,
           (f"{CODEC}::test_bad_values_are_corrupt[kind]",
            f"{CODEC}::test_bad_values_are_corrupt[num_tokens]",
            f"{CODEC}::test_partial_value_never_answers_full_lookup",
            "tests/tiers/test_redis_tier.py::test_partial_value_does_not_answer_full_lookup",
            f"{REDIS_SM}::test_redis_tier_matches_reference_under_failures")),
    Mutant("index-partial-as-full", "daemon row 10", _classifier_partial_as_full,
           (f"{MODEL}::TestIndexModelConfigured::runTest",
            f"{CLASSIFY}::test_partial_kind_and_num_tokens_from_parent_never_from_hash_presence",
            f"{CLASSIFY}::test_single_hash_is_pending_until_block_size_known_then_resolved")),
    Mutant("index-repeats-not-refcounted", "daemon row 10", _policy_is_set(True),
           (*BOTH_MODELS,
            f"{POLICY}::test_gpu_is_refcounted_unless_the_publisher_reports_in_full_mode",
            f"{CLASSIFY}::test_repeats_refcount_per_residency_key_and_unknown_removal_is_harmless")),
    Mutant("index-every-key-refcounted", "D18", _policy_is_set(False),
           (*BOTH_MODELS, f"{POLICY}::test_tier_media_are_sets",
            f"{POLICY}::test_gpu_is_refcounted_unless_the_publisher_reports_in_full_mode",
            f"{POLICY}::test_storage_ttl_expires_refreshes_and_forgets_removed_entries",
            f"{POLICY}::test_daemon_config_builds_the_policy")),
    Mutant("index-clear-all-media", "D21", _clear_all_media,
           (*BOTH_MODELS, f"{POLICY}::test_all_blocks_cleared_drops_gpu_entries_only")),
    Mutant("index-first-learned-block-size", "D22", _first_learned_block_size,
           (f"{POLICY}::test_lookup_walks_each_publisher_with_its_own_block_size",)),
    Mutant("daemon-lookup-without-expiry", "D19", _lookup_without_expiry,
           (f"{POLICY}::test_a_lookup_never_claims_an_entry_past_its_ttl",)),
    Mutant("janitor-plain-unlink", "J4, D24", _janitor_plain_unlink,  # the race test
           # (-k concurrent) is not listed: whether a race loses a value is not certain
           (f"{JANITOR}::test_value_replaced_by_a_good_one_before_the_delete_is_kept",)),
    Mutant("janitor-pacer-never-sleeps", "J10", _pacer_never_sleeps,
           (f"{JANITOR}::test_scan_is_paced_to_max_keys_per_s",)),
    Mutant("janitor-glob-unescaped", "J12", _glob_unescaped,
           (f"{JANITOR}::test_glob_characters_in_the_prefix_match_literally",)),
]}

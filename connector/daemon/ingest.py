"""Decode -> classify -> index for one payload: the daemon's hot path."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from connector.events.classify import Classifier
from connector.events.index import (
    CLEAR,
    REMOVE,
    STORE,
    GroupSizes,
    KVIndex,
    ResidencyPolicy,
    Run,
    publisher_id,
)
from connector.events.wire import BatchDecoder, DecodeError, Medium

__all__ = ["Ingestor", "PublisherStats"]

log = logging.getLogger("kvtier.daemon")
_GPU = Medium.GPU  # bound once: an Enum class attribute costs ~10x a global


@dataclass
class PublisherStats:
    """Per-publisher (source + DP rank) counters."""

    batches: int = 0
    stored_events: int = 0
    removed_events: int = 0
    cleared_events: int = 0
    invalid_events: int = 0
    # GPU stores from the chain start (parent None) of hashes all resident there already:
    # the shape of vLLM's kv_cache_report_mode="full" re-announcements (also, rarely, two
    # requests that computed the same prefix at once).
    reannounced_events: int = 0
    last_lag_s: float = 0.0
    max_lag_s: float = 0.0
    last_ts: float = 0.0
    extra: dict[str, int] = field(default_factory=dict)


class Ingestor:
    """Owns the decoder, classifier and index; ``ingest`` applies one payload.

    Not thread-safe: the daemon calls it from its single ingest thread under a lock that
    look-ups also take.
    """

    def __init__(self, block_sizes: dict[int, int] | None = None,
                 max_entries: int = 10_000_000, max_pending: int = 65536,
                 policy: ResidencyPolicy | None = None) -> None:
        self.decoder = BatchDecoder()
        self.sizes = GroupSizes(block_sizes)
        self.index = KVIndex(self.sizes, max_entries=max_entries, policy=policy)
        self.classifier = Classifier(self.index, max_pending=max_pending)
        self.publishers: dict[str, PublisherStats] = {}
        self._names: dict[tuple[str, int], str] = {}
        self.decode_errors = 0

    def publisher_id(self, source: str, rank: int) -> str:
        """The publisher id of a source at a DP rank (:func:`publisher_id`), with its stats."""
        key = (source, rank)
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = publisher_id(source, rank)
            self.publishers[name] = PublisherStats()
        return name

    def ingest(self, source: str, default_rank: int, payload: bytes | memoryview,
               now: float | None = None) -> str:
        """Decode and apply one batch; return the publisher id. Raises :class:`DecodeError`."""
        try:
            batch = self.decoder.decode(payload)
        except DecodeError:
            self.decode_errors += 1
            raise
        rank = batch.data_parallel_rank
        if rank is None or rank < 0 or rank > 1_000_000:
            rank = default_rank
        pub = self.publisher_id(source, rank)
        st = self.publishers[pub]
        wall = time.time() if now is None else now
        ts = batch.ts
        valid_ts = math.isfinite(ts) and ts > 0
        # TTLs run from the announcement (the write came before it): the earlier clock wins.
        at = min(ts, wall) if valid_ts else wall
        classify = self.classifier.classify
        index = self.index
        res = index.res
        invalid_before = self.classifier.invalid_events
        n_store = n_remove = n_clear = 0
        for ev in batch.events:
            run = classify(pub, ev)
            if run is None:
                continue
            op = run.op
            if op == STORE:
                if run.key not in res:  # a new residency key: note its group's spec kind
                    index.note_group_kind((pub, run.key[2]), ev.kv_cache_spec_kind)
                again = index.store(run, at)
                n_store += 1
                if again and again == len(run.hashes) and run.parent is None \
                        and run.key[1] == _GPU:
                    self._reannounced(pub, st, run)
            elif op == REMOVE:
                index.remove(run.key, run.hashes)
                n_remove += 1
            elif op == CLEAR:  # vLLM's GPU block pool was reset: its offloaded copies stay
                index.clear(pub, (_GPU,))
                n_clear += 1
        st.batches += 1
        st.stored_events += n_store
        st.removed_events += n_remove
        st.cleared_events += n_clear
        st.invalid_events += self.classifier.invalid_events - invalid_before
        if valid_ts:
            lag = wall - ts
            st.last_lag_s = lag
            st.last_ts = ts
            if lag > st.max_lag_s:
                st.max_lag_s = lag
        return pub

    def restarted(self, source: str, rank: int, mediums: Iterable[str]) -> int:
        """A publisher restarted: drop its entries on ``mediums``; return how many."""
        return self.index.clear(self.publisher_id(source, rank), mediums)

    def expire(self, now: float) -> int:
        """Drop the index entries whose TTL ran out by ``now``; return how many."""
        return self.index.expire(now)

    def _reannounced(self, pub: str, st: PublisherStats, run: Run) -> None:
        st.reannounced_events += 1
        if st.reannounced_events == 1 and run.key not in self.index.set_keys:
            log.warning(
                "publisher %s re-announced %d GPU blocks that are all resident already, with "
                "no removal in between: the shape of vLLM's kv_cache_report_mode='full'. If "
                "its requests use that mode, set kv_cache_report_mode: full for it (else "
                "its GPU entries outlive their eviction); counted in /stats as "
                "reannounced_events", pub, len(run.hashes))

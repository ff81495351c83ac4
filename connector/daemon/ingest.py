"""Decode -> classify -> index for one payload: the daemon's hot path."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from connector.classify import CLEAR, REMOVE, STORE, Classifier, GroupSizes
from connector.events import BatchDecoder, DecodeError
from connector.index import KVIndex

__all__ = ["Ingestor", "PublisherStats"]


@dataclass
class PublisherStats:
    """Per-publisher (source + DP rank) counters."""

    batches: int = 0
    stored_events: int = 0
    removed_events: int = 0
    cleared_events: int = 0
    invalid_events: int = 0
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
                 max_entries: int = 10_000_000, max_pending: int = 65536) -> None:
        self.decoder = BatchDecoder()
        self.sizes = GroupSizes(block_sizes)
        self.index = KVIndex(self.sizes, max_entries=max_entries)
        self.classifier = Classifier(self.sizes, self.index, max_pending=max_pending)
        self.publishers: dict[str, PublisherStats] = {}
        self._names: dict[tuple[str, int], str] = {}
        self.decode_errors = 0

    def publisher_id(self, source: str, rank: int) -> str:
        """Stable publisher id for a source and DP rank: ``"{source}#dp{rank}"``."""
        key = (source, rank)
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = f"{source}#dp{rank}"
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
        classify = self.classifier.classify
        index = self.index
        invalid_before = self.classifier.invalid_events
        n_store = n_remove = n_clear = 0
        for ev in batch.events:
            run = classify(pub, ev)
            if run is None:
                continue
            op = run.op
            if op == STORE:
                index.store(run)
                n_store += 1
            elif op == REMOVE:
                index.remove(run.key, run.hashes)
                n_remove += 1
            elif op == CLEAR:
                index.clear(pub)
                n_clear += 1
        st.batches += 1
        st.stored_events += n_store
        st.removed_events += n_remove
        st.cleared_events += n_clear
        st.invalid_events += self.classifier.invalid_events - invalid_before
        ts = batch.ts
        if math.isfinite(ts) and ts > 0:
            lag = (time.time() if now is None else now) - ts
            st.last_lag_s = lag
            st.last_ts = ts
            if lag > st.max_lag_s:
                st.max_lag_s = lag
        return pub

"""The presence filter: no false "absent" within its window, a bounded false-positive rate
and memory, the oldest keys forgotten first (pure logic)."""

from __future__ import annotations

import numpy as np
import pytest

from offload_tiers.presence import (
    PresenceFilter,
    block_false_positive_rate,
    blocks_for,
    name_digest,
    pack_digests,
    unpack_digests,
)


def _digests(tag: str, n: int) -> list[int]:
    return [name_digest(f"{tag}:{i}".encode()) for i in range(n)]


def test_every_key_added_is_maybe_present_and_the_false_positive_rate_holds() -> None:
    f = PresenceFilter(capacity=20_000, fp_rate=0.01)
    added = _digests("in", 20_000)
    f.add_many(added)
    assert f.may_contain_many(added).all()  # never a false "absent"
    others = f.may_contain_many(_digests("out", 100_000))
    rate = float(others.mean())
    assert 0 < rate <= 0.01  # the documented bound, measured on 100k keys never added
    assert f.rotations == 0


def test_memory_at_the_documented_default() -> None:
    f = PresenceFilter()
    assert f.capacity == 1 << 20
    # two generations of the fewest 64-byte blocks that hold 2^20 keys at 0.5 % each:
    # 2 x 1.52 MB (docs/connector.md)
    assert 3_000_000 <= f.memory_bytes <= 3_050_000
    assert f.memory_bytes == 2 * f.num_blocks * 64


def test_the_block_count_is_the_fewest_that_keeps_the_rate() -> None:
    for capacity, rate in ((1 << 20, 0.005), (20_000, 0.005), (1_000, 0.02)):
        n = blocks_for(capacity, rate)
        assert block_false_positive_rate(capacity / n) <= rate
        assert block_false_positive_rate(capacity / (n - 1)) > rate


def test_the_last_capacity_keys_are_always_remembered_and_older_ones_go() -> None:
    f = PresenceFilter(capacity=1_000, fp_rate=0.01)
    stream = _digests("s", 3_500)
    for i in range(0, len(stream), 250):
        f.add_many(stream[i:i + 250])
        recent = stream[max(0, i + 250 - 1_000):i + 250]
        assert f.may_contain_many(recent).all()
    assert f.rotations == 3
    forgotten = f.may_contain_many(stream[:1_000])  # two generations ago
    assert forgotten.mean() <= 0.05


def test_one_key_at_a_time_answers_as_the_array_path_does_across_rotations() -> None:
    f = PresenceFilter(capacity=1_000, fp_rate=0.01)
    stream = _digests("one", 2_500)
    f.add_many(stream[:1_500])
    f.add_many(stream[1_500:])
    assert f.rotations == 2
    asked = stream + _digests("never", 5_000)
    batch = f.may_contain_many(asked)
    assert [f.may_contain(d) for d in asked] == batch.tolist()
    assert batch[1_500:2_500].all() and not batch[-5_000:].all()  # both answers occur


def test_digests_pack_and_a_torn_pack_is_refused() -> None:
    digests = _digests("p", 5)
    data = pack_digests(digests)
    assert len(data) == 40 and [int(d) for d in unpack_digests(data)] == digests
    with pytest.raises(ValueError, match="whole number"):
        unpack_digests(data[:-1])
    assert unpack_digests(b"").size == 0


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        PresenceFilter(capacity=0)
    with pytest.raises(ValueError, match="fp_rate"):
        PresenceFilter(fp_rate=1.5)
    assert PresenceFilter(capacity=10).may_contain_many(np.zeros(0, np.uint64)).size == 0

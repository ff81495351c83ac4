"""Block keys and the fullness rule: decided from num_tokens and position, never hash presence."""

from __future__ import annotations

import pytest

from offload_tiers.keys import (
    BlockKey,
    BlockKind,
    Namespace,
    hash_to_bytes,
    is_full_block,
    kind_for,
)


@pytest.mark.parametrize(
    ("num_tokens", "index", "block_size", "expected"),
    [
        (None, 0, 64, None),  # no hash at all
        (64, 0, 64, BlockKind.FULL),
        (32, 0, 64, BlockKind.PARTIAL),  # hash set, block half full
        (128, 1, 64, BlockKind.FULL),  # cumulative: block 1 ends at 128
        (96, 1, 64, BlockKind.PARTIAL),
        (65, 1, 64, BlockKind.PARTIAL),
    ],
)
def test_kind_for(num_tokens: int | None, index: int, block_size: int,
                  expected: BlockKind | None) -> None:
    assert kind_for(num_tokens, index, block_size) is expected
    assert is_full_block(num_tokens, index, block_size) is (expected is BlockKind.FULL)


@pytest.mark.parametrize(("num_tokens", "index"), [(129, 1), (64, 1), (0, 0)])
def test_kind_for_rejects_counts_outside_the_block(num_tokens: int, index: int) -> None:
    with pytest.raises(ValueError, match="does not end inside block"):
        kind_for(num_tokens, index, 64)


def test_kind_for_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        kind_for(32, 0, 0)


def _ns(**over: object) -> Namespace:
    base: dict[str, object] = dict(model="m", dtype="float32", kv_layout="cpu", block_size=32)
    base.update(over)
    return Namespace(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field_change",
    [{"model": "other"}, {"dtype": "bfloat16"}, {"kv_layout": "cuda"}, {"block_size": 64},
     {"tp_rank": 1}, {"tp_size": 2}, {"tenant": "salt-b"}, {"format_version": 2}],
)
def test_every_namespace_field_changes_the_fingerprint(field_change: dict[str, object]) -> None:
    assert _ns().fingerprint != _ns(**field_change).fingerprint
    assert len(_ns().digest) == 16


def test_block_key_name_is_scoped_and_readable() -> None:
    key = BlockKey(_ns().fingerprint, 1, b"\x01\xab", 32, BlockKind.PARTIAL)
    assert key.name == f"{_ns().fingerprint}:1:01ab"


def test_partial_and_full_keys_never_compare_equal() -> None:
    fp = _ns().fingerprint
    assert BlockKey(fp, 0, b"h", 32, BlockKind.PARTIAL) != BlockKey(fp, 0, b"h", 64, BlockKind.FULL)


def test_block_key_rejects_placeholders_and_empty_entries() -> None:
    with pytest.raises(ValueError, match="placeholder"):
        BlockKey("f", 0, b"h", 32, BlockKind.PLACEHOLDER)
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        BlockKey("f", 0, b"h", 0, BlockKind.FULL)


def test_hash_to_bytes_is_stable_and_injective_on_samples() -> None:
    assert hash_to_bytes(b"\x00\x01") == b"\x00\x01"
    samples = [0, 1, 255, 256, 2**63 - 1, 2**64 - 1, 2**64, 2**80]
    encoded = [hash_to_bytes(v) for v in samples]
    assert len(set(encoded)) == len(samples)
    assert hash_to_bytes(2**64 - 1) == b"\xff" * 8


def test_hash_to_bytes_rejects_negative_wire_hashes() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        hash_to_bytes(-1)

"""Block keys and the fullness rule: decided from num_tokens and position, never hash presence."""

from __future__ import annotations

import pytest

from offload_tiers.keys import (
    BlockKey,
    BlockKind,
    KeyName,
    Namespace,
    is_full_block,
    kind_for,
    parse_key_name,
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


FP = _ns().fingerprint


@pytest.mark.parametrize(("name", "ok"), [
    (f"{FP}:0:{'00' * 8}".encode(), True),
    (f"{FP.upper()}:4294967295:ab".encode(), True),
    (f"{FP}:4294967296:ab".encode(), False),  # group beyond u32
    (f"{FP}:-1:ab".encode(), False),
    (f"{FP}:01:ab".encode(), False),
    (f"{FP}:0:".encode(), False),
    (f"{FP}:0:abc".encode(), False),  # odd length
    (f"{FP}:0:AB".encode(), False),  # BlockKey.name writes lower-case hex
    (f"{FP[:-2]}:0:ab".encode(), False),
    (f"{FP}:0:ab:cd".encode(), False),
    (b"\xff\xfe:0:ab", False),
])
def test_parse_key_name_accepts_only_names_a_block_key_has(name: bytes, ok: bool) -> None:
    assert (parse_key_name(name) is not None) is ok


def test_parse_key_name_inverts_block_key_name() -> None:
    key = BlockKey(FP, 7, b"\x00\x01\xfe", 32, BlockKind.PARTIAL)
    assert parse_key_name(key.name.encode()) == KeyName(_ns().digest, 7, b"\x00\x01\xfe")

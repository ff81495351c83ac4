"""The value format: round trip, and every kind of bad value is a CorruptValue."""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import pytest

from offload_tiers import codec
from offload_tiers.codec import HEADER_SIZE, CorruptValue, decode, encode, encode_bytes
from offload_tiers.keys import BlockKind
from tests.tiers.helpers import NS_A_TENANT2, NS_B, key, payload


def test_round_trip_bytes_and_buffers() -> None:
    k = key(3)
    data = payload(k, 4096)
    parts = encode(k, data)
    assert len(parts) == 2 and len(parts[0]) == HEADER_SIZE and parts[1] is data
    value = b"".join(bytes(p) for p in parts)
    assert bytes(decode(k, value)) == data
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    assert bytes(decode(k, encode_bytes(k, arr))) == data
    assert bytes(decode(k, bytearray(value))) == data


def test_empty_payload_round_trips() -> None:
    k = key(0)
    assert bytes(decode(k, encode_bytes(k, b""))) == b""


def _bad_values(k):  # noqa: ANN001
    data = payload(k, 1024)
    good = encode_bytes(k, data)
    header = bytearray(good[:HEADER_SIZE])
    yield "truncated payload", good[:-1]
    yield "truncated header", good[:10]
    yield "empty", b""
    yield "trailing byte", good + b"\0"
    flipped = bytearray(good)
    flipped[HEADER_SIZE + 100] ^= 0x01
    yield "flipped payload bit", bytes(flipped)
    flipped = bytearray(good)
    flipped[-1] ^= 0x80
    yield "flipped last byte", bytes(flipped)
    for field, off, fmt, val in [
        ("magic", 0, "4s", b"XXXX"), ("version", 4, "H", 99), ("kind", 6, "B", 2),
        ("group", 24, "I", 7), ("num_tokens", 28, "Q", k.num_tokens + 1),
        ("hash tag", 36, "Q", 1234), ("absurd length", 44, "Q", 1 << 62),
        ("length", 44, "Q", 1023), ("checksum", 52, "Q", 0),
    ]:
        h = bytearray(header)
        struct.pack_into("<" + fmt, h, off, val)
        yield field, bytes(h) + data
    yield "foreign model", encode_bytes(dataclasses.replace(k, fingerprint=NS_B.fingerprint), data)
    yield "foreign tenant", encode_bytes(
        dataclasses.replace(k, fingerprint=NS_A_TENANT2.fingerprint), data)
    yield "other block", encode_bytes(dataclasses.replace(k, block_hash=b"other"), data)
    yield "random junk", bytes(range(256)) * 4


@pytest.mark.parametrize("case", list(_bad_values(key(5))), ids=lambda c: c[0])
def test_bad_values_are_corrupt(case) -> None:  # noqa: ANN001
    _, value = case
    with pytest.raises(CorruptValue) as info:
        decode(key(5), value)
    assert isinstance(info.value, ValueError) and info.value.reason


def test_partial_value_never_answers_full_lookup() -> None:
    full = key(2)
    partial = dataclasses.replace(full, num_tokens=full.num_tokens - 3, kind=BlockKind.PARTIAL)
    with pytest.raises(CorruptValue, match="kind"):
        decode(full, encode_bytes(partial, b"abc"))
    with pytest.raises(CorruptValue):
        decode(partial, encode_bytes(full, b"abc"))


def test_check_header_alone_catches_truncation() -> None:
    k = key(1)
    value = encode_bytes(k, payload(k, 100))
    assert codec.check_header(k, value[:HEADER_SIZE], total_len=len(value))[0] == 100
    with pytest.raises(CorruptValue, match="truncated"):
        codec.check_header(k, value[:HEADER_SIZE], total_len=len(value) - 1)


def test_bad_fingerprint_in_key_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="hex"):
        encode(dataclasses.replace(key(0), fingerprint="zz"), b"x")


def test_unstorable_keys_are_value_errors() -> None:
    for bad in (dataclasses.replace(key(0), group=1 << 32),
                dataclasses.replace(key(0), group=-1),
                dataclasses.replace(key(0), num_tokens=1 << 64),
                dataclasses.replace(key(0), fingerprint="ab" * 8)):
        with pytest.raises(ValueError):
            encode(bad, b"x")

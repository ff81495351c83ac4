"""The value format: round trip, and every kind of bad value is a CorruptValue."""

from __future__ import annotations

import dataclasses
import os
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
    # corruption is judged before the save id: a bad value of another save is still corrupt
    with pytest.raises(CorruptValue):
        decode(key(5), value, save_id=0x5A5A5A5A)


def test_save_id_round_trips_in_the_last_header_field() -> None:
    k = key(3)
    data = payload(k, 100)
    value = encode_bytes(k, data, save_id=0xDEADBEEF)
    assert codec.VALUE_VERSION == 2 and codec.HEADER.size == HEADER_SIZE == 64
    assert struct.unpack_from("<I", value, 60) == (0xDEADBEEF,)
    assert codec.parse_header(value).save_id == 0xDEADBEEF
    assert bytes(decode(k, value, save_id=0xDEADBEEF)) == data
    assert bytes(decode(k, value)) == data  # no save id asked: any save serves
    assert codec.check_header(k, value[:HEADER_SIZE], total_len=len(value),
                              save_id=0xDEADBEEF) == (100, codec.checksum(data))
    assert encode(k, data, save_id=7)[0] == codec.encode_header(k, data, save_id=7)
    assert codec.parse_header(encode_bytes(k, data)).save_id == 0  # none given
    top = (1 << 32) - 1
    assert codec.parse_header(codec.encode_header(k, data, save_id=top)).save_id == top


def test_another_save_is_stale_not_corrupt() -> None:
    k = key(3)
    value = encode_bytes(k, payload(k, 100), save_id=1)
    checks = {
        "decode": lambda: decode(k, value, save_id=2),
        "check_header": lambda: codec.check_header(k, value[:HEADER_SIZE],
                                                   total_len=len(value), save_id=2),
        "check_fields": lambda: codec.check_fields(
            value[:HEADER_SIZE], digest=codec.namespace_digest(k), group=k.group,
            block_hash=k.block_hash, save_id=2),
    }
    for name, check in checks.items():
        with pytest.raises(codec.StaleSave) as info:
            check()
        exc = info.value
        assert isinstance(exc, ValueError) and not isinstance(exc, CorruptValue), name
        assert (exc.stored, exc.expected) == (1, 2), name
    with pytest.raises(codec.StaleSave):  # asking for save 0 is asking for "stored without"
        decode(k, value, save_id=0)
    assert not issubclass(codec.StaleSave, CorruptValue)


def test_a_bad_header_of_another_save_is_corrupt_with_its_code() -> None:
    k = key(3)
    value = bytearray(encode_bytes(k, payload(k, 100), save_id=1))
    struct.pack_into("<Q", value, 28, k.num_tokens + 1)
    with pytest.raises(CorruptValue) as info:
        codec.check_header(k, value[:HEADER_SIZE], total_len=len(value), save_id=2)
    assert info.value.code == "bad_num_tokens"


def test_a_version_1_value_is_bad_version() -> None:
    k = key(3)
    value = bytearray(encode_bytes(k, payload(k, 100)))
    struct.pack_into("<H", value, 4, 1)  # the format before save ids: reserved u32 = 0
    with pytest.raises(CorruptValue) as info:
        decode(k, bytes(value))
    assert info.value.code == "bad_version"


def test_save_id_out_of_range_is_a_value_error() -> None:
    k = key(0)
    for bad in (-1, 1 << 32, "7", 1.5):
        with pytest.raises(ValueError, match="save_id"):
            encode(k, b"x", save_id=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="save_id"):
            codec.validate_save_id(bad)  # type: ignore[arg-type]
    codec.validate_save_id(np.uint32(5))  # an integer of any kind


def test_new_save_id_is_a_nonzero_u32(monkeypatch: pytest.MonkeyPatch) -> None:
    draws = iter([0, 0, 77])
    monkeypatch.setattr(codec.random, "getrandbits", lambda bits: next(draws))
    assert codec.new_save_id() == 77  # 0 ("none given") is drawn again
    monkeypatch.undo()
    ids = {codec.new_save_id() for _ in range(100)}
    assert all(0 < i < 1 << 32 for i in ids) and len(ids) > 90


def test_a_forked_child_draws_other_save_ids_than_its_parent() -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its ids, then out
        os.write(write_end, struct.pack("<4I", *(codec.new_save_id() for _ in range(4))))
        os._exit(0)
    os.close(write_end)
    child = struct.unpack("<4I", os.read(read_end, 16))
    os.close(read_end)
    os.waitpid(pid, 0)
    parent = tuple(codec.new_save_id() for _ in range(4))
    assert child != parent  # same state after the fork would give the same four


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

"""Wire compatibility with vLLM's own KV-event classes, both directions, both event forms."""

from __future__ import annotations

import msgspec
import pytest

from connector.events import wire as ours
from tests.daemon.vllm_required import import_vllm

kv = import_vllm("vllm.distributed.kv_events")


def vllm_batch() -> object:
    return kv.KVEventBatch(ts=1234.5, data_parallel_rank=3, events=[
        kv.BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None,
                       token_ids=list(range(64)), block_size=32, lora_id=7, medium="GPU",
                       lora_name="adapter", extra_keys=[("salt",), None], group_idx=1,
                       kv_cache_spec_kind="full_attention", kv_cache_spec_sliding_window=None,
                       locality="LOCAL", ownership="tier-a", session_id="s1"),
        kv.BlockStored(block_hashes=[b"\x01" * 32], parent_block_hash=b"\x02" * 32,
                       token_ids=[], block_size=0, lora_id=None, medium="cpu", lora_name=None),
        kv.BlockRemoved(block_hashes=[2**64 - 1], medium="CPU", group_idx=1, ownership="x"),
        kv.AllBlocksCleared(),
    ])


def test_vllm_encoded_batch_decodes_with_ours() -> None:
    payload = msgspec.msgpack.Encoder().encode(vllm_batch())  # what ZmqEventPublisher sends
    batch = ours.decode_batch(payload)
    assert batch.ts == 1234.5 and batch.data_parallel_rank == 3
    s0, s1, r, c = batch.events
    assert isinstance(s0, ours.BlockStored)
    assert s0.block_hashes == [1, 2**64 - 1] and s0.parent_block_hash is None
    assert s0.token_ids == list(range(64)) and s0.block_size == 32 and s0.group_idx == 1
    assert s0.extra_keys == [("salt",), None] and s0.ownership == "tier-a"
    assert s0.kv_cache_spec_kind == "full_attention" and s0.session_id == "s1"
    assert s1.block_hashes == [b"\x01" * 32] and s1.parent_block_hash == b"\x02" * 32
    assert s1.token_ids == [] and s1.block_size == 0 and s1.medium == "cpu"
    assert isinstance(r, ours.BlockRemoved) and r.group_idx == 1 and r.ownership == "x"
    assert isinstance(c, ours.AllBlocksCleared)
    fast = ours.BatchDecoder().decode(payload)  # the daemon's decoder, same payload
    f0, f1, fr, fc = fast.events
    assert isinstance(f0, ours.RawBlockStored) and isinstance(f0, ours.BlockStored)
    assert f0.block_hashes == [1, 2**64 - 1] and ours.raw_array_len(f0.token_ids) == 64
    assert msgspec.msgpack.decode(f0.extra_keys) == [["salt"], None]
    assert f0.group_idx == 1 and f0.ownership == "tier-a" and f0.block_size == 32
    assert ours.raw_array_len(f1.token_ids) == 0 and f1.medium == "cpu"
    assert isinstance(fr, ours.BlockRemoved) and fr.block_hashes == [2**64 - 1]
    assert isinstance(fc, ours.AllBlocksCleared)


def test_hot_path_decoder_reads_token_counts_without_decoding_them() -> None:
    for n in (0, 15, 16, 65535, 65536):
        ev = kv.BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[7] * n,
                            block_size=max(n, 1), lora_id=None, medium=None, lora_name=None)
        payload = msgspec.msgpack.encode(kv.KVEventBatch(ts=1.0, events=[ev]))
        fast = ours.BatchDecoder().decode(payload).events[0]
        assert ours.raw_array_len(fast.token_ids) == n
        assert msgspec.msgpack.decode(fast.token_ids) == [7] * n


def test_our_encoded_batch_decodes_with_vllm() -> None:
    batch = ours.KVEventBatch(ts=9.0, data_parallel_rank=0, events=[
        ours.BlockStored(block_hashes=[10, 11], parent_block_hash=9, token_ids=[1] * 32,
                         block_size=16, lora_id=None, medium="GPU", lora_name=None,
                         group_idx=0, ownership=None),
        ours.BlockRemoved(block_hashes=[10], medium="GPU"),
        ours.AllBlocksCleared(),
    ])
    decoded = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(ours.encode_batch(batch))
    assert isinstance(decoded.events[0], kv.BlockStored)
    assert decoded.events[0].block_hashes == [10, 11]
    assert decoded.events[0].parent_block_hash == 9
    assert decoded.events[0].token_ids == [1] * 32
    assert isinstance(decoded.events[1], kv.BlockRemoved)
    assert isinstance(decoded.events[2], kv.AllBlocksCleared)
    # Ours as sent; vLLM's fields beyond ours (a newer release's additions) at their defaults.
    for mine, theirs in zip(batch.events, decoded.events, strict=True):
        extra = set(type(theirs).__struct_fields__) - set(type(mine).__struct_fields__)
        for name in extra:
            field = next(f for f in msgspec.structs.fields(theirs) if f.name == name)
            default = (field.default if field.default is not msgspec.NODEFAULT
                       else field.default_factory())
            assert getattr(theirs, name) == default, (type(theirs).__name__, name)
        for name in type(mine).__struct_fields__:
            if name in type(theirs).__struct_fields__:
                assert getattr(theirs, name) == getattr(mine, name), (type(mine).__name__, name)
            else:  # ours beyond vLLM's (e.g. skipped_* of vLLM #58121): sent at its default
                field = next(f for f in msgspec.structs.fields(mine) if f.name == name)
                assert getattr(mine, name) == field.default, (type(mine).__name__, name)
    again = kv.KVEventBatch(ts=9.0, data_parallel_rank=0, events=decoded.events)
    theirs_bytes, ours_bytes = msgspec.msgpack.encode(again), ours.encode_batch(batch)
    classes = ("KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared")
    same_shape = all(getattr(kv, name).__struct_fields__ == getattr(ours, name).__struct_fields__
                     for name in classes)
    if same_shape:
        # Byte-for-byte the same encoding as vLLM's own classes for the same content.
        assert theirs_bytes == ours_bytes
    else:
        # A vLLM with more fields (0.33's BlockStored.lookahead_token_ids: 15 fields plus the
        # tag, so a map16 header where ours writes a fixmap): the same content, read both ways.
        assert ours.decode_batch(theirs_bytes) == batch
        fast = ours.BatchDecoder().decode(theirs_bytes).events  # the daemon's decoder
        assert fast[0].block_hashes == [10, 11] and ours.raw_array_len(fast[0].token_ids) == 32
        assert [msgspec.structs.asdict(e) for e in fast[1:]] == [
            msgspec.structs.asdict(e) for e in batch.events[1:]]
        assert msgspec.msgpack.Decoder(kv.KVEventBatch).decode(ours_bytes) == again


def test_older_array_form_decodes() -> None:
    legacy = [12.0, [
        ["BlockStored", [1, 2], None, list(range(32)), 16, None],          # oldest: no medium
        ["BlockStored", [3], 2, list(range(16)), 16, None, "cpu"],         # with medium
        ["BlockRemoved", [1]],
        ["BlockRemoved", [2], "GPU"],
        ["AllBlocksCleared"],
    ], 1]
    payload = msgspec.msgpack.encode(legacy)
    batch = ours.decode_batch(payload)
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored", "BlockStored", "BlockRemoved", "BlockRemoved", "AllBlocksCleared"]
    assert batch.events[0].medium is None and batch.events[1].medium == "cpu"
    assert batch.events[1].parent_block_hash == 2
    fast = ours.BatchDecoder().decode(payload)  # array form: the plain structs, as above
    assert [type(e) for e in fast.events] == [type(e) for e in batch.events]
    assert fast.events[0].token_ids == list(range(32))
    assert fast.data_parallel_rank == 1


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", msgspec.msgpack.encode({"ts": 1}), msgspec.msgpack.encode([1.0, [{"type": "X"}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "nope"}]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1]]]]),
    msgspec.msgpack.encode([1.0, [["X", [1]]]]),
    msgspec.msgpack.encode([1.0, [[]]]),
    msgspec.msgpack.encode([1.0, [["BlockRemoved", "nope"]]]),
    msgspec.msgpack.encode([1.0, [["AllBlocksCleared"], {"type": "AllBlocksCleared"}]]),
])
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(ours.DecodeError):
        ours.decode_batch(payload)
    with pytest.raises(ours.DecodeError):
        ours.BatchDecoder().decode(payload)


@pytest.mark.parametrize(("raw", "norm"), [
    (None, "GPU"), ("GPU", "GPU"), ("cpu", "CPU"), ("CPU", "CPU"), ("storage", "STORAGE"),
    ("disk", "STORAGE"), ("nvme", "NVME"),
])
def test_medium_normalisation(raw: str | None, norm: str) -> None:
    assert ours.normalize_medium(raw) == norm


def test_events_module_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = ("import sys, connector.events.wire, connector.events.classify, connector.events.index, "
            "connector.daemon.cli, connector.daemon.service, connector.daemon.http; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"

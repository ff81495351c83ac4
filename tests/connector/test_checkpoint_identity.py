"""Checkpoint identity where file times are normalised (issue 43 item 4): two fine-tunes of
one architecture share safetensors headers, sizes and modification times (Nix stores,
reproducible images, deploys that set mtimes); the sampled bytes of their tensors tell them
apart, and the same bytes anywhere give the same identity."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

from connector.identity.checkpoint import (
    SPREAD_WINDOWS,
    TENSOR_WINDOWS_MAX,
    WINDOW,
    checkpoint_identity,
    sample_windows,
)

NORMALISED_NS = 1_000_000_000  # 1970-01-01T00:00:01, what a Nix store sets
TENSOR_BYTES = 64 << 10


def _write_safetensors(path: Path, tensors: list[bytes]) -> None:
    """A safetensors file by hand: 8-byte header length, JSON header, the tensors' bytes."""
    header, at = {}, 0
    for i, data in enumerate(tensors):
        header[f"layers.{i}.weight"] = {"dtype": "BF16", "shape": [len(data) // 2],
                                        "data_offsets": [at, at + len(data)]}
        at += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(tensors))


def _checkpoint(root: Path, tensors: list[bytes]) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    _write_safetensors(root / "model.safetensors", tensors)
    for path in root.iterdir():  # the deploy normalises every file time
        os.utime(path, ns=(NORMALISED_NS, NORMALISED_NS))
    return root


def _tensors(seed: int, n: int = 8, size: int = TENSOR_BYTES) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def _data_start(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_two_fine_tunes_with_one_header_size_and_mtime_have_different_identities(
        tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a", _tensors(1))
    b = _checkpoint(tmp_path / "b", _tensors(2))
    for name in ("config.json", "model.safetensors"):
        sa, sb = (a / name).stat(), (b / name).stat()
        assert (sa.st_size, sa.st_mtime_ns) == (sb.st_size, sb.st_mtime_ns)
    header = _data_start(a / "model.safetensors")
    assert (a / "model.safetensors").read_bytes()[:header] == (b / "model.safetensors"
                                                               ).read_bytes()[:header]
    assert checkpoint_identity(str(a)) != checkpoint_identity(str(b))


def test_the_same_bytes_in_two_directories_have_one_identity(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a", _tensors(1))
    b = tmp_path / "b"
    shutil.copytree(a, b)  # copy2 keeps the (normalised) times
    assert checkpoint_identity(str(a)) == checkpoint_identity(str(b))


def test_a_fine_tune_that_changed_one_tensor_not_the_first_has_a_new_identity(
        tmp_path: Path) -> None:
    # 200 tensors: 64 evenly spaced windows alone would miss most single tensors
    base = _tensors(1, n=200)
    tuned = list(base)
    tuned[137] = random.Random(99).randbytes(TENSOR_BYTES)  # a merged LoRA: dense in it
    a = _checkpoint(tmp_path / "a", base)
    b = _checkpoint(tmp_path / "b", tuned)
    assert checkpoint_identity(str(a)) != checkpoint_identity(str(b))


def test_every_tensor_is_sampled_and_the_sample_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    _write_safetensors(path, _tensors(1, n=200))
    windows = sample_windows(path)
    data_start = _data_start(path)
    for i in range(200):  # one window inside each tensor's byte range
        begin, end = data_start + i * TENSOR_BYTES, data_start + (i + 1) * TENSOR_BYTES
        assert any(begin <= off < end for off, _ in windows), i
    many = tmp_path / "many.safetensors"  # more tensors than one file samples
    _write_safetensors(many, [bytes([i % 256]) * 64 for i in range(5000)])
    assert len(sample_windows(many)) <= 1 + TENSOR_WINDOWS_MAX + SPREAD_WINDOWS
    big = tmp_path / "big.bin"  # not safetensors: edges and evenly spaced windows
    with big.open("wb") as f:
        f.truncate(64 << 20)
    assert sum(n for _, n in sample_windows(big)) <= 2 * (64 << 10) + SPREAD_WINDOWS * WINDOW


def test_another_format_with_the_same_size_and_mtime_but_other_weights_is_new(
        tmp_path: Path) -> None:
    rng = random.Random(5)  # one pickle at the start, one zip directory at the end
    head, tail = rng.randbytes(1 << 20), rng.randbytes(1 << 20)
    first, second = rng.randbytes(8 << 20), rng.randbytes(8 << 20)
    ids = []
    for name, middle in (("a", first), ("b", second)):
        body = head + middle + tail
        root = tmp_path / name
        root.mkdir()
        (root / "pytorch_model.bin").write_bytes(body)
        os.utime(root / "pytorch_model.bin", ns=(NORMALISED_NS, NORMALISED_NS))
        ids.append(checkpoint_identity(str(root)))
    assert ids[0] != ids[1]


def test_a_change_outside_every_window_is_not_seen(tmp_path: Path) -> None:
    """The documented limit: the sample reads windows, not every byte."""
    base = _tensors(1, n=4, size=1 << 20)  # 4 MiB of tensors, ~70 pages of 1,024 sampled
    a = _checkpoint(tmp_path / "a", base)
    windows = sample_windows(a / "model.safetensors")
    data_start = _data_start(a / "model.safetensors")
    body = bytearray(b"".join(base))
    outside = next(off for off in range(data_start, data_start + len(body), 512)
                   if all(not (w <= off < w + n) for w, n in windows))
    body[outside - data_start] ^= 0xFF
    b = tmp_path / "b"
    b.mkdir()
    shutil.copy2(a / "config.json", b / "config.json")
    raw = (a / "model.safetensors").read_bytes()[:data_start]
    (b / "model.safetensors").write_bytes(raw + bytes(body))
    os.utime(b / "model.safetensors", ns=(NORMALISED_NS, NORMALISED_NS))
    assert checkpoint_identity(str(a)) == checkpoint_identity(str(b))

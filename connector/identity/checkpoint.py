"""The identity of a checkpoint on disk: its files' names, sizes and times, and a sample of
the weights' own bytes, without reading the weights.

Rules this module keeps:

* A checkpoint is its weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
  ``*.gguf``, ``*.npz``, their index files) and ``config.json``, up to two directory
  levels down. Each contributes its relative name, its size, its modification time and an
  xxh3-128 digest of a **content sample** (:func:`sample_windows`). A differing time still
  makes a new identity (conservative: a checkpoint rewritten in place is new even where the
  sample misses the change), but time is never what tells two checkpoints apart: deploys
  normalise it (Nix stores, reproducible images), and two fine-tunes of one architecture
  then share headers, sizes and times. The sample is what differs.
* The sample is fixed by the file alone (its size and, for safetensors, its header), so two
  hosts holding the same bytes agree. For a safetensors file: the header (``8 + N`` bytes,
  capped), **one 4 KiB window in the middle of each tensor's byte range** (page-aligned; at
  most :data:`TENSOR_WINDOWS_MAX` tensors per file, evenly chosen by position beyond that),
  and :data:`SPREAD_WINDOWS` windows evenly spaced over the data. A fine-tune changes the
  tensors it trains densely (a merged LoRA adds ``B @ A`` to every element of a matrix;
  frozen layers are bit-identical), so one window per tensor catches a fine-tune that
  changed a single layer, where evenly spaced windows alone would miss most tensors. Any
  other file: whole when at most :data:`WHOLE_FILE_MAX` bytes, else its first and last
  64 KiB and :data:`SPREAD_WINDOWS` evenly spaced windows.
* What the sample does not catch: a change that falls outside every window with size and
  time unchanged, e.g. only a few embedding rows trained (new tokens), a sparse edit, a
  tensor beyond the cap left untouched by the windows, or bytes changed in one tensor's
  part between windows. ``weights_version`` names such weights. The cost is bounded:
  at most ``1 + TENSOR_WINDOWS_MAX + SPREAD_WINDOWS`` reads per safetensors file (its
  header, then one page each; a Llama-3-8B-shaped 16 GiB checkpoint in 4 shards with its
  index and config: 580 windows, 2.3 MiB), read with
  ``os.pread`` on one descriptor advised random (no read-ahead), every window's read started
  at once (``POSIX_FADV_WILLNEED``) so a cold page cache costs about one disk round trip, not
  one per window; measured against reading the files whole by
  ``benchmarks/bench_checkpoint_identity.py``.
* A file stored in a Hugging Face cache is a link to a blob named by the SHA-256 of its
  content: that name is the identity (no time, no sample: the name already is the
  content), so two hosts that downloaded the same revision agree.
* A model that is not a local directory (a hub name not in the local cache) has no file
  identity: ``"unresolved"``, and the model name, revision and ``weights_version`` carry it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

import xxhash

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".index.json")
WINDOW = 4 << 10  # one page: a window costs one read
SPREAD_WINDOWS = 64
TENSOR_WINDOWS_MAX = 1024
WHOLE_FILE_MAX = 256 << 10
_EDGE_BYTES = 64 << 10
_SAFETENSORS_HEADER_MAX = 16 << 20
_HF_BLOB = re.compile(r"[0-9a-f]{64}")
UNRESOLVED = "unresolved"

Window = tuple[int, int]  # (offset, length)


def checkpoint_files(root: Path) -> list[Path]:
    """The files that identify the checkpoint under ``root`` (sorted, at most two levels)."""
    found: list[Path] = []
    for depth_glob in ("*", "*/*", "*/*/*"):
        for path in root.glob(depth_glob):
            name = path.name
            if name == "config.json" or name.endswith(WEIGHT_SUFFIXES):
                if path.is_file():
                    found.append(path)
    return sorted(found)


def _aligned(offset: int, low: int) -> int:
    """``offset`` rounded down to a page, not below ``low``."""
    return max(low, offset - offset % WINDOW)


def _spread(low: int, high: int) -> list[int]:
    """:data:`SPREAD_WINDOWS` page-aligned offsets evenly spaced over ``[low, high)``."""
    span = max(high - low - WINDOW, 0)
    return [_aligned(low + span * k // (SPREAD_WINDOWS - 1), low) for k in range(SPREAD_WINDOWS)]


def _tensor_ranges(header: bytes, data_start: int, size: int) -> list[Window] | None:
    """Each tensor's absolute ``(begin, end)`` from a safetensors header; None if unreadable."""
    try:
        entries = json.loads(header)
    except ValueError:
        return None
    if not isinstance(entries, dict):
        return None
    ranges = []
    for name, entry in entries.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if name == "__metadata__" or not isinstance(offsets, list) or len(offsets) != 2:
            continue
        begin, end = offsets
        if isinstance(begin, int) and isinstance(end, int) and 0 <= begin < end:
            if data_start + end <= size:
                ranges.append((data_start + begin, data_start + end))
    return sorted(ranges)


def _safetensors_windows(fd: int, size: int) -> list[Window] | None:
    """Header, one window per tensor (capped), evenly spaced ones; None if not safetensors."""
    if size < 8:
        return None
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    header_len = min(n, _SAFETENSORS_HEADER_MAX, size - 8)
    data_start = 8 + n
    ranges = _tensor_ranges(os.pread(fd, header_len, 8), data_start, size)
    if ranges is None or data_start > size:
        return None
    if len(ranges) > TENSOR_WINDOWS_MAX:
        ranges = [ranges[i * len(ranges) // TENSOR_WINDOWS_MAX]
                  for i in range(TENSOR_WINDOWS_MAX)]
    offsets = {_aligned((b + e) // 2, b) for b, e in ranges}
    offsets.update(_spread(data_start, size))
    data = [(off, min(WINDOW, size - off)) for off in sorted(offsets) if off < size]
    return [(0, 8 + header_len), *data]


def _windows(fd: int, name: str, size: int) -> list[Window]:
    if name.endswith(".safetensors"):
        windows = _safetensors_windows(fd, size)
        if windows is not None:
            return windows
    if size <= WHOLE_FILE_MAX:
        return [(0, size)]
    middle = [(off, WINDOW) for off in sorted(set(_spread(_EDGE_BYTES, size - _EDGE_BYTES)))]
    return [(0, _EDGE_BYTES), *middle, (size - _EDGE_BYTES, _EDGE_BYTES)]


def sample_windows(path: Path) -> list[Window]:
    """The ``(offset, length)`` windows of ``path`` its identity hashes, in order."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _windows(fd, path.name, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _content_digest(path: Path) -> str:
    """xxh3-128 of the file's sampled windows (see the module rules), read with one fd."""
    fd = os.open(path, os.O_RDONLY)
    try:
        windows = _windows(fd, path.name, os.fstat(fd).st_size)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a window reads its page only
            for offset, length in windows:  # start every read at once; pread waits in turn
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        h = xxhash.xxh3_128()
        for offset, length in windows:
            h.update(struct.pack("<QQ", offset, length))
            h.update(os.pread(fd, length, offset))
        return h.hexdigest()
    finally:
        os.close(fd)


def file_identity(path: Path, root: Path) -> str:
    """One file's share of the identity (see the module rules)."""
    rel = path.relative_to(root).as_posix()
    if path.is_symlink():
        blob = Path(os.readlink(path)).name
        if _HF_BLOB.fullmatch(blob):
            return f"{rel}=sha256:{blob}"
    st = path.stat()
    return f"{rel}={st.st_size}:{st.st_mtime_ns}:{_content_digest(path)}"


def resolve_model_dir(model: str, revision: str | None) -> Path | None:
    """The local directory holding ``model``: itself, or its snapshot in the HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(model, revision=revision or None, local_files_only=True)
    except Exception:  # not cached, not a repo id, no huggingface_hub: no file identity
        return None
    return Path(local)


def checkpoint_identity(model: str, revision: str | None = None) -> str:
    """A 32-hex digest of the checkpoint's files, or :data:`UNRESOLVED`."""
    root = resolve_model_dir(model, revision)
    if root is None:
        return UNRESOLVED
    files = checkpoint_files(root)
    if not files:
        return UNRESOLVED
    h = hashlib.blake2b(digest_size=16)
    for path in files:
        h.update(file_identity(path, root).encode())
        h.update(b"\n")
    return h.hexdigest()

"""The identity of a checkpoint on disk, without reading its weights.

Rules this module keeps:

* A checkpoint is its weight files (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
  ``*.gguf``, ``*.npz``, their index files) and ``config.json``, up to two directory
  levels down. Each contributes its relative name, its size, its modification time and a
  digest of its header: the safetensors JSON header (``8 + N`` bytes, capped), else the
  first and last 64 KiB. A checkpoint rewritten at the same path is therefore a new identity,
  and nothing close to the weights' size is read (see ``benchmarks/bench_checkpoint_identity.py``).
* A file stored in a Hugging Face cache is a link to a blob named by the SHA-256 of its
  content: that name is the identity (no modification time), so two hosts that downloaded
  the same revision agree.
* A model that is not a local directory (a hub name not in the local cache) has no file
  identity: ``"unresolved"``, and the model name, revision and ``weights_version`` carry it.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".index.json")
_EDGE_BYTES = 64 << 10
_SAFETENSORS_HEADER_MAX = 16 << 20
_HF_BLOB = re.compile(r"[0-9a-f]{64}")
UNRESOLVED = "unresolved"


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


def _header_digest(path: Path, size: int) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        if path.name.endswith(".safetensors") and size >= 8:
            (n,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(min(n, _SAFETENSORS_HEADER_MAX, max(size - 8, 0))))
            return h.digest()
        h.update(f.read(_EDGE_BYTES))
        if size > 2 * _EDGE_BYTES:
            f.seek(size - _EDGE_BYTES)
            h.update(f.read(_EDGE_BYTES))
    return h.digest()


def file_identity(path: Path, root: Path) -> str:
    """One file's share of the identity (see the module rules)."""
    rel = path.relative_to(root).as_posix()
    if path.is_symlink():
        blob = Path(os.readlink(path)).name
        if _HF_BLOB.fullmatch(blob):
            return f"{rel}=sha256:{blob}"
    st = path.stat()
    return f"{rel}={st.st_size}:{st.st_mtime_ns}:{_header_digest(path, st.st_size).hex()}"


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

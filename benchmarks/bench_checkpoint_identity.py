"""What the checkpoint's sampled identity costs at engine start, next to reading the weights once.

Builds a Llama-3-8B-shaped checkpoint (bf16 tensors: embeddings, per layer 4 norms/projections
of attention and 3 of the MLP, final norm, LM head; as many layers as make ``--gib`` GiB) in
``--shards`` safetensors files with an index and ``config.json``: real bytes on disk, a real
safetensors header per shard. Then times, in the same run:

* ``identity``: :func:`connector.identity.checkpoint.checkpoint_identity` (names, sizes,
  modification times and the content sample: each shard's header, one 4 KiB window per tensor,
  64 evenly spaced windows), median and best of ``--runs``, page-cache cold (the files' pages
  dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each run; the host's cache under
  this VM's disk is not ours to drop) and warm;
* ``full_read``: one sequential read of every byte of the weight files (what a content digest
  would cost at the least), cold and then warm, through the same page cache.

Prints a table and writes JSON (``--json``) with ``ratios.identity_{cold,warm}_vs_full_read``.

    python -m benchmarks.bench_checkpoint_identity --gib 16 --shards 4 --dir /tmp --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import write_result
from connector.identity.checkpoint import checkpoint_files, checkpoint_identity, sample_windows

CHUNK = 64 << 20
BF16 = 2


def llama_layout(gib: float) -> list[tuple[str, list[int]]]:
    """Llama-3-8B's tensor shapes with as many layers as make ``gib`` GiB (halved dims if small)."""
    hidden, inter, kv, vocab = 4096, 14336, 1024, 128256
    target = int(gib * (1 << 30))

    def layer_bytes() -> int:
        return BF16 * (2 * hidden * hidden + 2 * kv * hidden + 3 * hidden * inter + 2 * hidden)

    while BF16 * (2 * vocab * hidden + hidden) + layer_bytes() > target and hidden > 64:
        hidden, inter, kv, vocab = hidden // 2, inter // 2, kv // 2, vocab // 2
    embeds = BF16 * (2 * vocab * hidden + hidden)
    layers = max(1, round((target - embeds) / layer_bytes()))
    out = [("model.embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [hidden]),
                (p + "self_attn.q_proj.weight", [hidden, hidden]),
                (p + "self_attn.k_proj.weight", [kv, hidden]),
                (p + "self_attn.v_proj.weight", [kv, hidden]),
                (p + "self_attn.o_proj.weight", [hidden, hidden]),
                (p + "post_attention_layernorm.weight", [hidden]),
                (p + "mlp.gate_proj.weight", [inter, hidden]),
                (p + "mlp.up_proj.weight", [inter, hidden]),
                (p + "mlp.down_proj.weight", [hidden, inter])]
    return out + [("model.norm.weight", [hidden]), ("lm_head.weight", [vocab, hidden])]


def _nbytes(shape: list[int]) -> int:
    n = BF16
    for d in shape:
        n *= d
    return n


def _write_shard(path: Path, tensors: list[tuple[str, list[int]]], block: bytes) -> int:
    header, at = {}, 0
    for name, shape in tensors:
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + _nbytes(shape)]}
        at += _nbytes(shape)
    raw = json.dumps(header).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, struct.pack("<Q", len(raw)) + raw)
        view, left = memoryview(block), at
        while left:
            left -= os.write(fd, view[:min(left, len(view))])
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return 8 + len(raw) + at


def write_checkpoint(root: Path, gib: float, shards: int) -> tuple[int, int]:
    """The checkpoint under ``root``; (bytes of weight files, tensors)."""
    layout = llama_layout(gib)
    per_shard = sum(_nbytes(s) for _, s in layout) / shards
    groups: list[list[tuple[str, list[int]]]] = [[]]
    filled = 0
    for name, shape in layout:
        if filled >= per_shard * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append((name, shape))
        filled += _nbytes(shape)
    block = os.urandom(CHUNK)
    total, weight_map = 0, {}
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        total += _write_shard(root / name, group, block)
        weight_map.update({tensor: name for tensor, _ in group})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return total, len(layout)


def drop_cache(root: Path) -> None:
    """Drop the page cache of every file under ``root`` (this VM's cache only)."""
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(root: Path) -> int | None:
    """Bytes of ``root``'s files in the page cache (util-linux ``fincore``), None without it."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES",
                          *map(str, sorted(root.iterdir()))], capture_output=True, text=True)
    return sum(int(v) for v in out.stdout.split()) if out.returncode == 0 else None


def full_read(root: Path) -> int:
    n, buf = 0, bytearray(CHUNK)
    for path in sorted(root.glob("*.safetensors")):
        with path.open("rb", buffering=0) as f:
            while got := f.readinto(buf):
                n += got
    return n


def timed(fn, *args):  # noqa: ANN001, ANN201
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def measure(root: Path, runs: int) -> dict[str, Any]:
    """Every timing of one run, on the checkpoint under ``root``."""
    cold, warm, idents = [], [], set()
    for _ in range(runs):
        drop_cache(root)
        ident, secs = timed(checkpoint_identity, str(root))
        idents.add(ident)
        cold.append(secs)
    for _ in range(runs):
        ident, secs = timed(checkpoint_identity, str(root))
        idents.add(ident)
        warm.append(secs)
    assert len(idents) == 1 and len(ident) == 32, idents
    windows = [w for p in checkpoint_files(root) for w in sample_windows(p)]
    drop_cache(root)
    resident_before_cold = resident_bytes(root)
    read_bytes, cold_read = timed(full_read, root)
    resident_before_warm = resident_bytes(root)
    _, warm_read = timed(full_read, root)
    drop_cache(root)
    return {"runs": runs,
            "identity_cold_s": statistics.median(cold), "identity_warm_s": statistics.median(warm),
            "identity_cold_best_s": min(cold), "identity_warm_best_s": min(warm),
            "identity_cold_runs_s": cold, "identity_warm_runs_s": warm,
            "sample_windows": len(windows), "sample_bytes": sum(n for _, n in windows),
            "full_read_cold_s": cold_read, "full_read_warm_s": warm_read,
            "full_read_bytes": read_bytes, "resident_before_cold_read": resident_before_cold,
            "resident_before_warm_read": resident_before_warm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=16.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5, help="identity runs, cold and warm (median)")
    ap.add_argument("--dir", default=None, help="where to build it (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        (size, tensors), write_s = timed(write_checkpoint, root, args.gib, args.shards)
        result = {"bytes": size, "gib": size / (1 << 30), "shards": args.shards,
                  "tensors": tensors, "write_s": write_s, **measure(root, args.runs)}
    result["ratios"] = {
        "identity_cold_vs_full_read": result["identity_cold_s"] / result["full_read_cold_s"],
        "identity_warm_vs_full_read": result["identity_warm_s"] / result["full_read_warm_s"]}
    print(f"checkpoint: {result['gib']:.2f} GiB in {args.shards} shards, {tensors} tensors; "
          f"sample: {result['sample_windows']} windows, {result['sample_bytes'] / 2**20:.2f} MiB")
    print(f"{'step':<32}{'cold ms':>12}{'warm ms':>12}")
    for name, key in ((f"identity (median of {args.runs})", "identity"),
                      (f"identity (best of {args.runs})", "identity_best"),
                      ("full read", "full_read")):
        cold, warm = (key + "_cold_s", key + "_warm_s") if key != "identity_best" else (
            "identity_cold_best_s", "identity_warm_best_s")
        print(f"{name:<32}{result[cold] * 1e3:>12.2f}{result[warm] * 1e3:>12.2f}")
    r = result["ratios"]
    print(f"{'identity / full read (median)':<32}{r['identity_cold_vs_full_read']:>12.6f}"
          f"{r['identity_warm_vs_full_read']:>12.6f}")
    write_result(args.json, result)


if __name__ == "__main__":
    main()

"""What the checkpoint's identity costs at engine start, next to reading the weights once.

Builds a checkpoint of ``--shards`` safetensors files totalling ``--gib`` GiB (real bytes on
disk, a real safetensors JSON header per shard), then times, in the same run:

* ``identity``: :func:`connector.identity.checkpoint.checkpoint_identity` (names, sizes,
  modification times, header digests), first call after the files were written and again;
* ``full_read``: one sequential read of every byte (what a content digest would cost at the
  least), through the same page cache.

Prints a table and writes JSON (``--json``) with ``ratios.identity_vs_full_read``.

    python benchmarks/bench_checkpoint_identity.py --gib 4 --shards 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import struct
import tempfile
import time
from pathlib import Path

from connector.identity.checkpoint import checkpoint_identity

CHUNK = 64 << 20


def write_checkpoint(root: Path, gib: float, shards: int) -> int:
    """Shards of real bytes with a safetensors header each; the total size written."""
    per_shard = int(gib * (1 << 30)) // shards
    total = 0
    block = bytes(range(256)) * (CHUNK // 256)
    for i in range(shards):
        header = json.dumps({"w": {"dtype": "F32", "shape": [per_shard // 4],
                                   "data_offsets": [0, per_shard]}}).encode()
        with (root / f"model-{i:05d}-of-{shards:05d}.safetensors").open("wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            left = per_shard
            while left:
                n = min(left, CHUNK)
                f.write(block[:n])
                left -= n
        total += per_shard + 8 + len(header)
    (root / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return total


def full_read(root: Path) -> int:
    n = 0
    for path in sorted(root.glob("*.safetensors")):
        with path.open("rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                n += len(chunk)
    return n


def timed(fn, *args):  # noqa: ANN001, ANN201
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", default=None, help="where to build it (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        size, write_s = timed(write_checkpoint, root, args.gib, args.shards)
        ident, first_s = timed(checkpoint_identity, str(root))
        again, again_s = timed(checkpoint_identity, str(root))
        assert ident == again and len(ident) == 32
        read, read_s = timed(full_read, root)
    rows = [("write checkpoint", write_s), ("identity (first)", first_s),
            ("identity (again)", again_s), ("full read", read_s)]
    print(f"checkpoint: {size / (1 << 30):.2f} GiB in {args.shards} shards")
    print(f"{'step':<20}{'seconds':>12}")
    for name, secs in rows:
        print(f"{name:<20}{secs:>12.4f}")
    result = {"bytes": size, "shards": args.shards, "identity_first_s": first_s,
              "identity_again_s": again_s, "full_read_s": read_s, "full_read_bytes": read,
              "ratios": {"identity_vs_full_read": first_s / read_s}}
    print(f"identity / full read: {result['ratios']['identity_vs_full_read']:.5f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

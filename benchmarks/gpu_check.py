"""kvtier's own CUDA path, checked and timed: gather/scatter between KV tensors and slots.

    python -m benchmarks.gpu_check [--device cuda|cpu] [--quick] [--json PATH]

Needs only torch and this checkout (no vLLM): it is what runs on a lent GPU machine. For
each KV-tensor layout vLLM's attention backends use on CUDA (FlashAttention's
``[2, blocks, ...]``, its block-first page view, FlashInfer/Triton ``[blocks, 2, ...]`` in NHD
and HND order, MLA's ``[blocks, block_size, 576]``, a Mamba page of conv and SSM state views),
it fills the tensors with random bytes, gathers blocks into the CPU tier's slab (page-locked
on CUDA, as the worker allocates it) through :class:`BlockTransfer`, checks every byte
against an independent per-block read, scatters the slots into other blocks of zeroed
tensors and checks those bytes (and that no other block changed), and runs the host tier's
restore path: the same bytes written into a real shared segment (``SharedSegment``, a file
under ``/dev/shm``; on CUDA its mapping page-locked with ``cudaHostRegister`` as the worker
does, ``connector/vllm_connector/pinned.py``): blocks gathered straight from the KV tensors
into its slots (a save), then the slab's bytes checked in place, scattered straight from
there, and the seqlock unchanged after.

Then throughput: gather and scatter of a Llama-3-8B-shaped group (32 layers, 16-token blocks,
8 KV heads x 128, bf16: 2 MiB per block) against a plain torch copy of the same number of
bytes between the same device and pinned host memory (the bus's limit as torch reaches it),
the scatter from the shared segment, registered and (for comparison) staged, and the gather
straight into it (a CUDA worker's host-tier save), best of several repetitions, interleaved.
JSON ``ratios.gather_vs_copy``, ``scatter_vs_copy``, ``segment_scatter_vs_copy`` and
``segment_gather_vs_copy``. Exit status 1 when any byte differs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import write_result
from connector.vllm_connector.layout import build_layout
from connector.vllm_connector.pinned import HostRegistration
from connector.vllm_connector.transfer import BlockTransfer
from offload_tiers.cpu_tier import allocate_slab
from offload_tiers.shared_segment import SharedSegment, digest

Caches = dict[str, Any]


def _random_bytes(shape: tuple[int, ...], dtype: torch.dtype, device: str,
                  gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` whose bytes are uniformly random (NaN patterns included)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = itemsize
    for s in shape:
        count *= s
    raw = torch.randint(0, 256, (count,), dtype=torch.uint8, generator=gen)
    return raw.to(device).view(dtype).view(shape)


def _attention(name: str, layers: int, blocks: int, block_size: int, heads: int, dim: int,
               device: str, gen: torch.Generator) -> tuple[Caches, dict[str, list[int]]]:
    """One backend's attention KV tensors (``name`` picks the layout) and block dims."""
    caches: Caches = {}
    dims: dict[str, list[int]] = {}
    for i in range(layers):
        layer = f"model.layers.{i}.self_attn.attn"
        if name == "flash_attn":  # [2, blocks, block_size, heads, dim]
            t = _random_bytes((2, blocks, block_size, heads, dim), torch.bfloat16, device, gen)
            dims[layer] = [1]
        elif name == "flash_attn_block_first":  # the same view over block-first pages
            t = _random_bytes((blocks, 2, block_size, heads, dim), torch.bfloat16, device,
                              gen).permute(1, 0, 2, 3, 4)
            dims[layer] = [1]
        elif name == "flashinfer_nhd":  # [blocks, 2, block_size, heads, dim]
            t = _random_bytes((blocks, 2, block_size, heads, dim), torch.bfloat16, device, gen)
            dims[layer] = [0]
        elif name == "flashinfer_hnd":  # HND pages viewed as NHD
            t = _random_bytes((blocks, 2, heads, block_size, dim), torch.bfloat16, device,
                              gen).permute(0, 1, 3, 2, 4)
            dims[layer] = [0]
        elif name == "mla":  # [blocks, block_size, kv_lora_rank + rope dim]
            t = _random_bytes((blocks, block_size, 576), torch.bfloat16, device, gen)
            dims[layer] = [0]
        elif name == "mla_fp8":
            t = _random_bytes((blocks, block_size, 656), torch.uint8, device, gen)
            dims[layer] = [0]
        else:
            raise ValueError(name)
        caches[layer] = t
    return caches, dims


def _mamba(layers: int, blocks: int, device: str,
           gen: torch.Generator) -> tuple[Caches, dict[str, list[int]]]:
    """Mamba layers: conv and SSM state as views into one page per block."""
    conv_shape, ssm_shape = (3, 256), (8, 16, 32)  # bf16 conv state, fp32 SSM state
    conv_bytes = 2 * 3 * 256
    ssm_bytes = 4 * 8 * 16 * 32
    page = conv_bytes + ssm_bytes + 512  # padding, as vLLM pads pages to a common size
    caches: Caches = {}
    dims: dict[str, list[int]] = {}
    for i in range(layers):
        raw = _random_bytes((blocks, page), torch.uint8, device, gen)
        conv = raw[:, :conv_bytes].view(torch.bfloat16).view(blocks, *conv_shape)
        ssm = raw[:, conv_bytes:conv_bytes + ssm_bytes].view(torch.float32).view(
            blocks, *ssm_shape)
        caches[f"model.layers.{i}.mixer"] = [conv, ssm]
        dims[f"model.layers.{i}.mixer"] = [0, 0]
    return caches, dims


def _block_bytes(value: Any, block_dim: list[int], block: int) -> bytes:
    """An independent read of one block's bytes (every tensor of the layer, in order)."""
    tensors = value if isinstance(value, list) else [value]
    out = b""
    for tensor, dim in zip(tensors, block_dim, strict=True):
        out += tensor.select(dim, block).contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return out


def _zeroed(caches: Caches) -> Caches:
    def zero(t: torch.Tensor) -> torch.Tensor:
        z = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        z.view(torch.uint8).zero_() if z.is_contiguous() else z.zero_()
        return z
    return {k: [zero(t) for t in v] if isinstance(v, list) else zero(v)
            for k, v in caches.items()}


def check_case(name: str, caches: Caches, dims: dict[str, list[int]], blocks: int,
               kind: str, gen: torch.Generator) -> dict[str, Any]:
    """Gather, compare, scatter elsewhere, compare: byte-exact both ways?"""
    layout = build_layout(caches, [(0, kind, 16, sorted(caches))], blocks, dims)
    count = min(8, blocks // 2)
    slots = [0, 1, 2] + [4 + 2 * i for i in range(count - 3)]  # a run of slots, then gaps
    slab, owner = allocate_slab(slots[-1] + 1, layout.slot_bytes)
    mover = BlockTransfer(caches, layout, slab)
    ids = torch.randperm(blocks, generator=gen)[:count].tolist()
    mover.gather(0, ids, slots)
    layers = sorted(caches)
    gather_ok = all(
        bytes(slab[slot, :layout.slot_bytes]) == b"".join(
            _block_bytes(caches[layer], dims[layer], block) for layer in layers)
        for block, slot in zip(ids, slots, strict=True))
    target = _zeroed(caches)
    back = BlockTransfer(target, layout, slab)
    dest = [(b + 1) % blocks for b in ids]
    back.scatter(0, dest, slots)
    zero_block = b"\0" * layout.slot_bytes
    scatter_ok = all(
        b"".join(_block_bytes(target[layer], dims[layer], d) for layer in layers)
        == b"".join(_block_bytes(caches[layer], dims[layer], b) for layer in layers)
        for b, d in zip(ids, dest, strict=True))
    untouched = all(
        b"".join(_block_bytes(target[layer], dims[layer], other) for layer in layers)
        == zero_block for other in range(blocks) if other not in dest)
    # A host-tier restore: the same slots' bytes committed into a shared segment (a header
    # before each slot, a stride larger than the slot), checked in place, scattered
    # straight from there (page-locked on CUDA), and no write began meanwhile.
    from_segment = _zeroed(caches)
    with _segment(slots[-1] + 1, layout.slot_bytes + 64) as segment:
        pins = HostRegistration(segment.memory()) if caches_device(caches) == "cuda" else None
        locked = pins is not None and pins.ok
        keys = [digest(f"{name}:{slot}".encode()) for slot in slots]
        try:
            # a save straight from the KV tensors into the segment (the CUDA worker's)
            for slot in slots:
                segment.begin_write(slot)
            mover.gather(0, ids, slots, dest=torch.from_numpy(segment.payloads),
                         dest_pinned=locked)
            for slot, key in zip(slots, keys, strict=True):
                segment.commit_write(slot, key, slot + 1, layout.slot_bytes)
            seqs = segment.verify_many(slots, keys, [s + 1 for s in slots],
                                       [layout.slot_bytes] * len(slots))
            gathered_ok = None not in seqs and all(
                bytes(segment.payloads[slot, :layout.slot_bytes])
                == bytes(slab[slot, :layout.slot_bytes]) for slot in slots)
            for slot, key in zip(slots, keys, strict=True):  # the restore reads the slab's
                segment.write(slot, key, slot + 1, slab[slot, :layout.slot_bytes])
            seqs = segment.verify_many(slots, keys, [s + 1 for s in slots],
                                       [layout.slot_bytes] * len(slots))
            BlockTransfer(from_segment, layout, slab).scatter(
                0, dest, slots, source=segment.payloads, source_pinned=locked)
        finally:
            if pins is not None:
                pins.close()
        verified = None not in seqs and all(segment.unchanged(slots, seqs))  # type: ignore
    segment_ok = verified and all(
        b"".join(_block_bytes(from_segment[layer], dims[layer], d) for layer in layers)
        == b"".join(_block_bytes(caches[layer], dims[layer], b) for layer in layers)
        for b, d in zip(ids, dest, strict=True))
    del owner
    return {"layout": name, "blocks_checked": count, "slot_bytes": layout.slot_bytes,
            "gather_byte_exact": gather_ok, "scatter_byte_exact": scatter_ok,
            "other_blocks_untouched": untouched, "segment_scatter_byte_exact": segment_ok,
            "segment_gather_byte_exact": gathered_ok,
            # ``locked`` was read while registered: ``pins.ok`` is False once closed
            "segment_page_locked": locked,
            "segment_page_locked_why": "" if pins is None else pins.why}


def caches_device(caches: Caches) -> str:
    first = next(iter(caches.values()))
    return (first[0] if isinstance(first, list) else first).device.type


class _segment:
    """A shared segment in a private temporary directory, removed on exit."""

    def __init__(self, num_slots: int, slot_bytes: int) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self._dir = tempfile.TemporaryDirectory(prefix="kvtier-gpu-check-", dir=base)
        self.segment = SharedSegment.create(os.path.join(self._dir.name, "segment"), num_slots,
                                            slot_bytes)

    def __enter__(self) -> SharedSegment:
        return self.segment

    def __exit__(self, *exc: object) -> None:
        self.segment.close()
        self._dir.cleanup()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _best(fn: Callable[[], None], device: str, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def throughput(device: str, layers: int, blocks: int, moved: int, reps: int,
               gen: torch.Generator) -> dict[str, Any]:
    """Gather/scatter GB/s of a Llama-3-8B-shaped group vs a plain copy of the same bytes."""
    caches, dims = _attention("flash_attn", layers, blocks, 16, 8, 128, device, gen)
    layout = build_layout(caches, [(0, "attention", 16, sorted(caches))], blocks, dims)
    slab, owner = allocate_slab(moved, layout.slot_bytes)
    mover = BlockTransfer(caches, layout, slab)
    ids = torch.randperm(blocks, generator=gen)[:moved].tolist()
    slots = list(range(moved))
    nbytes = moved * layout.slot_bytes
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    runs: dict[str, Callable[[], Any]] = {
        "d2h": lambda: host.copy_(dev, non_blocking=True),
        "gather": lambda: mover.gather(0, ids, slots),
        "h2d": lambda: dev.copy_(host, non_blocking=True),
        "scatter": lambda: mover.scatter(0, ids, slots),
    }
    with _segment(moved, layout.slot_bytes + 64) as segment:
        for slot in slots:
            segment.write(slot, digest(b"%d" % slot), slot + 1, slab[slot, :layout.slot_bytes])
        pins = HostRegistration(segment.memory()) if device == "cuda" else None
        locked = pins is not None and pins.ok
        rows = torch.from_numpy(segment.payloads)
        runs["segment_scatter"] = lambda: mover.scatter(
            0, ids, slots, source=segment.payloads, source_pinned=locked)
        runs["segment_gather"] = lambda: mover.gather(0, ids, slots, dest=rows,
                                                      dest_pinned=locked)
        if locked:  # the same rows, not registered: what a worker without the pins gets
            runs["segment_scatter_staged"] = lambda: mover.scatter(
                0, ids, slots, source=segment.payloads, source_pinned=False)
        times = {k: float("inf") for k in runs}
        for _ in range(reps):  # interleaved: the same machine state for kvtier and the copy
            for k, fn in runs.items():
                times[k] = min(times[k], _best(fn, device, 1))
        if pins is not None:
            pins.close()
    del owner
    gbps = {k: nbytes / v / 1e9 for k, v in times.items()}
    return {"bytes": nbytes, "blocks": moved, "block_bytes": layout.slot_bytes,
            "segment_page_locked": locked, "segment_page_locked_why":
            "" if pins is None else pins.why, "gbps": gbps, "seconds": times}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small tensors (the CPU test)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    gen = torch.Generator().manual_seed(0)
    layers, blocks = (2, 12) if args.quick else (4, 64)
    cases = []
    for name in ("flash_attn", "flash_attn_block_first", "flashinfer_nhd", "flashinfer_hnd",
                 "mla", "mla_fp8"):
        caches, dims = _attention(name, layers, blocks, 16, 4, 64, device, gen)
        cases.append(check_case(name, caches, dims, blocks, "attention", gen))
    caches, dims = _mamba(layers, blocks, device, gen)
    cases.append(check_case("mamba_page", caches, dims, blocks, "mamba", gen))
    speed = (throughput(device, 2, 16, 8, 3, gen) if args.quick
             else throughput(device, 32, 512, 128, 10, gen))
    exact = all(c["gather_byte_exact"] and c["scatter_byte_exact"]
                and c["other_blocks_untouched"] and c["segment_scatter_byte_exact"]
                and c["segment_gather_byte_exact"] for c in cases)
    ratios = {"gather_vs_copy": speed["gbps"]["gather"] / speed["gbps"]["d2h"],
              "scatter_vs_copy": speed["gbps"]["scatter"] / speed["gbps"]["h2d"],
              "segment_scatter_vs_copy": speed["gbps"]["segment_scatter"] / speed["gbps"]["h2d"],
              "segment_gather_vs_copy": speed["gbps"]["segment_gather"] / speed["gbps"]["d2h"]}
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"kvtier gpu_check on {name} (torch {torch.__version__})")
    print(f"{'layout':<24}{'slot bytes':>12}{'gather':>9}{'scatter':>9}{'others':>9}"
          f"{'seg in':>9}{'seg out':>9}")
    for c in cases:
        print(f"{c['layout']:<24}{c['slot_bytes']:>12}"
              f"{'exact' if c['gather_byte_exact'] else 'DIFFER':>9}"
              f"{'exact' if c['scatter_byte_exact'] else 'DIFFER':>9}"
              f"{'same' if c['other_blocks_untouched'] else 'CHANGED':>9}"
              f"{'exact' if c['segment_gather_byte_exact'] else 'DIFFER':>9}"
              f"{'exact' if c['segment_scatter_byte_exact'] else 'DIFFER':>9}")
    g = speed["gbps"]
    print(f"\n{speed['blocks']} blocks of {speed['block_bytes']} B ({speed['bytes'] / 2**20:.0f}"
          " MiB), GB/s, best of the repetitions:")
    print(f"  gather (KV -> slots)  {g['gather']:8.2f}   plain copy device->host {g['d2h']:8.2f}"
          f"   ratio {ratios['gather_vs_copy']:.2f}")
    print(f"  scatter (slots -> KV) {g['scatter']:8.2f}   plain copy host->device {g['h2d']:8.2f}"
          f"   ratio {ratios['scatter_vs_copy']:.2f}")
    locked = "page-locked" if speed["segment_page_locked"] else (
        f"not page-locked: {speed['segment_page_locked_why'] or 'CPU'}")
    print(f"  scatter from the shared segment ({locked}) {g['segment_scatter']:8.2f}"
          f"   ratio {ratios['segment_scatter_vs_copy']:.2f}")
    print(f"  gather into the shared segment ({locked}) {g['segment_gather']:8.2f}"
          f"   ratio {ratios['segment_gather_vs_copy']:.2f}")
    if "segment_scatter_staged" in g:
        print(f"  scatter from the shared segment, not registered (staged) "
              f"{g['segment_scatter_staged']:8.2f}")
    report = {"device": name, "torch": torch.__version__, "byte_exact": exact,
              "cases": cases, "throughput": speed, "ratios": ratios}
    write_result(args.json, report)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

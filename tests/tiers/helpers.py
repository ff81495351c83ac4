"""Small builders shared by the tier tests (pure data, no servers), and a thread runner
that makes a thread's exception the test's failure."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence

from offload_tiers.keys import BlockKey, BlockKind, Namespace

NS_A = Namespace(model="llama-a", dtype="float32", kv_layout="nhd", block_size=16)
NS_B = Namespace(model="llama-b", dtype="float32", kv_layout="nhd", block_size=16)
NS_A_TENANT2 = Namespace(model="llama-a", dtype="float32", kv_layout="nhd", block_size=16,
                         tenant="tenant-2")


def key(i: int, *, ns: Namespace = NS_A, group: int = 0, partial: bool = False,
        block_size: int = 16, hash_salt: str = "") -> BlockKey:
    """Block ``i`` of a chain: FULL covers (i+1)*block_size tokens, PARTIAL a bit less."""
    h = hashlib.blake2b(f"{hash_salt}{i}".encode(), digest_size=8).digest()
    end = (i + 1) * block_size
    if partial:
        return BlockKey(ns.fingerprint, group, h + b"p", end - block_size // 2, BlockKind.PARTIAL)
    return BlockKey(ns.fingerprint, group, h, end, BlockKind.FULL)


def payload(k: BlockKey, size: int = 256, version: int = 0) -> bytes:
    """Deterministic bytes derived from every field of the key (content addressing)."""
    seed = f"{k.fingerprint}:{k.group}:{k.block_hash.hex()}:{k.num_tokens}:{k.kind}:{version}"
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def run_threads(workers: Sequence[Callable[[], None]],
                loopers: Sequence[Callable[[], None]] = (), *,
                stop: threading.Event | None = None, timeout: float = 120.0) -> None:
    """Run every callable in its own thread: ``workers`` to the end, then set ``stop`` and
    join ``loopers`` (which loop until it is set). Re-raises the first exception any thread
    raised (the count of others in its notes); fails if a thread is still running after
    ``timeout`` seconds."""
    if loopers and stop is None:
        raise ValueError("loopers need a stop event")
    errors: list[BaseException] = []

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                errors.append(exc)
        return run

    def start(fns: Sequence[Callable[[], None]]) -> list[threading.Thread]:
        threads = [threading.Thread(target=guarded(fn), daemon=True) for fn in fns]
        for th in threads:
            th.start()
        return threads

    deadline = time.monotonic() + timeout
    busy, looping = start(workers), start(loopers)
    for th in busy:
        th.join(max(0.0, deadline - time.monotonic()))
    if stop is not None:
        stop.set()
    for th in looping:
        th.join(max(0.0, deadline - time.monotonic()))
    if errors:
        if len(errors) > 1:
            errors[0].add_note(f"{len(errors) - 1} more thread(s) raised too")
        raise errors[0]
    hung = sum(th.is_alive() for th in busy + looping)
    assert hung == 0, f"{hung} thread(s) still running after {timeout} s"

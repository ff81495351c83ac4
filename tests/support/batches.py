"""Batched workloads shared by the e2e tests: prompts that share prefixes, aligned or not."""

from __future__ import annotations


def toks(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids of the tiny vocabulary (no special ids 0..3)."""
    return [4 + (seed * 7919 + i * 104729) % 508 for i in range(n)]


A, B, C = toks(1, 96), toks(2, 77), toks(3, 128)  # shared prefixes: 3 blocks, 77, 4 blocks
WARM = [
    A + toks(10, 20),       # 116: shares 3 aligned blocks with the next two
    A + toks(11, 32),       # 128: block-aligned
    A[:64] + toks(12, 41),  # 105: shares 2 blocks of A
    B + toks(13, 15),       # 92: shares 77 tokens (not block-aligned) with the next
    B + toks(14, 51),       # 128: block-aligned
    C,                      # 128: whole prompt block-aligned, repeated below
    C + toks(15, 9),        # 137
    toks(16, 70),           # unrelated
]
# The second batch: even prompts grow (hit ends at their old block boundaries), odd ones
# repeat exactly (whole-prompt hits, offered as num_tokens - 1).
HIT = [p + toks(20 + i, 3 + 5 * i) if i % 2 == 0 else p for i, p in enumerate(WARM)]

"""Our token-id hashing equals vLLM's own ``hash_block_tokens`` for every algorithm."""

from __future__ import annotations

import pytest

from connector.events.token_hashing import ALGORITHMS, TokenHasher
from tests.daemon.vllm_required import import_vllm

kcu = import_vllm("vllm.v1.core.kv_cache_utils")
hashing = import_vllm("vllm.utils.hashing")


@pytest.mark.parametrize("algo", sorted(ALGORITHMS))
@pytest.mark.parametrize("unit", [16, 32])
def test_chain_equals_vllm(algo: str, unit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    seed = "4242" if algo.startswith("xxhash") else None
    if seed is not None:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    else:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    fn = hashing.get_hash_fn_by_name(algo)
    kcu.init_none_hash(fn)
    tokens = [(i * 7919) % 50_000 for i in range(5 * unit + 3)]
    extra = [None, ("salt",), None, None, ("lora-a",)]
    ours = TokenHasher(algo, unit, seed=seed)
    assert ours.none_hash == kcu.NONE_HASH
    parent = None
    expected_raw, expected_int = [], []
    for i in range(len(tokens) // unit):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * unit:(i + 1) * unit], extra[i])
        expected_raw.append(parent)
        expected_int.append(kcu.maybe_convert_block_hash(parent))
    assert ours.raw_chain(tokens, extra) == expected_raw
    assert ours.chain(tokens, extra) == expected_int
    assert len(expected_int) == 5  # the trailing 3 tokens make no hash


def test_bad_settings_fail_clearly() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        TokenHasher("md5", 16)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        TokenHasher("xxhash", 16)
    with pytest.raises(ValueError, match="positive"):
        TokenHasher("sha256", 0)

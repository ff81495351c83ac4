"""Tiny random-weight models built locally, for the demo and the end-to-end tests.

No model can be downloaded here, so kvtier builds its own: a 2-layer Llama (hidden 128,
head_dim 32) and a 2-layer GraniteMoeHybrid (one Mamba layer, one attention layer), each
with a word-level tokenizer over a fixed vocabulary. Checkpoints are cached outside the
repository (``$KVTIER_MODEL_CACHE`` or ``~/.cache/kvtier/models``) and built once.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

VOCAB_SIZE = 512
BUILD_VERSION = "2"
SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3
SPECIAL_ROLES = ("pad_token", "bos_token", "eos_token", "unk_token")
UNK = SPECIALS[3]  # bump to rebuild cached checkpoints when the recipe changes


def cache_root() -> Path:
    """Where built checkpoints live (never inside the repository)."""
    return Path(os.environ.get("KVTIER_MODEL_CACHE", Path.home() / ".cache" / "kvtier" / "models"))


def vocabulary() -> list[str]:
    """Special tokens, then ``w0``..``wN``: prompts are written as space-separated words."""
    return list(SPECIALS) + [f"w{i}" for i in range(VOCAB_SIZE - len(SPECIALS))]


def _save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, **dict(zip(SPECIAL_ROLES, SPECIALS, strict=True))
    )
    fast.save_pretrained(path)


def _build(path: Path, make_model: Callable[[], object]) -> Path:
    """Build into a temporary sibling, then rename: concurrent builders never see half a model."""
    marker = path / "kvtier-build.json"
    if marker.exists() and json.loads(marker.read_text()).get("version") == BUILD_VERSION:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        import torch

        torch.manual_seed(0)
        model = make_model()
        model.save_pretrained(tmp, safe_serialization=True)
        _save_tokenizer(tmp)
        (tmp / "kvtier-build.json").write_text(json.dumps({"version": BUILD_VERSION}))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_llama(path: Path | None = None) -> Path:
    """A 2-layer random Llama: hidden 128, 4 heads of 32, 2 KV heads, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make() -> object:
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.2,
            torch_dtype="float32", tie_word_embeddings=False,
        )
        return LlamaForCausalLM(config)

    return _build(path or cache_root() / "tiny-llama", make)


def tiny_hybrid(path: Path | None = None) -> Path:
    """A 2-layer random GraniteMoeHybrid: one Mamba2 layer, then one attention layer."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    def make() -> object:
        config = GraniteMoeHybridConfig(
            vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256,
            shared_intermediate_size=256, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=2, num_experts_per_tok=1,
            mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32,
            max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.2,
            position_embedding_type="rope", torch_dtype="float32", tie_word_embeddings=False,
        )
        return GraniteMoeHybridForCausalLM(config)

    return _build(path or cache_root() / "tiny-hybrid", make)


def prefill_llama(path: Path | None = None) -> Path:
    """A 6-layer random Llama (hidden 256, 4 heads of 64, 2 KV heads, float32, 9k positions)
    big enough that prefill dominates a request's time on a CPU, as on a GPU for real
    models (``benchmarks/bench_ttft.py``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    def make() -> object:
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=1024,
            num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=9216, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            initializer_range=0.2, torch_dtype="float32", tie_word_embeddings=False,
        )
        return LlamaForCausalLM(config)

    return _build(path or cache_root() / "prefill-llama", make)


#: Seeds of :func:`prompt_words` that differ by a multiple of this give the same prompt.
PROMPT_SEED_PERIOD = VOCAB_SIZE - 4


def prompt_words(seed: int, n: int, offset: int = 0) -> str:
    """A deterministic prompt of ``n`` vocabulary words (no specials) for workloads.

    Word ``i`` depends on ``seed`` modulo :data:`PROMPT_SEED_PERIOD` only: seeds meant to
    give prompts that share no prefix must differ modulo it."""
    span = PROMPT_SEED_PERIOD
    return " ".join(f"w{(seed * 7919 + (i + offset) * 104729) % span}" for i in range(n))

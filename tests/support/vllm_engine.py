"""Standard settings for a real vLLM engine on the CPU with kvtier's tiny models.

Import this only from e2e tests: ``import vllm`` costs ~5-15 s and 0.6 GB.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# In-process engine (~5 s start instead of ~30 s) and no hub access.
CPU_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def apply_cpu_engine_env() -> None:
    """Set the environment a CPU engine needs, without overriding what the caller set."""
    for key, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def llama_engine_kwargs(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """``LLM(**kwargs)`` for the tiny Llama: one KV-cache group, block size 32."""
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=1024, max_num_seqs=4, enable_prefix_caching=True, seed=0,
    )
    kwargs.update(overrides)
    return kwargs


def hybrid_engine_kwargs(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """``LLM(**kwargs)`` for the tiny hybrid (Mamba + attention) with partial prefix entries.

    On the CPU the Mamba kernel needs ``max_num_batched_tokens`` <= the block size, and
    ``prefix_match_unit=32`` makes vLLM register partial entries inside larger blocks.
    """
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=32,
        enable_prefix_caching=True, prefix_match_unit=32, seed=0,
    )
    kwargs.update(overrides)
    return kwargs


def kvtier_transfer_config(extra_config: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_config`` that loads kvtier's connector by module path."""
    return {
        "kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }

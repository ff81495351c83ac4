"""Settings for a vLLM engine on the CPU with kvtier's tiny models (demo, tests, benchmarks).

One place for what took hours to find: the in-process engine, the CPU backend's limits
(float32, eager, block size a multiple of 32), and what the hybrid model needs for partial
prefix entries. Importing this module does not import vLLM.
"""

from __future__ import annotations

import os
from typing import Any

# In-process engine (~5 s start instead of ~30 s), no hub access, small KV cache.
CPU_ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

MODELS = ("llama", "hybrid")


def apply_cpu_engine_env() -> None:
    """Set the environment a CPU engine needs, without overriding what the caller set."""
    for key, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def engine_kwargs(model: str, model_dir: str, **overrides: Any) -> dict[str, Any]:
    """``LLM(**kwargs)`` for a tiny model on the CPU backend.

    ``llama``: one KV-cache group, block size 32. ``hybrid`` (Mamba + attention):
    ``max_num_batched_tokens`` <= block size (the CPU Mamba kernel needs it) and
    ``prefix_match_unit=32`` so vLLM registers partial prefix entries inside its blocks.
    """
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), dtype="float32", enforce_eager=True, block_size=32,
        max_model_len=1024, enable_prefix_caching=True, seed=0,
    )
    if model == "llama":
        kwargs.update(max_num_seqs=4)
    elif model == "hybrid":
        kwargs.update(max_num_seqs=2, max_num_batched_tokens=32, prefix_match_unit=32)
    else:
        raise ValueError(f"unknown model {model!r}: expected one of {', '.join(MODELS)}")
    kwargs.update(overrides)
    return kwargs


def kvtier_transfer_config(extra_config: dict[str, Any]) -> dict[str, Any]:
    """The ``kv_transfer_config`` a user writes to load kvtier by module path."""
    return {
        "kv_connector": "TieredOffloadingConnector",
        "kv_connector_module_path": "connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }

"""Settings for a vLLM engine on the CPU with kvtier's tiny models (demo, tests, benchmarks).

One place for what took hours to find: the CPU backend's limits (float32, eager, block size a
multiple of 32), what the hybrid model needs for partial prefix entries, and how to run
tensor parallelism on a 2-core machine. Engines run with vLLM's default executors (engine
core and workers in their own processes), as users run them. Importing this module does not
import vLLM.
"""

from __future__ import annotations

import os
from typing import Any

# No hub access, small KV cache. (vLLM's default multiprocess executors: no
# VLLM_ENABLE_V1_MULTIPROCESSING override.)
CPU_ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

MODELS = ("llama", "hybrid")

# tensor_parallel_size=2 on the CPU backend: one core per rank (else vLLM refuses with
# "Not enough allowed NUMA nodes").
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


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
        max_model_len=1024, enable_prefix_caching=True, seed=0, disable_log_stats=False,
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

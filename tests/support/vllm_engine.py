"""Engine settings for e2e tests: thin wrappers over :mod:`connector.demo.presets`.

Import vLLM only inside e2e tests: ``import vllm`` costs ~5-15 s and 0.6 GB.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from connector.demo.presets import (
    CPU_ENGINE_ENV,
    apply_cpu_engine_env,
    engine_kwargs,
    kvtier_transfer_config,
)

__all__ = ["CPU_ENGINE_ENV", "apply_cpu_engine_env", "hybrid_engine_kwargs",
           "kvtier_transfer_config", "llama_engine_kwargs"]


def llama_engine_kwargs(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """``LLM(**kwargs)`` for the tiny Llama."""
    return engine_kwargs("llama", str(model_dir), **overrides)


def hybrid_engine_kwargs(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """``LLM(**kwargs)`` for the tiny hybrid with partial prefix entries."""
    return engine_kwargs("hybrid", str(model_dir), **overrides)

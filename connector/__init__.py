"""kvtier's vLLM-facing half: the event model, the partial-aware index, the daemon, the connector.

``TieredOffloadingConnector`` is a lazy module attribute, so that vLLM can load it with
``kv_connector_module_path="connector"`` while ``import connector.events.wire`` (the daemon's
path) never imports vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TieredOffloadingConnector"]


def __getattr__(name: str) -> Any:
    if name == "TieredOffloadingConnector":
        from connector.vllm_connector.connector import TieredOffloadingConnector

        return TieredOffloadingConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")

"""A kv-connector that does nothing: what vLLM itself spends on having a connector at all.

Every hook of ``KVConnectorBase_V1`` is a no-op (no hit, nothing saved, empty metadata);
``SupportsHMA`` so it loads with hybrid models too. Whatever a no-hit pass costs with it
over vLLM alone is vLLM's per-step connector plumbing (metadata built and sent every step,
worker outputs gathered, the per-layer hooks, one more core reserved on the CPU platform),
a floor under every real connector's overhead. Load it with::

    kv_connector="NullConnector",
    kv_connector_module_path="benchmarks.peers.null_connector",
    kv_role="kv_both",
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)


class NullConnector(KVConnectorBase_V1, SupportsHMA):
    """No hits, no saves, empty metadata."""

    # ---------------------------------------------------------------- worker side
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    # ---------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, None

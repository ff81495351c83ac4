"""vLLM general plugin: registers ``TieredOffloadingConnector`` so no module path is needed."""

from __future__ import annotations

CONNECTOR_NAME = "TieredOffloadingConnector"


def register() -> None:
    """Called by vLLM in every process through the ``vllm.general_plugins`` entry point."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "connector.vllm_connector.connector", CONNECTOR_NAME
    )

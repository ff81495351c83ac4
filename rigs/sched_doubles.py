"""Small stand-ins for vLLM's Request and KVCacheBlock, for the connector's scheduler tests.

Pure data with the attributes the scheduler half reads (see ``connector.vllm_connector.scheduler``'s
``RequestLike`` / ``BlockLike``); no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Req:
    """A request of ``num_tokens`` tokens with one hash (``h0``, ``h1``, ...) per ``unit``."""

    request_id: str
    num_tokens: int
    cache_salt: str | None = None
    unit: int = 32
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids = list(range(self.num_tokens))
        self.block_hashes = [f"h{i}".encode() for i in range(self.num_tokens // self.unit)]


@dataclass
class Blk:
    block_id: int
    block_hash_num_tokens: int | None = None
    is_null: bool = False

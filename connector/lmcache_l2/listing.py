"""``list_l2_keys`` for the adapter: the keys under its prefix, paged (plain kvtier: redis-py).

Walks ``SCAN MATCH {prefix}:*`` over the server (every primary of a Cluster, in name order),
keeps the names :func:`~offload_tiers.keys.parse_key_name` reads whose fingerprint the
namespace registry names (and, when asked, whose model matches), and reads each kept key's
length (``STRLEN``, less kvtier's 64-byte header). The cursor is opaque to LMCache:
``v1:{node}:{scan cursor}:{names of that SCAN batch already returned}``; resuming replays the
batch's SCAN call, so it inherits SCAN's guarantees (a key present for the whole walk is
listed; one added or removed meanwhile may or may not be).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from connector.lmcache_l2.keys import ChunkOwner, KeyMapper, registry_name
from offload_tiers.codec import HEADER_SIZE
from offload_tiers.keys import parse_key_name


@dataclass(frozen=True)
class ListedKey:
    owner: ChunkOwner
    group: int
    chunk_hash: bytes
    size: int


@dataclass(frozen=True)
class ListPage:
    items: list[ListedKey]
    next_cursor: str | None


def _parse_cursor(cursor: str | None) -> tuple[int, int, int]:
    if cursor is None:
        return 0, 0, 0
    parts = cursor.split(":")
    if len(parts) != 4 or parts[0] != "v1":
        raise ValueError(f"malformed cursor {cursor!r}")
    try:
        node, scan, skip = (int(p) for p in parts[1:])
    except ValueError:
        raise ValueError(f"malformed cursor {cursor!r}") from None
    if node < 0 or scan < 0 or skip < 0:
        raise ValueError(f"malformed cursor {cursor!r}")
    return node, scan, skip


def _nodes(client: Any) -> list[Any]:
    """One redis-py client per server to SCAN: the client itself, or each Cluster primary's."""
    if not hasattr(client, "get_primaries"):
        return [client]
    primaries = sorted(client.get_primaries(), key=lambda node: node.name)
    return [client.get_redis_connection(node) for node in primaries]


def registry(client: Any, mapper: KeyMapper, prefix: str) -> dict[str, ChunkOwner]:
    """The registry's entries that digest back to their fingerprints."""
    raw = client.hgetall(registry_name(prefix)) or {}
    out: dict[str, ChunkOwner] = {}
    for fp, value in raw.items():
        fp_text = fp.decode() if isinstance(fp, bytes) else str(fp)
        owner = mapper.read_registry_entry(fp_text, value)
        if owner is not None:
            out[fp_text] = owner
    return out


def list_keys(client: Any, mapper: KeyMapper, prefix: str, *, model_name: str | None,
              page_size: int, cursor: str | None) -> ListPage:
    """One page of at most ``page_size`` keys (see the module docstring)."""
    if page_size <= 0:
        raise ValueError(f"page_size must be positive (got {page_size})")
    node_i, scan_cur, skip = _parse_cursor(cursor)
    owners = registry(client, mapper, prefix)
    if model_name is not None:
        owners = {fp: o for fp, o in owners.items() if o.model_name == model_name}
    nodes = _nodes(client)
    head = f"{prefix}:".encode()
    items: list[ListedKey] = []
    while node_i < len(nodes) and len(items) < page_size:
        node = nodes[node_i]
        next_cur, names = node.scan(cursor=scan_cur, match=head + b"*",
                                    count=max(page_size, 100))
        batch: list[tuple[bytes, ChunkOwner, int, bytes]] = []
        for name in names:
            name = name if isinstance(name, bytes) else str(name).encode()
            parsed = parse_key_name(name[len(head):]) if name.startswith(head) else None
            owner = owners.get(parsed.digest.hex()) if parsed is not None else None
            if parsed is not None and owner is not None:
                batch.append((name, owner, parsed.group, parsed.block_hash))
        batch = batch[skip:]
        room = page_size - len(items)
        take, more = batch[:room], len(batch) > room
        if take:
            pipe = node.pipeline(transaction=False)
            for name, *_ in take:
                pipe.strlen(name)
            for (_, owner, group, chunk_hash), length in zip(take, pipe.execute(), strict=True):
                if isinstance(length, int) and length > HEADER_SIZE:
                    items.append(ListedKey(owner, group, chunk_hash, length - HEADER_SIZE))
        if more:
            return ListPage(items, f"v1:{node_i}:{scan_cur}:{skip + room}")
        skip = 0
        if int(next_cur) == 0:
            node_i, scan_cur = node_i + 1, 0
        else:
            scan_cur = int(next_cur)
    done = node_i >= len(nodes)
    return ListPage(items, None if done else f"v1:{node_i}:{scan_cur}:0")

"""Validated HTTP bodies: ``POST /lookup`` (and ``/entries``) and ``POST /score``.

Every rejection is a :class:`ValueError` whose message names the offending field, quoted
(``'token_ids' must be ...``): the HTTP layer answers it with a 400 as it is. Token ids are
hashed here, as the request is parsed, so the index lock is never held for hashing.

A hash is what the engine sent on the wire, compared exactly: an int (vLLM's default) or
bytes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``). In a body an int is a JSON int or a
``0x``-prefixed hex string (any number of digits: Python's ``hex(h)``, for clients whose
JSON numbers stop at 2**53); bytes are plain hex, two digits a byte (``bytes.hex()``, as
``/entries`` answers). Plain hex with an odd number of digits is refused: it could be an
int written without its ``0x`` or bytes missing a digit, and either guess would miss.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from connector.events.score import weights_from
from connector.events.token_hashing import TokenHasher

__all__ = ["LookupRequest", "ScoreRequest"]

MAX_HASHES = 1_000_000


class _Chain:
    """The hash chain of a body: ``block_hashes`` (+ ``hash_block_size``) or ``token_ids``."""

    __slots__ = ("block_hashes", "unit")

    def _chain(self, body: dict[str, Any], hasher: TokenHasher | None) -> None:
        if "token_ids" in body:
            self._from_tokens(body, hasher)
            return
        if "block_hashes" not in body:
            raise ValueError("give 'block_hashes' or 'token_ids'")
        self.block_hashes = _hashes(body["block_hashes"])
        unit = body.get("hash_block_size")
        self.unit = None if unit is None else _int_field(body, "hash_block_size", 0, minimum=1)

    def _from_tokens(self, body: dict[str, Any], hasher: TokenHasher | None) -> None:
        if hasher is None:
            raise ValueError("look-up by 'token_ids' needs 'token_hashing' in the daemon config")
        if "block_hashes" in body or "hash_block_size" in body:
            raise ValueError("give either 'token_ids' or 'block_hashes' (with "
                             "'hash_block_size'), not both")
        toks = body["token_ids"]
        if (not isinstance(toks, list) or len(toks) > 16 * MAX_HASHES
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**63
                           for t in toks)):
            raise ValueError("'token_ids' must be a list of non-negative ints")
        self.block_hashes = hasher.chain(toks)
        self.unit = hasher.hash_block_size


class LookupRequest(_Chain):
    """A validated ``POST /lookup`` body."""

    __slots__ = ("group_idx", "publisher")

    MAX_HASHES = MAX_HASHES

    def __init__(self, body: Any, hasher: TokenHasher | None = None) -> None:
        _object(body, {"block_hashes", "token_ids", "group_idx", "hash_block_size",
                       "publisher"})
        self.group_idx = _int_field(body, "group_idx", 0, minimum=0)
        pub = body.get("publisher")
        if pub is not None and not isinstance(pub, str):
            raise ValueError("'publisher' must be a string")
        self.publisher = pub
        self._chain(body, hasher)


class ScoreRequest(_Chain):
    """A validated ``POST /score`` body: the chain, the groups every engine must restore
    (``group_idx``: one int or a list; default each engine's announced groups) and tier
    ``weights`` (defaults: :data:`connector.events.score.DEFAULT_WEIGHTS`)."""

    __slots__ = ("groups", "weights")

    def __init__(self, body: Any, hasher: TokenHasher | None = None,
                 default_weights: dict[str, float] | None = None,
                 media: Iterable[str] = ()) -> None:
        _object(body, {"block_hashes", "token_ids", "group_idx", "hash_block_size",
                       "weights"})
        self.groups = _groups(body.get("group_idx"))
        given = body.get("weights")
        if given is not None and not isinstance(given, dict):
            raise ValueError("'weights' must be an object of medium -> number, e.g. "
                             '{"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}')
        weights_from(given, known_media=media)  # a medium's typo is a 400, not a weight of 0
        self.weights = weights_from({**(default_weights or {}), **(given or {})})
        self._chain(body, hasher)


def _object(body: Any, known: set[str]) -> None:
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object with 'block_hashes' or 'token_ids'")
    unknown = set(body) - known
    if unknown:
        raise ValueError(f"unknown fields: {sorted(unknown)}")


def _hex(i: int, text: str) -> int | bytes:
    """``0x1f`` -> the int 31; ``1f2e`` -> the bytes 1f 2e (see the module's rules)."""
    digits = text[2:] if text[:2] in ("0x", "0X") else None
    if digits is not None:
        if not digits or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise ValueError(f"block_hashes[{i}] is not a hex string: '0x' takes hex digits "
                             "(an int hash)")
        return int(digits, 16)
    if len(text) % 2:
        raise ValueError(f"block_hashes[{i}] has an odd number of hex digits: write a bytes "
                         "hash two digits a byte (bytes.hex()), an int hash as a JSON int or "
                         "'0x...'")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"block_hashes[{i}] is not a hex string") from None


def _hashes(hashes: Any) -> list[int | bytes]:
    if not isinstance(hashes, list):
        raise ValueError("'block_hashes' must be a list of ints (or hex strings)")
    if len(hashes) > MAX_HASHES:
        raise ValueError(f"'block_hashes' has more than {MAX_HASHES} entries")
    out: list[int | bytes] = []
    for i, h in enumerate(hashes):
        if isinstance(h, bool):
            raise ValueError(f"block_hashes[{i}] must be an int or hex string, not bool")
        if isinstance(h, int):
            out.append(h)
        elif isinstance(h, str):
            out.append(_hex(i, h))
        else:
            raise ValueError(f"block_hashes[{i}] must be an int or hex string")
    return out


def _groups(v: Any) -> list[int] | None:
    if v is None:
        return None
    items = v if isinstance(v, list) else [v]
    if not items or not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 2**31
                            for g in items):
        raise ValueError("'group_idx' must be an integer >= 0 or a non-empty list of them")
    return sorted(set(items))


def _int_field(body: dict[str, Any], name: str, default: int, minimum: int) -> int:
    v = body.get(name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"'{name}' must be an integer >= {minimum}")
    return v

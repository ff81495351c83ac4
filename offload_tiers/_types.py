"""Shared type aliases."""

from __future__ import annotations

from typing import Any, TypeAlias

#: Anything exposing the buffer protocol (bytes, bytearray, memoryview, numpy arrays).
BytesLike: TypeAlias = bytes | bytearray | memoryview | Any

"""The idempotency layers after the claim: content-addressed output, fenced pointers, upserts.

- :class:`ContentStore`: a repeat writes identical bytes to an identical path;
- :class:`FilePointer`, :class:`RedisPointer`: publishing is one atomic swap, and a
  swap carrying a fence below the last accepted one raises :class:`~fenced.StaleFence`;
"""

from __future__ import annotations

from ._content import ContentStore, Ref
from ._pointer import FilePointer, Published, RedisPointer

__all__ = [
    "ContentStore",
    "FilePointer",
    "Published",
    "RedisPointer",
    "Ref",
]


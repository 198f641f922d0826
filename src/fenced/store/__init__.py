"""The idempotency layers after the claim: content-addressed output, fenced pointers, upserts.

- :class:`ContentStore`: a repeat writes identical bytes to an identical path;
- :class:`FilePointer`, :class:`RedisPointer`: publishing is one atomic swap, and a
  swap carrying a fence below the last accepted one raises :class:`~fenced.StaleFence`;
  both are a :class:`Pointer`, the protocol ``ContentStore.gc(keep=[...])`` reads;
- :func:`upsert`: repeated ingestion converges, rows stored with a higher fence stay.

``upsert`` needs SQLAlchemy (``pip install 'fenced[sql]'``); it is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._public import publish as _publish
from ._content import ContentStore
from ._pointer import FilePointer, RedisPointer
from ._published import Pointer, Published, Ref

if TYPE_CHECKING:
    from ._upsert import UpsertResult, upsert

__all__ = [
    "ContentStore",
    "FilePointer",
    "Pointer",
    "Published",
    "RedisPointer",
    "Ref",
    "UpsertResult",
    "upsert",
]


# Tracebacks, help() and pickles name these as this package exports them.
_publish(__name__, globals(), __all__)


def __getattr__(name: str) -> Any:
    # Imported lazily so the store and pointers work without SQLAlchemy installed;
    # without it, this raises an ImportError that names the extra to install.
    if name in ("upsert", "UpsertResult"):
        from . import _upsert

        found = getattr(_upsert, name)
        _publish(__name__, {name: found}, [name])
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The idempotency layers after the claim: content-addressed output, fenced pointers, upserts.

- :class:`ContentStore`: a repeat writes identical bytes to an identical path;
- :class:`FilePointer`, :class:`RedisPointer`: publishing is one atomic swap, and a
  swap carrying a fence below the last accepted one raises :class:`~fenced.StaleFence`;
  both are a :class:`Pointer`, the protocol ``ContentStore.gc(keep=[...])`` reads;
- :class:`ObjectStore`, :class:`ObjectPointer`: the same on object storage (S3, GCS,
  Azure Blob, S3-compatible): blobs written create-only, a pointer object replaced only
  If-Match its ETag after its fence is compared, on a store probed for honouring both;
- :func:`upsert`: repeated ingestion converges, rows stored with a higher fence stay.

``upsert`` needs SQLAlchemy (``pip install 'fenced[sql]'``) and the object store needs
obstore (``pip install 'fenced[objstore]'``); each is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._public import publish as _publish
from ._content import ContentStore
from ._pointer import FilePointer, RedisPointer
from ._published import Pointer, Published, Ref

if TYPE_CHECKING:
    from ._object import ObjectPointer, ObjectStore, ProbeCheck
    from ._upsert import UpsertResult, upsert

__all__ = [
    "ContentStore",
    "FilePointer",
    "ObjectPointer",
    "ObjectStore",
    "Pointer",
    "ProbeCheck",
    "Published",
    "RedisPointer",
    "Ref",
    "UpsertResult",
    "upsert",
]


# Tracebacks, help() and pickles name these as this package exports them.
_publish(__name__, globals(), __all__)


def __getattr__(name: str) -> Any:
    # Imported lazily so the store and pointers work without SQLAlchemy or obstore
    # installed; without them, using these raises an ImportError naming the extra.
    if name in ("upsert", "UpsertResult"):
        from . import _upsert

        found = getattr(_upsert, name)
        _publish(__name__, {name: found}, [name])
        return found
    if name in ("ObjectStore", "ObjectPointer", "ProbeCheck"):
        # _object imports obstore only when a store is made: importing it always works.
        from . import _object

        found = getattr(_object, name)
        _publish(__name__, {name: found}, [name])
        return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

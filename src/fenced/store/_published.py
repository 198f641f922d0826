"""What a build publishes, and the Pointer protocol that publishes it.

:class:`Ref` names a stored object, :class:`Published` is what a pointer shows, and
:class:`Pointer` is what every pointer does (:class:`~fenced.store.FilePointer`,
:class:`~fenced.store.RedisPointer`, or one of your own): swap under a fence, read.
The content store and the pointers both use these, so they live apart from either.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, Union, runtime_checkable

__all__ = ["Pointer", "Published", "Ref", "Target"]


@dataclass(frozen=True)
class Ref:
    """A stored object: its SHA-256 digest (hex), its path in the store and its size."""

    digest: str
    path: Path
    size: int

    def __str__(self) -> str:
        return self.digest


@dataclass(frozen=True)
class Published:
    """What a pointer publishes: a target, the fence that published it, and its digest."""

    target: str
    fence: int
    digest: str | None = None
    size: int | None = None
    #: Why a logged publish could not be read (``RedisPointer.history``), else None;
    #: its other fields are then what could be read, and its fence 0.
    unreadable: str | None = None

    @property
    def ref(self) -> Ref | None:
        """The published object as a Ref, when a Ref was published."""
        if self.digest is None or self.size is None:
            return None
        return Ref(self.digest, Path(self.target), self.size)

    def as_dict(self) -> dict[str, str | int | None]:
        """JSON-ready form."""
        out = asdict(self)
        if self.unreadable is None:
            del out["unreadable"]
        return out


#: What a pointer can publish: a stored object, another pointer's state, or a path.
Target = Union[Ref, Published, str, "os.PathLike[str]"]


@runtime_checkable
class Pointer(Protocol):
    """Publishes one target at a time, atomically, refusing a fence below one it accepted."""

    def swap(self, target: Target, *, fence: int) -> Published:
        """Publish ``target`` under ``fence``; StaleFence if a higher fence was accepted."""
        ...

    def read(self) -> Published | None:
        """The last published target and its fence; None before the first swap."""
        ...

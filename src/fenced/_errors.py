"""Every error fenced raises, under one root.

FencedError                      root; carries .name, .token, .fence
 ├── ConfigError (ValueError)    bad input, raised at definition time; names the fix
 ├── ClaimUnavailable            the claim store could not be reached: fail closed
 │    └── CorruptKey              a key of the claim holds a value fenced cannot use
 ├── ClaimHeld                   another live holder has the claim (the "raise" policy)
 ├── ClaimLost                   the claim expired or was taken while we worked
 │    └── ClaimInterrupted        raised inside work that never checked, when it was lost
 ├── NotOwner                    an operation on a claim this process does not hold
 ├── StaleFence                  a write carried a fence lower than one already accepted
 └── StoreError                  content store / pointer / upsert problems
      └── CorruptObject          a stored object no longer matches its digest
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar


class _About(Protocol):
    """What an error can be about: a claim (its name, token and fence)."""

    name: str
    token: str | None
    fence: int | None


E = TypeVar("E", bound="FencedError")

__all__ = [
    "ClaimHeld",
    "ClaimInterrupted",
    "ClaimLost",
    "ClaimUnavailable",
    "ConfigError",
    "CorruptKey",
    "CorruptObject",
    "FencedError",
    "NotOwner",
    "StaleFence",
    "StoreError",
]


class FencedError(Exception):
    """Root of every fenced error; carries the claim name, token and fence it is about."""

    def __init__(
        self,
        message: str,
        *,
        name: str | None = None,
        token: str | None = None,
        fence: int | None = None,
        **context: object,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.name = name
        self.token = token
        self.fence = fence
        # Subclasses declare what else they carry (e.g. ClaimHeld.expires_in).
        for key, value in context.items():
            if not any(key in vars(k).get("__annotations__", {}) for k in type(self).__mro__):
                raise TypeError(f"{type(self).__name__} takes no {key!r}")
            setattr(self, key, value)

    @classmethod
    def about(cls: type[E], claim: _About, message: str) -> E:
        """This error about ``claim``: its name, token and fence attached."""
        return cls(message, name=claim.name, token=claim.token, fence=claim.fence)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments do not survive the default pickling, and Celery
        # pickles exceptions into result backends and across pool processes.
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))


def _rebuild(cls: type[FencedError], message: str, state: dict[str, object]) -> FencedError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class ConfigError(FencedError, ValueError):
    """Bad input (a ttl, a template, a path, a table); the message names the fix."""


class ClaimUnavailable(FencedError):
    """The claim store could not be reached, so the work must not run (fail closed)."""


class CorruptKey(ClaimUnavailable):
    """A key of the claim holds what fenced never writes there (a wrong type, a fence that
    is not an integer): the claim cannot be granted until it is deleted or repaired."""

    #: The Redis key at fault.
    key: str | None = None


class ClaimHeld(FencedError):
    """Another live holder has the claim."""

    #: Seconds until the holder's lease ends (it may be renewed).
    expires_in: float | None = None


class ClaimLost(FencedError):
    """The claim expired or was taken by another holder while the work ran."""


class ClaimInterrupted(ClaimLost):
    """Raised inside work that did not check its claim, when the claim was lost."""

    def __init__(
        self, message: str = "the claim was lost while the work ran", **context: Any
    ) -> None:
        super().__init__(message, **context)


class NotOwner(FencedError):
    """An operation needed a claim this process does not hold."""


class StaleFence(FencedError):
    """A write carried a fence lower than one already accepted: a stale holder."""

    #: The fence already accepted, which the stale write fell below.
    current: int | None = None


class StoreError(FencedError):
    """A content store, pointer or upsert operation failed."""


class CorruptObject(StoreError):
    """A stored object's bytes no longer match its digest."""

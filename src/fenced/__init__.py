"""fenced: run scheduled and queued work once at a time, and make repeats converge."""

from __future__ import annotations

from . import events
from ._claim import Claim
from ._errors import (
    ClaimHeld,
    ClaimInterrupted,
    ClaimLost,
    ClaimUnavailable,
    ConfigError,
    CorruptKey,
    CorruptObject,
    FencedError,
    NotOwner,
    StaleFence,
    StoreError,
)
from ._exclusive import exclusive
from ._guard import Skipped, is_skipped
from ._inspect import force_release, read_holder
from ._lease import Holder
from ._lock import Lock
from ._naming import claim_name, hash_value
from ._options import ClaimOptions
from ._public import publish as _publish

__version__ = "0.1.0"

__all__ = [
    "Claim",
    "ClaimHeld",
    "ClaimInterrupted",
    "ClaimLost",
    "ClaimOptions",
    "ClaimUnavailable",
    "ConfigError",
    "CorruptKey",
    "CorruptObject",
    "FencedError",
    "Holder",
    "Lock",
    "NotOwner",
    "Skipped",
    "StaleFence",
    "StoreError",
    "__version__",
    "claim_name",
    "events",
    "exclusive",
    "force_release",
    "hash_value",
    "is_skipped",
    "read_holder",
]


# Tracebacks, help() and pickles name these as this package exports them.
_publish(__name__, globals(), __all__)

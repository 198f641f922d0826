"""fenced: run scheduled and queued work once at a time, and make repeats converge."""

from __future__ import annotations

from ._claim import Claim, Holder, read_holder
from ._errors import (
    ClaimHeld,
    ClaimLost,
    ClaimUnavailable,
    ConfigError,
    CorruptObject,
    FencedError,
    NotOwner,
    StaleFence,
    StoreError,
)
from ._exclusive import Skipped, exclusive
from ._keys import claim_name, hash_value

__version__ = "0.1.0"

__all__ = [
    "Claim",
    "ClaimHeld",
    "ClaimLost",
    "ClaimUnavailable",
    "ConfigError",
    "CorruptObject",
    "FencedError",
    "Holder",
    "NotOwner",
    "Skipped",
    "StaleFence",
    "StoreError",
    "__version__",
    "claim_name",
    "exclusive",
    "hash_value",
    "read_holder",
]

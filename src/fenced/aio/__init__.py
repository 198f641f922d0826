"""fenced for asyncio: ``Claim`` and ``Lock`` on ``redis.asyncio`` clients.

The same scripts, key layout, records and checks as the thread front end; one renewer
task per event loop renews every claim and lock held on it.
"""

from __future__ import annotations

from .._public import publish as _publish
from ._claim import Claim
from ._lock import Lock
from ._renewer import Renewer, renewer

__all__ = ["Claim", "Lock", "Renewer", "renewer"]


# Tracebacks, help() and pickles name these as this package exports them.
_publish(__name__, globals(), __all__)

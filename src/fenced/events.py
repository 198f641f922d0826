"""Lifecycle events of claims: one hook for every front end.

::

    from fenced import events

    def on_event(event: events.ClaimEvent) -> None:
        if event.kind == "lost":
            alert(event.label, event.reason)

    unsubscribe = events.subscribe(on_event)

Every claim fenced takes (``Claim``, ``@exclusive``, ``ClaimedTask``, ``fenced run``,
``fenced.aio.Claim``) reports what happens to it as a :class:`ClaimEvent`, one of
:data:`KINDS`. Subscribers are called in the thread where the event happened: renewal
events (``"renewed"``, ``"renewal_failed"``, and a ``"lost"`` found by a renewal) come
from the heartbeat thread, so a subscriber must be thread-safe and quick. A subscriber
that raises is logged on the ``fenced`` logger (at most once a minute per subscriber)
and never breaks the claim.

With no subscriber an event costs one truthiness check: the front ends build the
:class:`ClaimEvent` only when :func:`enabled` says someone listens. An event is a named
tuple (immutable, and built in a tenth of a microsecond: two are sent per claim cycle).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

__all__ = ["KINDS", "ClaimEvent", "Subscriber", "emit", "enabled", "subscribe", "unsubscribe"]

#: Every event kind, in the order a claim usually meets them.
KINDS = (
    "acquired",
    "skipped",
    "throttled",
    "renewed",
    "renewal_failed",
    "lost",
    "released",
    "unavailable",
)

#: The seconds between two log lines about the same raising subscriber.
ERROR_LOG_INTERVAL = 60.0

log = logging.getLogger("fenced")


class ClaimEvent(NamedTuple):
    """One thing that happened to a claim (see the README's "Lifecycle events").

    Read its fields by name; it is immutable (``event._replace(...)`` makes a changed copy).
    """

    #: One of :data:`KINDS`.
    kind: str
    #: The full claim name (unbounded: never use it as a metrics label).
    name: str
    #: A bounded-cardinality label: the claim template, the label the user chose, the
    #: literal name when the name is fixed, or a callable namer's ``__qualname__``.
    label: str
    #: ``"claim"``, ``"exclusive"``, ``"task"``, ``"run"`` or ``"aio"``.
    source: str
    fence: int | None = None
    #: The holder text of the claim this process holds, or of the holder that made it skip.
    holder: str | None = None
    #: ``"released"``: ``ok``, ``failed``, ``lost`` or ``retried``.
    outcome: str | None = None
    #: ``"skipped"``: the skip reason; ``"throttled"``: ``"rate limited"`` (the name is
    #: free, but its ``rate`` allows no start yet); ``"lost"``: the cause; ``"renewal_failed"`` and
    #: ``"unavailable"``: the error text (redacted, short).
    reason: str | None = None
    #: Seconds: how long the claim was held (``"released"``, ``"lost"``), or the renewal
    #: round trip (``"renewed"``, ``"renewal_failed"``), or until the next start the
    #: rate allows (``"throttled"``).
    duration: float | None = None
    #: For a claim of ``limit > 1``: the slot index.
    slot: int | None = None
    #: Celery: the task instance; else None.
    task: Any = None
    #: ``time.time()`` when it happened.
    time: float = 0.0


Subscriber = Callable[[ClaimEvent], None]

# Copy-on-write: emit reads the tuple without a lock; subscribe/unsubscribe replace it.
_subscribers: tuple[Subscriber, ...] = ()
_lock = threading.Lock()
_last_error_log: dict[int, float] = {}


def _after_fork_in_child() -> None:
    # A thread of the parent may have held the lock at the fork: the child's is new.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def subscribe(fn: Subscriber) -> Callable[[], None]:
    """Call ``fn`` for every event in this process; returns a function that unsubscribes it."""
    global _subscribers
    if not callable(fn):
        from ._errors import ConfigError

        raise ConfigError(
            f"events.subscribe needs a callable taking a ClaimEvent, not {type(fn).__name__}"
        )
    with _lock:
        _subscribers = (*_subscribers, fn)
    return lambda: unsubscribe(fn)


def unsubscribe(fn: Subscriber) -> None:
    """Stop calling ``fn`` (its first subscription); a no-op when it is not subscribed."""
    global _subscribers
    with _lock:
        subs = list(_subscribers)
        if fn in subs:  # the first one that is fn, or equal to it
            subs.remove(fn)
        _subscribers = tuple(subs)
        _last_error_log.pop(id(fn), None)


def enabled() -> bool:
    """True when someone subscribed: callers skip building the event otherwise."""
    return bool(_subscribers)


def emit(event: ClaimEvent) -> None:
    """Hand ``event`` to every subscriber; never raises."""
    for fn in _subscribers:  # the tuple as it is now: a subscribe meanwhile replaces it
        try:
            fn(event)
        except Exception:
            _log_failure(fn, event)


def _log_failure(fn: Subscriber, event: ClaimEvent) -> None:
    try:
        now = time.monotonic()
        key = id(fn)
        with _lock:
            last = _last_error_log.get(key)
            if last is not None and now - last < ERROR_LOG_INTERVAL:
                return
            _last_error_log[key] = now
        log.exception(
            "fenced: event subscriber %r raised on a %r event of %r (the claim goes on; "
            "logged at most once a minute per subscriber)",
            fn,
            event.kind,
            event.name,
            extra={"fenced_claim": event.name, "fenced_event": event.kind},
        )
    except Exception:  # logging itself failed: emit must never raise
        pass

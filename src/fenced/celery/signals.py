"""Signals sent by fenced's Celery integration.

::

    from fenced.celery import signals

    @signals.claim_skips_exceeded.connect
    def page_someone(sender, name, skips, holder, **kwargs):
        ...

    @signals.claim_lost.connect
    def count_loss(sender, name, label, reason, **kwargs):
        ...

The lifecycle signals (``claim_acquired``, ``claim_skipped``, ``claim_lost``,
``claim_released``, ``claim_renewal_failed``) carry the :mod:`fenced.events` of a
``ClaimedTask``'s claims: ``sender`` is the task instance, and the keywords are the
event's fields: ``name``, ``label``, ``fence``, ``holder``, ``outcome``, ``reason``,
``duration``, ``slot``, and ``event`` (the :class:`fenced.events.ClaimEvent` itself).
Claims of other front ends (``Claim``, ``@exclusive``) send no signal; subscribe to
:mod:`fenced.events` for those.

A signal is sent from the thread where its event happened: ``claim_renewal_failed``,
and ``claim_lost`` when a renewal finds the lease gone or its deadline passes, come
from the heartbeat thread, not the thread running the task: a receiver must be
thread-safe and quick (hand slow work to a queue). Nothing is subscribed to
:mod:`fenced.events` until the first receiver connects to one of them, so a worker
that listens to none pays nothing for them.
"""

from __future__ import annotations

import threading
from typing import Any

try:
    from celery.utils.dispatch import Signal
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"fenced.celery needs Celery: pip install 'fenced[celery]' ({exc})") from exc

from .. import events

__all__ = [
    "claim_acquired",
    "claim_lost",
    "claim_released",
    "claim_renewal_failed",
    "claim_skipped",
    "claim_skips_exceeded",
]

_bridged = False
_bridge_lock = threading.Lock()


class _ClaimSignal(Signal):
    """A signal fed by :mod:`fenced.events`: the first receiver connected subscribes the
    bridge that sends it."""

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        _subscribe_bridge()
        return super().connect(*args, **kwargs)


#: Sent when a claim's consecutive skips reach ``claim_alert_after_skips`` and at each
#: multiple of it: ``sender`` is the task; ``name`` (the claim), ``skips`` (the count)
#: and ``holder`` (a :class:`fenced.Holder`, or None) come as keywords.
claim_skips_exceeded = Signal(name="claim_skips_exceeded")

#: A run of the task took its claim (``fence``; ``slot`` with ``claim_limit``).
claim_acquired = _ClaimSignal(name="claim_acquired")
#: A run found the claim busy (``holder``: who holds it), or its name ran recently
#: (``claim_cooldown``): ``reason``. Sent whatever ``claim_on_busy`` does next.
claim_skipped = _ClaimSignal(name="claim_skipped")
#: The claim was lost while the task ran: ``reason`` is the cause (``expired``,
#: ``taken``, ``vanished``), ``duration`` how long it was held.
claim_lost = _ClaimSignal(name="claim_lost")
#: A run gave its claim back: ``outcome`` (``ok``, ``failed``, ``lost``, ``retried``,
#: ``skipped`` for a duplicate delivery), ``duration`` how long it was held.
claim_released = _ClaimSignal(name="claim_released")
#: A renewal of the claim failed (Redis did not answer in time): ``reason`` is the
#: error, ``duration`` the round trip. Sent from the heartbeat thread.
claim_renewal_failed = _ClaimSignal(name="claim_renewal_failed")

_BY_KIND: dict[str, Signal] = {
    "acquired": claim_acquired,
    "skipped": claim_skipped,
    "lost": claim_lost,
    "released": claim_released,
    "renewal_failed": claim_renewal_failed,
}


#: The event's fields each lifecycle signal carries as keywords (and ``event`` itself).
_FIELDS = ("name", "label", "fence", "holder", "outcome", "reason", "duration", "slot")


def _send(event: events.ClaimEvent) -> None:
    """Send the signal of one of a ClaimedTask's events (other front ends' are left)."""
    if event.task is None or event.source != "task":
        return
    signal = _BY_KIND.get(event.kind)
    if signal is None or not signal.receivers:
        return
    # Signal.send logs what a receiver raises and goes on: the claim is never broken.
    signal.send(sender=event.task, event=event, **{f: getattr(event, f) for f in _FIELDS})


def _subscribe_bridge() -> None:
    global _bridged
    with _bridge_lock:
        if not _bridged:
            events.subscribe(_send)
            _bridged = True

"""Signals sent by fenced's Celery integration.

::

    from fenced.celery import signals

    @signals.claim_skips_exceeded.connect
    def page_someone(sender, name, skips, holder, **kwargs):
        ...
"""

from __future__ import annotations

try:
    from celery.utils.dispatch import Signal
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"fenced.celery needs Celery: pip install 'fenced[celery]' ({exc})") from exc

__all__ = ["claim_skips_exceeded"]

#: Sent when a claim's consecutive skips reach ``claim_alert_after_skips`` and at each
#: multiple of it: ``sender`` is the task; ``name`` (the claim), ``skips`` (the count)
#: and ``holder`` (a :class:`fenced.Holder`, or None) come as keywords.
claim_skips_exceeded = Signal(name="claim_skips_exceeded")

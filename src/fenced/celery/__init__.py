"""Celery integration: a task base class whose every run holds a fenced claim.

::

    from fenced.celery import ClaimedTask

    @app.task(base=ClaimedTask, bind=True, acks_late=True,
              claim="rebuild:{tenant}:{layer}", claim_ttl=60)
    def rebuild_map(self, tenant, layer):
        for step in self.claim.steps(build_steps(tenant, layer)):
            step.run(fence=self.claim.fence)

- ``_options``: the task options, their settings and defaults, the lock Redis;
- ``_enqueue``: deduplication at enqueue (``claim_enqueue``), the "queued" marker;
- ``_task``: :class:`ClaimedTask`, what one run does;
- ``_request``: :class:`ClaimedRequest`, the worker side (a pool child that died);
- ``_disabled``: ``fenced_enabled = False``, :class:`LocalClaim` (tests without Redis);
- ``_metrics``: ``fenced_metrics``, Prometheus metrics in a worker (:mod:`fenced.metrics`);
- ``_hidden``: fenced's URL settings shown without passwords (``celery inspect conf``);
- ``_rerun``: the rerun triggers of ``claim_on_busy="rerun"``, signed and checked;
- ``signals``: the signals fenced sends.
"""

from __future__ import annotations

from .._errors import ClaimInterrupted
from .._inspect import clear_queued
from . import _hidden, _metrics, signals  # noqa: F401  (_metrics: the worker's signal receivers)
from ._disabled import LocalClaim
from ._options import DEFAULTS, ON_BUSY, lock_redis
from ._request import ClaimedRequest
from ._task import ClaimedTask, metrics

__all__ = [
    "DEFAULTS",
    "ON_BUSY",
    "ClaimInterrupted",
    "ClaimedRequest",
    "ClaimedTask",
    "LocalClaim",
    "clear_queued",
    "lock_redis",
    "metrics",
    "signals",
]

"""Claimed tasks with a rate (``claim_rate``), for tests/test_celery_rate.py.

A worker runs this module: the tasks below join tests/celery_app.py's app (its settings
and its observations). Each run notes its fence (minted from Redis's clock, in µs), its
worker and its retries count in the observation Redis (``starts:<key>``); each delivery
of a flood's message is noted too (``deliveries:<key>``).
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Any

from celery import Celery
from celery import signals as celery_signals

from fenced.celery import ClaimedTask

# As the worker names it (tests.celery_app): one app, one module, whoever imports it.
_base = importlib.import_module("tests.celery_app")
app: Celery = _base.app
note = _base.note

__all__ = ["app"]


def _started(task: Any, key: str) -> int:
    fence = int(task.claim.fence)
    note(
        f"starts:{key}",
        task_id=task.request.id,
        fence=fence,
        worker=f"{socket.gethostname()}:{os.getppid()}",
        retries=task.request.retries,
    )
    return fence


@celery_signals.task_prerun.connect
def _delivered(task_id: str = "", task: Any = None, args: Any = (), **_: Any) -> None:
    """Every delivery of a flood's message (the first and each sent back)."""
    if getattr(task, "name", None) == "r.flood":
        note(f"deliveries:{args[0]}", task_id=task_id)


@app.task(
    base=ClaimedTask,
    bind=True,
    name="r.flood",
    claim="flood:{key}",
    claim_rate="2/s",
    claim_limit=3,
    max_retries=0,
)
def flood(self: Any, key: str, n: int) -> int:
    """Two starts in any second; a call over the rate is put back for the start booked
    for it, and max_retries=0 would fail it if that counted as a retry. Three slots: a
    call that comes while the second's two runs hold theirs reaches the rate (and is
    booked) instead of being busy."""
    return _started(self, key)


@app.task(
    base=ClaimedTask,
    bind=True,
    name="r.skip",
    claim="hourly:{key}",
    claim_rate="1/h",
    claim_rate_policy="skip",
)
def hourly(self: Any, key: str) -> int:
    """Once an hour at most; a call over the rate is skipped."""
    return _started(self, key)


@app.task(base=ClaimedTask, bind=True, name="r.minutely", claim="minutely:{key}", claim_rate="1/m")
def minutely(self: Any, key: str) -> int:
    """Once a minute at most; a call over the rate is put back for its start."""
    return _started(self, key)

"""The Celery lane: ``ClaimedTask`` in a real ``celery worker``, doing the workers' work.

``celery -A chaos.celery_app worker`` (the harness starts it, prefork, two children).
The task's claim is the workers' claim name, with their ttl; a busy claim is a skip,
and the harness keeps the queue topped up. The task checks ``self.claim`` before each
step and writes under ``self.claim.fence``; a lost claim may also interrupt it
anywhere (``claim_interrupt``). Each pool child logs to its own file.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery import signals as celery_signals

from fenced.celery import ClaimedTask

from .config import Shared
from .events import EventLog
from .stores import Stores
from .worker import Work

__all__ = ["QUEUE", "TASK", "app"]

shared = Shared.from_env()
QUEUE = os.environ.get("CHAOS_QUEUE", "chaos")
TASK = "chaos.work"

app = Celery("chaos", broker=os.environ.get("CHAOS_BROKER_URL", "memory://"))
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    fenced_redis_url=shared.lock_url,
)

_work: tuple[int, Work] | None = None
_prerun: dict[str, float] = {}


def work_here() -> Work:
    """This pool child's Work, its log and stores made after the fork."""
    global _work
    if _work is None or _work[0] != os.getpid():
        pid = os.getpid()
        log = EventLog(
            os.path.join(shared.log_dir, f"celery.{pid}.jsonl"),
            w=f"celery-{pid}",
            lane="fenced",
            front="celery",
            pid=pid,
        )
        _work = (pid, Work(shared, log, Stores(shared, "fenced")))
    return _work[1]


@celery_signals.task_prerun.connect
def _before(task_id: str | None = None, **_kw: Any) -> None:
    # Sent before the task's __call__, where ClaimedTask acquires: "sent" of the grant.
    if task_id:
        _prerun[task_id] = time.monotonic()


@celery_signals.task_retry.connect
def _retried(request: Any = None, reason: Any = None, **_kw: Any) -> None:
    work_here().log.emit("unavailable", error=str(reason)[:200])


@app.task(
    base=ClaimedTask,
    bind=True,
    name=TASK,
    claim=shared.name,
    claim_ttl=shared.ttl,
    claim_on_busy="skip",
    claim_alert_after_skips=0,
    claim_unavailable_backoff=0.2,
    claim_unavailable_retries=2,
)
def work(self: ClaimedTask) -> str:
    """Work in steps under the task's claim."""
    acked = time.monotonic()
    w = work_here()
    claim = self.claim
    hold = w.next_hold()
    sent = _prerun.pop(self.request.id or "", acked)
    w.log.emit("acquired", t=acked, hold=hold, fence=claim.fence, sent=sent, task=self.request.id)
    try:
        w.holding(hold, claim.fence, claim.check)  # ClaimLost fails the run as "lost"
    finally:
        # ClaimedTask releases after the body returns: the body's belief ends here.
        w.log.emit("releasing", hold=hold)
    return "done"

"""A worker app whose receivers note fenced's lifecycle signals, for tests/test_events_celery.py.

Configured from the environment as tests/celery_app.py is (``FENCED_TEST_BROKER_URL``,
``FENCED_TEST_BACKEND_URL``, ``FENCED_REDIS_URL``, ``FENCED_TEST_OBS_URL``,
``FENCED_TEST_TTL``, ``FENCED_TEST_QUEUE``). Each signal a receiver gets is appended as
JSON to ``sig:<name>`` in the observation Redis, with the thread it arrived on.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import redis
from celery import Celery

from fenced.celery import ClaimedTask, signals

app = Celery(
    "fenced_events_tests",
    broker=os.environ.get("FENCED_TEST_BROKER_URL", "memory://"),
    backend=os.environ.get("FENCED_TEST_BACKEND_URL") or None,
)
app.conf.update(
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("FENCED_TEST_QUEUE", "celery"),
    broker_connection_retry_on_startup=True,
    fenced_claim_ttl=float(os.environ.get("FENCED_TEST_TTL", "3")),
)

_obs: redis.Redis | None = None


def obs() -> redis.Redis:
    """The observation Redis (one client per process; redis-py reconnects after fork)."""
    global _obs
    if _obs is None:
        _obs = redis.Redis.from_url(os.environ["FENCED_TEST_OBS_URL"], decode_responses=True)
    return _obs


def _noted(signal: Any, sender: Any, **kw: Any) -> None:
    event = kw.pop("event")
    data = {
        "signal": signal.name,
        "task": sender.name,
        "kind": event.kind,
        "thread": threading.current_thread().name,
        **kw,
    }
    obs().rpush(f"sig:{kw['name']}", json.dumps(data))


# Connected in the worker's main process, before the pool forks: each child inherits them.
for _signal in (
    signals.claim_acquired,
    signals.claim_skipped,
    signals.claim_lost,
    signals.claim_released,
    signals.claim_renewal_failed,
):
    _signal.connect(_noted, weak=False)


@app.task(base=ClaimedTask, bind=True, name="ev.gated", claim="ev:{key}", claim_label="ev-gated")
def gated(self: Any, key: str) -> str:
    """Holds its claim (checking it) until the test sets ``gate:<key>``."""
    r = obs()
    r.rpush(f"started:{key}", self.request.id)
    while not r.exists(f"gate:{key}"):
        self.claim.check()
        time.sleep(0.05)
    return "done"

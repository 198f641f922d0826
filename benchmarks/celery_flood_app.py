"""The Celery app the flood benchmark's worker runs: one task per way of deduplicating.

Every task does the same thing: the first call of a name (the holder) waits until the
benchmark sets ``go:<feed>``; every duplicate that reaches a worker is dropped by its
protection (fenced's claim skips it) or never published. The task signals record, for
each task a worker handled, that it was handled and how long it took.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery import signals as celery_signals

URL = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379")
#: The longest a holder waits for its go: a benchmark that waits this long failed.
HOLD_LIMIT = 300.0

app = Celery("flood", broker=f"{URL}/0")
app.conf.update(
    fenced_redis_url=f"{URL}/2",
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_serializer="json",
    accept_content=["json"],
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": f"{URL}/3"}},
    singleton_backend_url=f"{URL}/4",
    worker_hijack_root_logger=False,
)

obs = redis.Redis.from_url(f"{URL}/5")

_started: dict[str, float] = {}
_held: set[str] = set()


@celery_signals.task_prerun.connect
def _prerun(task_id: str = "", **_: Any) -> None:
    _started[task_id] = time.perf_counter()


@celery_signals.task_postrun.connect
def _postrun(task_id: str = "", args: Any = None, kwargs: Any = None, **_: Any) -> None:
    took = time.perf_counter() - _started.pop(task_id, time.perf_counter())
    feed = (list(args or ()) + list((kwargs or {}).values()) + ["?"])[0]
    with obs.pipeline(transaction=False) as pipe:
        pipe.incr(f"handled:{feed}")
        if task_id not in _held:
            pipe.incrbyfloat(f"dup_busy:{feed}", took)
        pipe.execute()
    _held.discard(task_id)


def hold(task_id: str, feed: str) -> None:
    """The work: the holder waits for the benchmark's go."""
    _held.add(task_id)
    obs.set(f"holding:{feed}", task_id)
    deadline = time.monotonic() + HOLD_LIMIT
    while not obs.exists(f"go:{feed}") and time.monotonic() < deadline:
        time.sleep(0.01)


try:
    from fenced.celery import ClaimedTask

    @app.task(base=ClaimedTask, bind=True, name="flood.fenced", claim="flood:{feed}")
    def fenced_task(self: Task, feed: str) -> None:
        """ClaimedTask: every duplicate is published, delivered and skipped by the claim."""
        hold(str(self.request.id), feed)

    @app.task(
        base=ClaimedTask,
        bind=True,
        name="flood.fenced_enqueue",
        claim="flood:{feed}",
        claim_enqueue="until_finished",
    )
    def fenced_enqueue_task(self: Task, feed: str) -> None:
        """ClaimedTask with claim_enqueue: a duplicate is not published."""
        hold(str(self.request.id), feed)

except ImportError:  # pragma: no cover
    pass

try:
    from celery_once import QueueOnce

    @app.task(base=QueueOnce, bind=True, name="flood.once", once={"graceful": True})
    def once_task(self: Task, feed: str) -> None:
        """celery-once: a lock taken at enqueue, cleared after return."""
        hold(str(self.request.id), feed)

except ImportError:  # pragma: no cover
    pass

try:
    from celery_singleton import Singleton

    @app.task(base=Singleton, bind=True, name="flood.singleton")
    def singleton_task(self: Task, feed: str) -> None:
        """celery-singleton: a lock taken at enqueue, cleared on success or failure."""
        hold(str(self.request.id), feed)

except ImportError:  # pragma: no cover
    pass

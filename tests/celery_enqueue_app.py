"""Claimed tasks that deduplicate at enqueue (``claim_enqueue``), for tests/test_celery_enqueue.py.

A worker runs this module, configured from the environment as tests/celery_app.py is;
a test builds the same app in its own process with :func:`make_app`, to send calls.
Each run notes its start in the observation Redis (``runs:<key>``) and then waits until
the test sets ``go:<key>``, so a test decides when a run ends.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery

from fenced.celery import ClaimedTask

#: The longest a run waits for the test's go: a test that waits this long failed.
RUN_LIMIT = 120.0


def make_app(broker: str, backend: str | None, lock_url: str, obs_url: str, queue: str) -> Celery:
    """An app with the enqueue tasks, on these servers."""
    app = Celery("fenced_enqueue_tests", broker=broker, backend=backend)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        fenced_redis_url=lock_url,
        fenced_claim_ttl=3.0,
        result_expires=600,
    )
    obs = redis.Redis.from_url(obs_url, decode_responses=True)

    def body(task: Any, key: str) -> str:
        obs.rpush(
            f"runs:{key}",
            json.dumps({"task_id": task.request.id, "pid": os.getpid(), "task": task.name}),
        )
        deadline = time.monotonic() + RUN_LIMIT
        while not obs.exists(f"go:{key}") and time.monotonic() < deadline:
            time.sleep(0.05)
        return str(task.request.id)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.finished",
        claim="hold:{key}",
        claim_enqueue="until_finished",
    )
    def finished(self: Any, key: str) -> str:
        """No second message while one is queued or running."""
        return body(self, key)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.started",
        claim="hold:{key}",
        claim_enqueue="until_started",
    )
    def started(self: Any, key: str) -> str:
        """No second message while one is queued."""
        return body(self, key)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.short",
        claim="hold:{key}",
        claim_enqueue="until_started",
        claim_enqueue_ttl=1.0,
    )
    def short(self: Any, key: str) -> str:
        """A marker that expires after a second."""
        return body(self, key)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.retrying",
        claim="hold:{key}",
        claim_enqueue="until_finished",
    )
    def retrying(self: Any, key: str) -> int:
        """Retries once: the retry is sent although the marker is held (by itself)."""
        body(self, key)
        if not self.request.retries:
            raise self.retry(countdown=0.2)
        return int(self.request.retries)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.rerun",
        claim="hold:{key}",
        claim_enqueue="until_finished",
        claim_on_busy="rerun",
    )
    def rerun(self: Any, key: str) -> str:
        """A call that reaches a run (send_task) asks for one more run after it."""
        return body(self, key)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.early",
        claim="hold:{key}",
        claim_enqueue="until_finished",
        acks_late=False,
    )
    def early(self: Any, key: str) -> str:
        """Acknowledged as it starts: a run whose process dies is not delivered again."""
        return body(self, key)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.moving",
        claim="hold:{key}",
        claim_enqueue="until_finished",
    )
    def moving(self: Any, key: str, then: str = "") -> str:
        """Retries once under another name (``then``): the retry takes that claim."""
        body(self, key)
        if then:
            raise self.retry(args=(then,), kwargs={}, countdown=0.2)
        return str(self.request.id)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="e.rated",
        claim="hold:{key}",
        claim_enqueue="until_started",
        claim_rate="1/m",
    )
    def rated(self: Any, key: str) -> str:
        """One start a minute: a call over it is put back for its booked start."""
        return body(self, key)

    @app.task(shared=False, name="e.collect")
    def collect(results: Any) -> Any:
        """A chord body or a callback: what it was given."""
        return results

    return app


app = make_app(
    os.environ.get("FENCED_TEST_BROKER_URL", "memory://"),
    os.environ.get("FENCED_TEST_BACKEND_URL") or None,
    os.environ.get("FENCED_REDIS_URL", "redis://127.0.0.1:1/2"),
    os.environ.get("FENCED_TEST_OBS_URL", "redis://127.0.0.1:1/3"),
    os.environ.get("FENCED_TEST_QUEUE", "celery"),
)

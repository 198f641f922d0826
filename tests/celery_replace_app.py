"""Claimed tasks under ``claim_on_busy="replace"``, for tests/test_celery_replace.py.

A worker runs this module, configured from the environment as tests/celery_app.py is; a
test builds the same app in its own process with :func:`make_app`, to send calls. Each
run notes its start in the observation Redis (``runs:<key>``), waits until the test
sets ``go:<key>`` (no ``check()``: a replaced run is interrupted), then publishes its
version through a fenced pointer (``replace:<key>``) and returns it; ``r.timed`` runs
for a given time instead. ``FENCED_TEST_VISIBILITY`` gives the Redis broker a short
visibility timeout.
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


def make_app(
    broker: str,
    backend: str | None,
    lock_url: str,
    obs_url: str,
    queue: str,
    visibility: float | None = None,
) -> Celery:
    """An app with the replace tasks, on these servers (with a Redis broker's
    ``visibility_timeout`` of ``visibility`` seconds when given)."""
    app = Celery("fenced_replace_tests", broker=broker, backend=backend)
    transport: dict[str, Any] = {}
    if visibility is not None:
        transport = {
            "visibility_timeout": visibility,
            # Sweep for unacknowledged messages every second: a message runs longer
            # than the visibility timeout, so the broker hands it out again meanwhile.
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            "unacked_mutex_expire": 5,
        }
    app.conf.update(
        broker_transport_options=transport,
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

    def body(task: Any, key: str, version: str) -> str:
        from fenced.store import RedisPointer

        obs.rpush(
            f"runs:{key}",
            json.dumps({"task_id": task.request.id, "version": version, "pid": os.getpid()}),
        )
        deadline = time.monotonic() + RUN_LIMIT
        while not obs.exists(f"go:{key}") and time.monotonic() < deadline:
            time.sleep(0.05)
        RedisPointer(lock_url, f"replace:{key}").swap(version, fence=task.claim.fence)
        return version

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="r.started",
        claim="rp:{key}",
        claim_on_busy="replace",
        claim_enqueue="until_started",
    )
    def started(self: Any, key: str, version: str) -> str:
        """Replace, and no second message while one is queued."""
        return body(self, key, version)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="r.plain",
        claim="rp:{key}",
        claim_on_busy="replace",
    )
    def plain(self: Any, key: str, version: str, retry_in: float = 0.0) -> str:
        """Replace; with ``retry_in``, its first attempt asks for a retry that long after
        (its lease is kept for it) before it runs."""
        if retry_in and not self.request.retries:
            raise self.retry(countdown=retry_in)
        return body(self, key, version)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="r.timed",
        claim="rp:{key}",
        claim_on_busy="replace",
    )
    def timed(self: Any, key: str, version: str, seconds: float) -> str:
        """Replace; each start of a run is noted (``starts:<key>``), it runs ``seconds``
        (no go needed) and notes its end (``ends:<key>``) before it returns."""
        note = json.dumps({"task_id": self.request.id, "version": version, "pid": os.getpid()})
        obs.rpush(f"starts:{key}", note)
        time.sleep(seconds)
        obs.rpush(f"ends:{key}", note)
        return version

    return app


_visibility = os.environ.get("FENCED_TEST_VISIBILITY")
app = make_app(
    os.environ.get("FENCED_TEST_BROKER_URL", "memory://"),
    os.environ.get("FENCED_TEST_BACKEND_URL") or None,
    os.environ.get("FENCED_REDIS_URL", "redis://127.0.0.1:1/2"),
    os.environ.get("FENCED_TEST_OBS_URL", "redis://127.0.0.1:1/3"),
    os.environ.get("FENCED_TEST_QUEUE", "celery"),
    float(_visibility) if _visibility else None,
)

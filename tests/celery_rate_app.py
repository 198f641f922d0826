"""Claimed tasks with a rate (``claim_rate``), for tests/test_celery_rate.py.

A worker runs this module, configured from the environment as tests/celery_app.py is;
a test builds the same app in its own process with :func:`make_app`, to send calls.
Each run notes its fence (minted from Redis's clock, in µs), its worker and its
retries count in the observation Redis (``starts:<key>``).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import redis
from celery import Celery

from fenced.celery import ClaimedTask


def make_app(broker: str, backend: str | None, lock_url: str, obs_url: str, queue: str) -> Celery:
    """An app with the rate tasks, on these servers."""
    app = Celery("fenced_rate_tests", broker=broker, backend=backend)
    app.conf.update(
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        task_default_queue=queue,
        broker_connection_retry_on_startup=True,
        fenced_redis_url=lock_url,
        fenced_claim_ttl=3.0,
        result_expires=600,
    )
    obs = redis.Redis.from_url(obs_url, decode_responses=True)

    def note(task: Any, key: str) -> int:
        obs.rpush(
            f"starts:{key}",
            json.dumps(
                {
                    "task_id": task.request.id,
                    "fence": task.claim.fence,
                    "worker": f"{socket.gethostname()}:{os.getppid()}",
                    "retries": task.request.retries,
                }
            ),
        )
        return int(task.claim.fence)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="r.flood",
        claim="flood:{key}",
        claim_rate="5/s",
        claim_limit=4,
        max_retries=0,
    )
    def flood(self: Any, key: str, n: int) -> int:
        """Five starts a second, four at a time; a call over the rate is put back, and
        max_retries=0 would fail it if that counted as a retry."""
        return note(self, key)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="r.skip",
        claim="hourly:{key}",
        claim_rate="1/h",
        claim_rate_policy="skip",
    )
    def hourly(self: Any, key: str) -> int:
        """Once an hour at most; a call over the rate is skipped."""
        return note(self, key)

    return app


app = make_app(
    os.environ.get("FENCED_TEST_BROKER_URL", "memory://"),
    os.environ.get("FENCED_TEST_BACKEND_URL") or None,
    os.environ.get("FENCED_REDIS_URL", "redis://127.0.0.1:1/2"),
    os.environ.get("FENCED_TEST_OBS_URL", "redis://127.0.0.1:1/3"),
    os.environ.get("FENCED_TEST_QUEUE", "celery"),
)

"""Rate-limited claimed tasks whose calls carry ``expires``, for
tests/test_celery_putback_expires.py.

A worker runs this module, configured from the environment as tests/celery_app.py is; a
test builds the same app in its own process with :func:`make_app`, to send calls. Each
run notes its start in the observation Redis (``starts:<key>``: its task id and fence,
minted from Redis's clock in µs); the ``task_revoked`` signal is noted in
``revoked:<task id>``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals

from fenced.celery import ClaimedTask


def make_app(broker: str, backend: str | None, lock_url: str, obs_url: str, queue: str) -> Celery:
    """An app with the tasks, on these servers."""
    app = Celery("fenced_expires_tests", broker=broker, backend=backend)
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

    def started(task: Any, key: str) -> int:
        fence = int(task.claim.fence)
        obs.rpush(f"starts:{key}", json.dumps({"task_id": task.request.id, "fence": fence}))
        return fence

    def revoked(sender: Any = None, request: Any = None, **kw: Any) -> None:
        if getattr(sender, "app", None) is not app:
            return
        note = {"expired": kw.get("expired"), "terminated": kw.get("terminated")}
        obs.rpush(f"revoked:{getattr(request, 'id', None)}", json.dumps(note))

    celery_signals.task_revoked.connect(revoked, weak=False)

    @app.task(
        base=ClaimedTask, bind=True, shared=False, name="x.minutely", claim="xm:{key}",
        claim_rate="1/m",
    )  # fmt: skip
    def minutely(self: Any, key: str) -> int:
        """Once a minute at most: a call over the rate is booked a start up to a minute
        out and put back for it."""
        return started(self, key)

    @app.task(
        base=ClaimedTask, bind=True, shared=False, name="x.secondly", claim="xs:{key}",
        claim_rate="1/s",
    )  # fmt: skip
    def secondly(self: Any, key: str) -> int:
        """Once a second at most: a call over the rate waits for its start in the worker."""
        return started(self, key)

    @app.task(
        base=ClaimedTask, bind=True, shared=False, name="x.queued", claim="xq:{key}",
        claim_rate="1/m", claim_enqueue="until_finished",
    )  # fmt: skip
    def queued(self: Any, key: str) -> int:
        """Once a minute at most, and one message per name while one is queued or runs."""
        return started(self, key)

    return app


app = make_app(
    os.environ.get("FENCED_TEST_BROKER_URL", "memory://"),
    os.environ.get("FENCED_TEST_BACKEND_URL") or None,
    os.environ.get("FENCED_REDIS_URL", "redis://127.0.0.1:1/2"),
    os.environ.get("FENCED_TEST_OBS_URL", "redis://127.0.0.1:1/3"),
    os.environ.get("FENCED_TEST_QUEUE", "celery"),
)

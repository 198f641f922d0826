"""Debounced claimed tasks (``claim_debounce``), for tests/test_celery_debounce.py.

A worker runs this module, configured from the environment as tests/celery_app.py is;
a test builds the same app in its own process with :func:`make_app`, to send calls.
Each run notes its start and end in the observation Redis (``runs:<key>``); while the
test has set ``hold:<key>``, a run waits after its start until the test sets ``go:<key>``.
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
RUN_LIMIT = 60.0
SECRET = "debounce-tests-secret-key-0123456789"


def make_app(
    broker: str,
    backend: str | None,
    lock_url: str,
    obs_url: str,
    queue: str,
    visibility: float | None = None,
) -> Celery:
    """An app with the debounced tasks, on these servers."""
    app = Celery("fenced_debounce_tests", broker=broker, backend=backend)
    transport: dict[str, Any] = {}
    if visibility is not None:
        transport = {
            "visibility_timeout": visibility,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A worker killed inside a sweep holds its mutex 300 s by default.
            "unacked_mutex_expire": 5,
        }
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=queue,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        fenced_redis_url=lock_url,
        fenced_claim_ttl=3.0,
        fenced_secret_key=SECRET,
        result_expires=600,
    )
    obs = redis.Redis.from_url(obs_url, decode_responses=True)

    def body(task: Any, key: str, n: int) -> int:
        note = {"task_id": task.request.id, "task": task.name, "n": n, "pid": os.getpid()}
        obs.rpush(f"runs:{key}", json.dumps({**note, "at": "start"}))
        deadline = time.monotonic() + RUN_LIMIT
        if obs.exists(f"hold:{key}"):
            while not obs.exists(f"go:{key}") and time.monotonic() < deadline:
                time.sleep(0.02)
        obs.rpush(f"runs:{key}", json.dumps({**note, "at": "end"}))
        return n

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="d.job",
        claim="deb:{key}",
        claim_debounce="300ms",
        claim_debounce_max="1.5s",
    )
    def job(self: Any, key: str, n: int) -> int:
        """Runs 0.3 s after the last call of a burst, at most 1.5 s after its first."""
        return body(self, key, n)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="d.slow",
        claim="deb:{key}",
        claim_debounce=4,
    )
    def slow(self: Any, key: str, n: int) -> int:
        """Runs 4 s after the last call of a burst: time to kill a worker meanwhile."""
        return body(self, key, n)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="d.other",
        claim="deb:{key}",
        claim_debounce="300ms",
        claim_debounce_max="1.5s",
    )
    def other(self: Any, key: str, n: int) -> int:
        """Another task on d.job's names, with the same arguments (one resource)."""
        return body(self, key, n)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="d.brief",
        claim="brief:{key}",
        claim_debounce="300ms",
        claim_debounce_max="1s",
        claim_enqueue_ttl=1,
    )
    def brief(self: Any, key: str, n: int) -> int:
        """A burst record that would expire 2 s after its first call, but for its message."""
        return body(self, key, n)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="d.expiring",
        claim="exp:{key}",
        claim_debounce="300ms",
        claim_debounce_max="1s",
        expires=2,
    )
    def expiring(self: Any, key: str, n: int) -> int:
        """A task whose messages expire 2 s after they are sent, by default."""
        return body(self, key, n)

    @app.task(shared=False, name="d.collect")
    def collect(result: Any) -> Any:
        """A callback: what it was given."""
        return result

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

"""The Celery app of the beat tests: ``celery beat`` with fenced's scheduler, and a
worker whose task notes each tick it runs.

Configured from the environment: ``FENCED_TEST_BROKER_URL``, ``FENCED_REDIS_URL`` (the
claims, read by fenced), ``FENCED_TEST_OBS_URL`` (where runs are noted: the list
``runs``, one ``<entry> <task id> <pid>`` per run), ``FENCED_TEST_BEAT_TTL`` (the
leader's lease), ``FENCED_TEST_QUEUE``, ``FENCED_TEST_BEAT_METRICS_PORT`` (where the beat
serves its metrics, with ``FENCED_METRICS=1``).
"""

from __future__ import annotations

import os

import redis
from celery import Celery

from fenced.celery import ClaimedTask

app = Celery("fenced_beat_tests", broker=os.environ.get("FENCED_TEST_BROKER_URL", "memory://"))
app.conf.update(
    task_default_queue=os.environ.get("FENCED_TEST_QUEUE", "celery"),
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    beat_scheduler="fenced.celery.beat:Scheduler",
    beat_max_loop_interval=1.0,
    fenced_beat_name="tests",
    fenced_beat_ttl=float(os.environ.get("FENCED_TEST_BEAT_TTL", "1.5")),
    fenced_beat_alarm_after=float(os.environ.get("FENCED_TEST_BEAT_ALARM", "30")),
    fenced_beat_metrics_port=int(os.environ.get("FENCED_TEST_BEAT_METRICS_PORT") or 0) or None,
    beat_schedule={
        "every-1s": {"task": "tests.celery_beat_app.note", "schedule": 1.0, "args": ("every-1s",)},
        "every-2s": {"task": "tests.celery_beat_app.note", "schedule": 2.0, "args": ("every-2s",)},
        "claimed-2s": {
            "task": "tests.celery_beat_app.claimed_note",
            "schedule": 2.0,
            "args": ("claimed-2s",),
        },
    },
)
_obs = redis.Redis.from_url(os.environ.get("FENCED_TEST_OBS_URL", "redis://127.0.0.1:6379/15"))


@app.task(bind=True)
def note(self: object, entry: str) -> None:
    """Note a run of a plain task: its entry and task id."""
    _obs.rpush("runs", f"{entry} {self.request.id} {os.getpid()}")  # type: ignore[attr-defined]


@app.task(base=ClaimedTask, bind=True, claim="beat-note:{entry}", acks_late=True)
def claimed_note(self: ClaimedTask, entry: str) -> None:
    """Note a run of a claimed task."""
    _obs.rpush("runs", f"{entry} {self.request.id} {os.getpid()}")

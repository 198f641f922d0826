"""The Celery app of benchmarks/beat_side_by_side.py: one entry every second, and every
publish of every beat process noted in Redis (``sent``: ``<entry> <time> <pid>``).

Configured from the environment: ``BEAT_BENCH_REDIS`` (broker, claims, redbeat and the
notes, on databases 0-3 of one server), ``BEAT_BENCH_SCHEDULER`` (``stock``,
``redbeat`` or ``fenced``), ``BEAT_BENCH_LEASE`` (redbeat's lock timeout and fenced's
lease, seconds).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals

BASE = os.environ.get("BEAT_BENCH_REDIS", "redis://127.0.0.1:6379")
KIND = os.environ.get("BEAT_BENCH_SCHEDULER", "fenced")
LEASE = float(os.environ.get("BEAT_BENCH_LEASE", "3"))

app = Celery("beat_bench", broker=f"{BASE}/0")
app.conf.update(
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    beat_max_loop_interval=1.0,
    beat_schedule={"every-1s": {"task": "beat_bench.tick", "schedule": 1.0}},
    fenced_redis_url=f"{BASE}/1",
    fenced_beat_ttl=LEASE,
    redbeat_redis_url=f"{BASE}/2",
    redbeat_lock_timeout=LEASE,
    beat_scheduler={
        "stock": "celery.beat:PersistentScheduler",
        "redbeat": "redbeat.RedBeatScheduler",
        "fenced": "fenced.celery.beat:Scheduler",
    }[KIND],
)
_notes = redis.Redis.from_url(f"{BASE}/3")


@app.task(name="beat_bench.tick")
def tick() -> None:
    """Nothing: the benchmark counts what the beats publish."""


@celery_signals.before_task_publish.connect
def _noted(sender: Any = None, headers: Any = None, **_: Any) -> None:
    if sender == "beat_bench.tick":
        _notes.rpush("sent", f"every-1s {time.time():.3f} {os.getpid()} {headers.get('id')}")

"""The beat lane's Celery app: ``celery beat`` with fenced's scheduler, and the task
that notes every tick it runs.

Several ``celery -A chaos.beat_app beat`` processes (started through
:mod:`chaos.beat_main`, which can run a process's clock ahead) share one leader's claim
on the lane's Redis; one worker (``-Q chaos-beat``) runs what the leader sends. Each run
logs ``bt-run`` (entry, task id, the due time the id carries, the monotonic time) in the
chaos event log, so that the checker can say which tick ran when, and how often.

Configured from the environment: ``CHAOS_BEAT_BROKER_URL`` (broker), ``CHAOS_BEAT_CLAIMS``
(the claims' Redis as this process reaches it: one beat goes through a proxy), and
``CHAOS_SHARED`` (the event log's directory).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from redis.backoff import NoBackoff
from redis.retry import Retry

from fenced.celery.beat import Scheduler

from .beat_schedule import BEAT_NAME, BEAT_TTL, entries
from .config import Shared
from .events import EventLog

__all__ = ["QUEUE", "BlindScheduler", "app", "note"]

shared = Shared.from_env()
QUEUE = os.environ.get("CHAOS_BEAT_QUEUE", "chaos-beat")

app = Celery("chaos-beat", broker=os.environ.get("CHAOS_BEAT_BROKER_URL", "memory://"))
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    beat_scheduler="fenced.celery.beat:Scheduler",
    # A leader wakes at least once a second; a due time wakes it sooner.
    beat_max_loop_interval=1.0,
    fenced_beat_name=BEAT_NAME,
    fenced_beat_ttl=BEAT_TTL,
    fenced_beat_alarm_after=30.0,
    fenced_redis_url=os.environ.get("CHAOS_BEAT_CLAIMS") or shared.lock_url,
    # A reply lost on the way back (the proxy drops one now and then): redis-py gives up
    # on it after half a second and sends the same call again on a new connection.
    fenced_redis_options={"socket_timeout": 0.5, "retry": Retry(NoBackoff(), 2)},
    beat_schedule={
        name: {
            "task": "bt.note",
            "schedule": e["schedule"],
            "args": (name,),
            "options": {"fenced_catch_up": e["catch_up"]},
        }
        for name, e in entries().items()
    },
)

_log: tuple[int, EventLog] | None = None


def _log_here() -> EventLog:
    global _log
    if _log is None or _log[0] != os.getpid():
        pid = os.getpid()
        _log = (pid, EventLog(os.path.join(shared.log_dir, f"beat-worker.{pid}.jsonl"),
                              w=f"beat-worker-{pid}", lane="beat", pid=pid))  # fmt: skip
    return _log[1]


@app.task(bind=True, name="bt.note")
def note(self: Any, entry: str) -> None:
    """Note one run: its entry, its task id and the due time the id names."""
    tid = str(self.request.id)
    tail = tid.rsplit(":", 1)[-1]
    due = int(tail) if tid.startswith("fenced-beat:") and tail.isdigit() else None
    _log_here().emit("bt-run", entry=entry, id=tid, due=due, run_wall=time.time())


class BlindScheduler(Scheduler):
    """Deliberately broken (``--broken beat-clock``): fenced's scheduler that never
    learns that its clock runs ahead of Redis's, so it asks for due times Redis refuses."""

    def _clock_seen(self, sent_ms: int, tick_ms: int) -> None:
        self._ahead_ms = 0

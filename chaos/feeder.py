"""The dedup lane's feeder: calls every task of :mod:`chaos.dedup_app` all through a run.

``python -m chaos.feeder`` (the harness starts it). Each call goes through
``apply_async`` with a task id of its own, so that the enqueue dedup can be seen: a
call that returns another task id was coalesced into that queued message. Every call
is logged (``dd-call``: task, arguments, its own id, the id returned, the monotonic
times before and after), and every chord (``dd-chord``). On SIGTERM the feeder stops,
sends one closing call of each task (so that any rerun trigger left by a killed holder
is published by the closing run's release), logs them and exits.

The replace tasks' argument is the call counter: their sequence number, in call order.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

import redis
from celery import chord

from . import dedup_app as dd
from .config import Shared
from .events import EventLog

__all__ = ["main"]

#: Seconds between two calls of each task (the rerun task's arguments change every
#: third call, so that equal triggers coalesce and others do not).
PERIODS = {
    "dd.started": 0.25,
    "dd.finished": 0.25,
    "dd.once": 0.25,
    "dd.cooldown": 0.3,
    "dd.limit": 0.3,
    "dd.retry": 1.5,
    "dd.rerun": 0.35,
    "dd.replace_started": 0.7,
    "dd.replace_retry": 0.8,
    "chord": 2.0,
    "dd.limit_unclaimed": 1.5,
    "dd.cooldown_unclaimed": 1.2,
}
TASKS: dict[str, Any] = {
    "dd.started": dd.started,
    "dd.finished": dd.finished,
    "dd.cooldown": dd.cooldown,
    "dd.limit": dd.limit,
    "dd.retry": dd.retry,
    "dd.rerun": dd.rerun,
    "dd.replace_started": dd.replace_started,
    "dd.replace_retry": dd.replace_retry,
    "dd.limit_unclaimed": dd.limit_unclaimed,
    "dd.cooldown_unclaimed": dd.cooldown_unclaimed,
}
if "dd.once" in dd.app.tasks:
    TASKS["dd.once"] = dd.app.tasks["dd.once"]
#: The most messages waiting in the queue before the feeder holds back (a queue that
#: grows without end says nothing about dedup, only about two cores).
MAX_QUEUED = 12


class Feeder:
    def __init__(self, shared: Shared, broker_url: str) -> None:
        self.log = EventLog(os.path.join(shared.log_dir, "feeder.jsonl"), w="feeder",
                            lane="dedup", pid=os.getpid())  # fmt: skip
        self.broker = redis.Redis.from_url(broker_url, socket_timeout=5)
        self.stopping = threading.Event()
        self.k = 0
        self.chords = 0
        kinds = [
            k for k in PERIODS if k == "chord" or (k in TASKS and not k.endswith("_unclaimed"))
        ]
        if "limit" in dd.BROKEN:
            kinds.append("dd.limit_unclaimed")
        if "cooldown" in dd.BROKEN:
            kinds.append("dd.cooldown_unclaimed")
        self.kinds = kinds

    def call(self, kind: str, closing: bool = False) -> None:
        self.k += 1
        k = self.k
        if kind == "chord":
            self.send_chord()
            return
        args = [k // 3] if kind == "dd.rerun" else [k]
        own = str(uuid.uuid4())
        t0 = time.monotonic()
        try:
            result = TASKS[kind].apply_async(args, task_id=own)
            # celery-once refuses a call with a result of no id, state REJECTED.
            returned = result.id if result.id is not None else "rejected"
        except Exception as exc:  # not sent: the caller is told, as the log says
            self.log.emit("dd-call-error", t=t0, task=kind, args=args, id=own,
                          error=repr(exc)[:200], closing=closing)  # fmt: skip
            return
        self.log.emit("dd-call", t=t0, t1=time.monotonic(), task=kind, args=args, id=own,
                      returned=returned, closing=closing)  # fmt: skip

    def send_chord(self) -> None:
        self.chords += 1
        c = self.chords
        ids = [str(uuid.uuid4()) for _ in range(2)]
        members = [dd.member.s(i).set(task_id=ids[i]) for i in range(2)]
        t0 = time.monotonic()
        try:
            result = chord(members)(dd.chord_body.s(chord=c))
        except Exception as exc:
            self.log.emit("dd-call-error", t=t0, task="chord", args=[c], error=repr(exc)[:200])
            return
        self.log.emit("dd-chord", t=t0, t1=time.monotonic(), chord=c, body=result.id,
                      members=ids)  # fmt: skip

    def run(self) -> None:
        due = {kind: time.monotonic() for kind in self.kinds}
        while not self.stopping.is_set():
            try:
                queued = int(self.broker.llen(dd.QUEUE))
            except redis.RedisError:
                queued = 0
            if queued > MAX_QUEUED:
                self.stopping.wait(0.05)
                continue
            now = time.monotonic()
            kind = min(due, key=lambda x: due[x])
            if due[kind] > now:
                self.stopping.wait(due[kind] - now)
                continue
            due[kind] = now + PERIODS[kind]
            self.call(kind)
        # The closing calls: every trigger still waiting drains through their runs.
        for kind in ("dd.started", "dd.finished", "dd.cooldown", "dd.limit", "dd.rerun"):
            self.call(kind, closing=True)
        self.log.emit("dd-closed", calls=self.k, chords=self.chords)


def main() -> int:
    feeder = Feeder(Shared.from_env(), os.environ["CHAOS_BROKER_URL"])
    signal.signal(signal.SIGTERM, lambda _s, _f: feeder.stopping.set())
    signal.signal(signal.SIGINT, lambda _s, _f: feeder.stopping.set())
    feeder.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

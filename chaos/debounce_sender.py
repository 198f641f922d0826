"""The dedup lane's debounce sender: calls ``dd.debounce`` in bursts, in a process of its
own, which the nemesis kills (``kill_debounce_sender``), preferably mid-publish.

``python -m chaos.debounce_sender`` (the harness starts it, and again after each kill).
Each call logs ``dd-dcall-begin`` before it and ``dd-dcall`` after it (its sequence
number, the task id it returned); each publish logs ``dd-dpublish`` as it begins and is
slowed by :data:`PUBLISH_DELAY` (``before_task_publish``): the first call of a burst
writes the burst's record, then publishes its message, and a kill in between leaves a
burst whose message was never published, which a later call must publish.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from typing import Any

from celery import signals as celery_signals

from . import dedup_app as dd
from .config import Shared
from .events import EventLog

__all__ = ["PUBLISH_DELAY", "main"]

#: How long each publish of ``dd.debounce`` takes here (a slow broker).
PUBLISH_DELAY = 0.3
#: Calls per burst, seconds between them, and quiet seconds between bursts.
BURST = (2, 5)
SPACING = 0.15
QUIET = (0.6, 1.6)

_log: EventLog | None = None


@celery_signals.before_task_publish.connect
def _slow_publish(sender: Any = None, headers: Any = None, **_kw: Any) -> None:
    if sender != "dd.debounce" or _log is None:
        return
    _log.emit("dd-dpublish", id=(headers or {}).get("id"))
    time.sleep(PUBLISH_DELAY)


def main() -> int:
    global _log
    shared = Shared.from_env()
    # The sequence numbers go on across restarts: the first of this process's calls
    # comes after every call of the killed one.
    seq = int(time.monotonic() * 1000) * 10
    log = _log = EventLog(os.path.join(shared.log_dir, "debounce.jsonl"), w="debounce",
                          lane="dedup", pid=os.getpid())  # fmt: skip
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda _s, _f: stopping.set())
    signal.signal(signal.SIGINT, lambda _s, _f: stopping.set())
    rng = random.Random()
    while not stopping.is_set():
        for _ in range(rng.randint(*BURST)):
            seq += 1
            t0 = log.emit("dd-dcall-begin", seq=seq)
            try:
                result = dd.debounce.delay(seq)
            except Exception as exc:
                log.emit("dd-dcall-error", t=t0, seq=seq, error=repr(exc)[:200])
            else:
                log.emit("dd-dcall", t=t0, t1=time.monotonic(), seq=seq, returned=result.id)
            if stopping.wait(SPACING):
                break
        stopping.wait(rng.uniform(*QUIET))
    log.emit("dd-dclosed", seq=seq)
    return 0


if __name__ == "__main__":
    sys.exit(main())

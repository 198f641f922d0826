"""celery-once beside fenced's floods: one worker app, one flood, shared by
``rate_flood.py`` and ``debounce_flood.py``.

celery-once's ``QueueOnce`` takes a lock per name when a call is sent (here graceful, one
lock per flood: ``keys=["flood"]``) and clears it after the run: a call sent while one
of its name is queued or running gets a ``REJECTED`` result and is never published. It
is dropped, with its arguments (the "dropped trigger"). fenced's contenders run the same
work under ``claim_rate`` (``delay``: a call over the rate is put back for the start
booked for it) or ``claim_debounce`` (the burst runs once, with the last call's
arguments).

A flood is ``calls`` calls of one name, ``gap`` seconds apart, each carrying its number;
every run notes the number it ran with and when it started. The worker: one
``celery worker`` (prefork ``-c 2``) running this module, on the benchmark's own
redis-server (``BENCH_REDIS``; queue ``beside``; databases 0 broker, 3 celery-once's
locks, 5 the notes, 6 fenced's claims).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from itertools import pairwise
from pathlib import Path
from typing import Any

import redis
from celery import Celery, signals

HERE = Path(__file__).resolve().parent
URL = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379")
#: The rate of the rate flood's fenced task, and the debounce of the debounce flood's.
RATE = "10/s"
DEBOUNCE = "0.3s"
#: Each run's work (a partner API's answer, an index's write), seconds.
WORK = 0.05
QUEUE = "beside"
#: The longest a flood's runs are waited for, seconds: past it, the run failed.
LIMIT = 120.0
#: How long after the runs expected no other run may come, seconds.
SETTLE = 1.0

app = Celery("once_beside", broker=f"{URL}/0", set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    fenced_redis_url=f"{URL}/6",
    fenced_secret_key="once-beside-benchmark-secret-0123456789",
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": f"{URL}/3"}},
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
notes = redis.Redis.from_url(f"{URL}/5")


def _ran(flood: str, n: int) -> None:
    notes.rpush(f"ran:{flood}", json.dumps([n, time.time()]))
    time.sleep(WORK)


try:
    from fenced.celery import ClaimedTask

    @app.task(
        base=ClaimedTask,
        name="beside.fenced_rate",
        claim="sync:{flood}",
        claim_rate=RATE,
        claim_limit=2,
    )
    def fenced_rate(flood: str, n: int) -> None:
        """At most RATE starts; a call over it is put back for its booked start."""
        _ran(flood, n)

    @app.task(
        base=ClaimedTask,
        name="beside.fenced_debounce",
        claim="doc:{flood}",
        claim_debounce=DEBOUNCE,
    )
    def fenced_debounce(flood: str, n: int) -> None:
        """One run per burst, with the last call's arguments."""
        _ran(flood, n)

except ImportError:  # pragma: no cover
    pass

try:
    from celery_once import QueueOnce

    @app.task(base=QueueOnce, name="beside.once", once={"graceful": True, "keys": ["flood"]})
    def once_task(flood: str, n: int) -> None:
        """celery-once: a call sent while one of its flood is queued or running is dropped."""
        _ran(flood, n)

except ImportError:  # pragma: no cover
    pass


def installed() -> bool:
    """Whether celery-once can be imported (it comes with the ``bench`` group)."""
    return "beside.once" in app.tasks


@signals.task_prerun.connect
def _delivered(task: Any = None, args: Any = (), **_: Any) -> None:
    """Every delivery of a flood's message, in the worker (each message published is
    delivered once: the calls, and each put back or deferred)."""
    if getattr(task, "name", "").startswith("beside.") and args:
        notes.incr(f"delivered:{args[0]}")


def flood(task_name: str, calls: int, gap: float, expected: int | None = None) -> dict[str, Any]:
    """Send one flood through ``task_name`` and wait for its runs (``expected`` of them,
    else one per call celery-once did not refuse); its figures."""
    task = app.tasks[task_name]
    name = uuid.uuid4().hex[:8]
    refused = 0
    for n in range(calls):
        result = task.apply_async((name, n))
        refused += getattr(result, "state", None) == "REJECTED"
        time.sleep(gap)
    want = expected if expected is not None else calls - refused
    deadline = time.monotonic() + LIMIT
    while notes.llen(f"ran:{name}") < want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{task_name}: {notes.llen(f'ran:{name}')} of {want} runs came")
        time.sleep(0.01)
    time.sleep(SETTLE)  # a run more than expected would show here
    runs = [json.loads(x) for x in notes.lrange(f"ran:{name}", 0, -1)]
    published = int(notes.get(f"delivered:{name}") or 0)
    numbers = [n for n, _ in runs]
    starts = sorted(t for _, t in runs)
    gaps = [b - a for a, b in pairwise(starts)]
    return {
        "calls": calls,
        "published": published,
        "refused": refused,
        "runs": len(runs),
        "calls_run": len(set(numbers)),
        "last_call_ran": calls - 1 in numbers,
        "ran_with": sorted(numbers),
        "min_gap_ms": min(gaps) * 1000 if gaps else None,
        "span_s": starts[-1] - starts[0] if starts else 0.0,
    }


def beside(contenders: dict[str, str], calls: int, gap: float, expected: dict[str, int]) -> dict:
    """Start the worker, send one flood per contender (label: task name), stop it; the
    figures per contender."""
    from fenced.testing import CeleryWorker

    env = dict(os.environ, BENCH_REDIS=URL, PYTHONPATH=f"{HERE}:{HERE.parent / 'src'}")
    worker = CeleryWorker("_once", name="beside", concurrency=2, queues=QUEUE, cwd=HERE, env=env)
    worker.start().ready(timeout=90)
    try:
        return {
            label: flood(task, calls, gap, expected.get(label))
            for label, task in contenders.items()
            if task in app.tasks
        }
    finally:
        worker.kill()


def ran_with(numbers: list[int], calls: int) -> str:
    """The calls whose arguments ran, short: ``all``, ``#0``, ``#0 #7 #12``, ``#0 ... (9)``."""
    if len(set(numbers)) == calls:
        return "all"
    shown = " ".join(f"#{n}" for n in numbers[:3])
    return shown if len(numbers) <= 3 else f"{shown} ... ({len(numbers)})"


def report(figures: dict[str, dict[str, Any]], calls: int, gap: float, rate: bool) -> str:
    """:func:`beside`'s figures as a table under one line saying what the flood was
    (with the runs' least gap and their span for a rate flood)."""
    from _common import table

    headers, body = _rows(figures, rate)
    said = (
        f"beside celery-once: {calls} calls of one name {gap * 1000:g} ms apart, each run "
        f"{WORK * 1000:g} ms of work; one worker, prefork -c 2"
    )
    return f"{said}\n{table(headers, body, set(range(1, len(headers))) - {5, 6})}"


def _rows(figures: dict[str, dict[str, Any]], rate: bool) -> tuple[list[str], list[list[str]]]:
    headers = ["contender", "calls", "published", "refused", "runs", "ran with", "last ran"]
    if rate:
        headers += ["min gap ms", "span s"]
    out = []
    for label, f in figures.items():
        row = [
            label,
            str(f["calls"]),
            str(f["published"]),
            str(f["refused"]),
            str(f["runs"]),
            ran_with(f["ran_with"], f["calls"]),
            "yes" if f["last_call_ran"] else "no",
        ]
        if rate:
            gap = f["min_gap_ms"]
            row += ["-" if gap is None else f"{gap:.0f}", f"{f['span_s']:.2f}"]
        out.append(row)
    return headers, out

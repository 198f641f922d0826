"""What the beat fault tests share: three ``celery beat`` processes and a worker, who
leads, and the check that every due tick ran once or fell in a bounded gap."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis

from _wait import wait_for
from celery_harness import Beat, Services, Worker
from fenced._client import connect
from fenced.celery.beat import status

#: The app's entries (tests/celery_beat_app.py) and their periods, in ms.
PERIODS = {"every-1s": 1000, "every-2s": 2000, "claimed-2s": 2000}
WAIT = 60.0


@contextmanager
def beats_and_worker(services: Services, ttl: float, count: int = 3) -> Iterator[list[Beat]]:
    """``count`` beat processes and one solo worker running what they send."""
    worker = Worker(services, pool="solo", concurrency=1, app="tests.celery_beat_app")
    beats = [Beat(services, ttl=ttl, name=str(i)) for i in range(count)]
    services.obs().delete("runs")  # a module's tests share their observation Redis
    with worker:
        try:
            for beat in beats:
                beat.start()
            yield beats
        finally:
            for beat in beats:
                beat.stop()


def leader(services: Services, beats: list[Beat], not_pid: int | None = None) -> Beat:
    """Wait until one of ``beats`` (not ``not_pid``) leads, and return it."""

    def find() -> Beat | None:
        try:
            held = status(_claims(services), "tests").leader
        except (redis.ConnectionError, redis.TimeoutError):
            return None
        if held is None or held.pid == not_pid:
            return None
        return next((b for b in beats if b.pid == held.pid), None)

    found: Beat = wait_for("a beat to lead", find, WAIT, 0.05)
    return found


def _claims(services: Services) -> Any:
    """A client of the claims' Redis, in any URL form (a Sentinel's too)."""
    return connect(services.lock_url, socket_timeout=1.0, socket_connect_timeout=1.0)


def fence(services: Services) -> int | None:
    """The leader's fence now (None: nobody leads)."""
    held = status(_claims(services), "tests").leader
    return None if held is None else held.fence


def runs(services: Services) -> list[tuple[str, str]]:
    """(entry, task id) of every run the worker noted, in order."""
    return [tuple(x.split()[:2]) for x in services.obs().lrange("runs", 0, -1)]  # type: ignore[misc]


def wait_runs(services: Services, more: int) -> None:
    """Wait until ``more`` runs beyond those noted so far were noted."""
    target = len(runs(services)) + more
    wait_for(f"{target} runs", lambda: len(runs(services)) >= target, WAIT, 0.1)


def drain(services: Services) -> None:
    """Wait until the worker has taken every message from the queue."""
    broker = redis.Redis.from_url(services.broker_url)
    wait_for("the queue to drain", lambda: broker.llen(services.queue) == 0, WAIT, 0.1)
    time.sleep(0.5)  # the last message taken is noted by its run


def check_runs(noted: list[tuple[str, str]], gap_ms: float) -> dict[str, list[int]]:
    """Every (entry, due) ran at most once, two runs of an entry are at least half its
    period apart, and between two runs at most ``gap_ms`` more than a period passed.
    Each entry's due times, in order."""
    twice = [tid for tid, n in Counter(tid for _entry, tid in noted).items() if n > 1]
    assert not twice, f"ran more than once: {twice}"
    dues: dict[str, list[int]] = {}
    for entry, tid in noted:
        assert tid.startswith(f"fenced-beat:tests:{entry}:"), tid
        dues.setdefault(entry, []).append(int(tid.rsplit(":", 1)[1]))
    for entry, times in dues.items():
        times.sort()
        period = PERIODS[entry]
        steps = [b - a for a, b in itertools.pairwise(times)]
        assert all(s >= period / 2 for s in steps), (entry, steps)
        assert all(s <= period + gap_ms for s in steps), (entry, steps, gap_ms)
    return dues

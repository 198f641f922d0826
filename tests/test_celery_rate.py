"""``claim_rate`` with real workers: the rate holds across two worker processes.

The runs happen in two ``celery worker`` processes running tests/celery_rate_app.py;
the calls are sent here by name. Starts are read from their
fences, minted from Redis's clock in µs: the spacing is Redis's, not a host's.
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise
from typing import Any

import pytest
from celery import Celery

from celery_harness import WAIT, Services, Worker, key, notes
from fenced import ConfigError
from fenced.celery import ClaimedTask
from fenced.testing import RedisServer

APP = "tests.celery_rate_app"


@pytest.fixture
def services(redis_server: RedisServer) -> Services:
    """The module's server, a fresh queue."""
    return Services.on(redis_server)


def starts(services: Services, k: str) -> list[dict[str, Any]]:
    return notes(services.obs(), f"starts:{k}")


def test_a_bad_rate_fails_when_the_task_is_made_naming_the_fix() -> None:
    app = Celery("rate_config", set_as_current=False, broker="memory://")
    app.finalize()
    with pytest.raises(ConfigError, match=r"claim_rate='10/d'.*claim_rate='10/m'"):

        @app.task(base=ClaimedTask, claim="x:{a}", claim_rate="10/d", shared=False)
        def bad(a: int) -> None: ...

    with pytest.raises(ConfigError, match=r"claim_rate_policy='drop'.*'delay'.*'skip'"):

        @app.task(base=ClaimedTask, claim="x:{a}", claim_rate_policy="drop", shared=False)
        def bad_policy(a: int) -> None: ...

    with pytest.raises(ConfigError, match=r"claim_on_busy='replace' does not take a rate"):

        @app.task(
            base=ClaimedTask,
            claim="x:{a}",
            claim_rate="1/m",
            claim_on_busy="replace",
            shared=False,
        )
        def replacing(a: int) -> None: ...

        replacing._options()


def test_the_rate_holds_across_two_workers_and_delay_loses_nothing(services: Services) -> None:
    """A flood over the rate: each call over it is booked a start of its own and sent
    back once, for that start (or waits in the worker when it is a second off at most)."""
    app = services.client()
    k = key()
    calls = 16
    with (
        Worker(services, app=APP, concurrency=2, name="a"),
        Worker(services, app=APP, concurrency=2, name="b"),
    ):
        results = [app.send_task("r.flood", (k, i), queue=services.queue) for i in range(calls)]
        fences = [r.get(timeout=WAIT) for r in results]
    seen = starts(services, k)
    # Nothing dropped, nothing ran twice, and no put-back counted as a retry.
    assert len(seen) == calls and len({s["task_id"] for s in seen}) == calls
    assert {s["retries"] for s in seen} == {0}
    assert sorted(fences) == sorted(s["fence"] for s in seen)
    # Two a second across both workers: every start 500 ms after the last, by Redis.
    ordered = sorted(fences)
    assert all(b - a >= 500_000 for a, b in pairwise(ordered))
    assert len({s["worker"] for s in seen}) == 2
    # Each call was delivered at most twice: sent back once at most, for its own start.
    deliveries = Counter(d["task_id"] for d in notes(services.obs(), f"deliveries:{k}"))
    assert set(deliveries) == {s["task_id"] for s in seen}
    assert max(deliveries.values()) <= 2, deliveries
    # The flood's starts follow each other closely: booked, not retried at random.
    assert ordered[-1] - ordered[0] < (calls - 1) * 500_000 + 3_000_000


def test_skip_returns_the_reason_and_the_next_start(services: Services) -> None:
    app = services.client()
    k = key()
    with Worker(services, app=APP, concurrency=1):
        first = app.send_task("r.skip", (k,), queue=services.queue).get(timeout=WAIT)
        second = app.send_task("r.skip", (k,), queue=services.queue).get(timeout=WAIT)
    assert isinstance(first, int)
    assert second["status"] == "skipped" and second["reason"] == "rate limited"
    assert 3500 < second["expires_in"] <= 3600
    assert len(starts(services, k)) == 1

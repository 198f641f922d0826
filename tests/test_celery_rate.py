"""``claim_rate`` with real workers: the rate holds across two worker processes.

The runs happen in two ``celery worker`` processes running tests/celery_rate_app.py;
the calls are sent here by name. Starts are read from their
fences, minted from Redis's clock in µs: the spacing is Redis's, not a host's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from celery import Celery

from _wait import wait_for
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
        Worker(services, app=APP, concurrency=2, name="a") as a,
        Worker(services, app=APP, concurrency=2, name="b") as b,
    ):
        results = [app.send_task("r.flood", (k, i), queue=services.queue) for i in range(calls)]
        fences = [r.get(timeout=WAIT) for r in results]
        logs = a.log() + b.log()
    seen = starts(services, k)
    # A put-back says so, and nothing calls it a retry: no Retry line, no retry signal.
    ids = {r.id for r in results}
    assert [i for i in ids if f"[{i}] put back for" in logs], logs[-3000:]
    assert "Retry in" not in logs and "] retry:" not in logs, logs[-3000:]
    assert not [n for n in notes(services.obs(), "signal:retry") if n["task_id"] in ids]
    # Nothing dropped, nothing ran twice, and no put-back counted as a retry.
    odd = [(r.id, f) for r, f in zip(results, fences, strict=True) if not isinstance(f, int)]
    assert len(seen) == calls and len({s["task_id"] for s in seen}) == calls, (odd, logs[-4000:])
    assert {s["retries"] for s in seen} == {0}
    assert sorted(fences) == sorted(s["fence"] for s in seen)
    # Two in any second across both workers, by Redis: the first two at once, and every
    # start a second or more after the one two before it.
    ordered = sorted(fences)
    assert all(ordered[i + 2] - ordered[i] >= 1_000_000 for i in range(calls - 2))
    assert ordered[1] - ordered[0] < 1_000_000
    assert len({s["worker"] for s in seen}) == 2
    # Each call was delivered at most twice: sent back once at most, for its own start.
    deliveries = Counter(d["task_id"] for d in notes(services.obs(), f"deliveries:{k}"))
    assert set(deliveries) == {s["task_id"] for s in seen}
    assert max(deliveries.values()) <= 2, deliveries
    # The flood's starts follow each other closely: booked, not retried at random.
    assert ordered[-1] - ordered[0] < (calls // 2 - 1) * 1_000_000 + 3_000_000


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


def test_a_call_put_back_reads_retry_and_is_logged_as_put_back(services: Services) -> None:
    """While its message waits for its start, a call's result reads RETRY with the
    ClaimHeld saying when (never FAILURE), and the worker logs one fenced line for it
    and Celery's "ignored": no retry line, no retry signal."""
    app = services.client()
    k = key()
    with Worker(services, app=APP, concurrency=1) as worker:
        first = app.send_task("r.minutely", (k,), queue=services.queue)
        assert isinstance(first.get(timeout=WAIT), int)
        second = app.send_task("r.minutely", (k,), queue=services.queue)
        wait_for("the delivery to end", lambda: f"r.minutely[{second.id}] ignored" in worker.log())
        assert second.state == "RETRY"
        assert "is rate limited" in str(second.info), second.info
        said = [line for line in worker.log().splitlines() if second.id in line]
    put_back = [line for line in said if "put back for" in line]
    assert len(put_back) == 1 and "INFO" in put_back[0], said
    assert "(its booked start) by claim_rate='1/m'" in put_back[0], put_back
    assert not [line for line in said if "retry" in line.lower() or "ERROR" in line], said
    assert not [n for n in notes(services.obs(), "signal:retry") if n["task_id"] == second.id]
    assert len(starts(services, k)) == 1

"""``claim_on_busy="replace"`` with real workers: the newest call wins, by call order.

The sending side runs here (tests/celery_replace_app.py's ``make_app``); the runs happen
in a ``celery worker`` running the same module.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from celery import Celery

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key
from celery_replace_app import make_app
from fenced import records
from fenced.store import RedisPointer
from fenced.testing import RedisServer

APP = "tests.celery_replace_app"


@pytest.fixture
def services(redis_server: RedisServer) -> Services:
    """The module's server, a fresh queue."""
    return Services.on(redis_server)


def sender(services: Services) -> Celery:
    return services.sender(make_app)


def runs(services: Services, k: str) -> list[dict[str, Any]]:
    """The runs of ``rp:<k>`` that started, oldest first."""
    return [json.loads(x) for x in services.obs().lrange(f"runs:{k}", 0, -1)]


def go(services: Services, k: str) -> None:
    services.obs().set(f"go:{k}", 1)


def published(services: Services, k: str) -> str | None:
    pointer = RedisPointer(services.lock_url, f"replace:{k}").read()
    return None if pointer is None else pointer.target


def test_until_started_a_call_made_while_a_run_runs_replaces_it(services: Services) -> None:
    task = sender(services).tasks["r.started"]
    k = key()
    marker = f"fenced:{{rp:{k}}}:queued"
    with Worker(services, concurrency=2, app=APP):
        first = task.delay(k, "1")
        wait_for("the first run to start", lambda: len(runs(services, k)) == 1)
        # Its message left the queue: its run's takeover of the name cleared the mark.
        assert services.locks().get(marker) is None
        second = task.delay(k, "2")
        assert second.id != first.id  # published, not the running call's AsyncResult
        wait_for("the second run to start", lambda: len(runs(services, k)) == 2)
        stopped = first.get(timeout=WAIT)
        assert stopped["status"] == "replaced" and second.id in stopped["reason"], stopped
        third = task.delay(k, "3")
        assert third.id not in (first.id, second.id)
        wait_for("the third run to start", lambda: len(runs(services, k)) == 3)
        assert second.get(timeout=WAIT)["status"] == "replaced"
        go(services, k)
        assert third.get(timeout=WAIT) == "3"
    assert [run["version"] for run in runs(services, k)] == ["1", "2", "3"]
    assert published(services, k) == "3"


def test_an_older_calls_retry_does_not_replace_the_newer_run(services: Services) -> None:
    task = sender(services).tasks["r.plain"]
    k = key()
    with Worker(services, concurrency=2, app=APP):
        first = task.apply_async((k, "1"), {"retry_in": 2.0})
        holder = f"fenced:{{rp:{k}}}:handover"
        wait_for(
            "the first call to keep its lease for its retry", lambda: services.locks().get(holder)
        )
        second = task.delay(k, "2")  # takes over the lease kept for the retry
        wait_for("the second call to run", lambda: len(runs(services, k)) == 1)
        # The first call's retry comes two seconds later: it must not replace call 2.
        stopped = first.get(timeout=WAIT)
        assert stopped["status"] == "replaced", stopped
        assert second.id in stopped["reason"], stopped
        assert stopped["holder"]["task_id"] == second.id, stopped
        go(services, k)
        assert second.get(timeout=WAIT) == "2"
    assert [run["version"] for run in runs(services, k)] == ["2"]
    assert published(services, k) == "2"
    mine = [run for run in records.history(services.locks(), f"rp:{k}") if run.task_id == first.id]
    assert any("replaced by" in (run.reason or "") and run.outcome != "ok" for run in mine), mine


def test_an_older_calls_redelivery_does_not_replace_the_newer_run(services: Services) -> None:
    task = sender(services).tasks["r.plain"]
    k = key()
    older = f"older-{k}"
    with Worker(services, concurrency=2, app=APP):
        first = task.apply_async((k, "1"), task_id=older)
        wait_for("the first run to start", lambda: len(runs(services, k)) == 1)
        second = task.delay(k, "2")
        wait_for("the second run to start", lambda: len(runs(services, k)) == 2)
        assert first.get(timeout=WAIT)["status"] == "replaced"
        # The older call's message again, under its task id (a redelivery).
        again = task.apply_async((k, "1"), task_id=older)
        again_result = again.get(timeout=WAIT)
        assert again_result["status"] == "replaced", again_result
        assert second.id in again_result["reason"], again_result
        go(services, k)
        assert second.get(timeout=WAIT) == "2"
    assert [run["version"] for run in runs(services, k)] == ["1", "2"]
    assert published(services, k) == "2"

"""A call's ``expires`` with fenced's put-backs, with real workers.

A call over ``claim_rate`` (``delay``) is put back for its booked start, and a debounced
task's message waits while its name is held: both are published again under the same
task id. The caller's ``expires`` goes with them, as the same absolute time. A start
that would come after it is not waited for: the delivery ends as Celery ends an expired
message (``REVOKED``), and what the call held (its booked start, its queued mark) is
let go, so the next call is not held back by a call that will never run.

The runs happen in a ``celery worker`` running tests/celery_expires_app.py (the rate)
or tests/celery_debounce_app.py (the debounce); calls are sent from here.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore, TaskRevokedError

from _wait import wait_for
from celery_debounce_app import make_app as make_debounce_app
from celery_expires_app import make_app
from celery_harness import WAIT, Services, Worker, key, notes
from fenced.celery import ClaimedTask, _debounce
from fenced.testing import RedisServer

APP = "tests.celery_expires_app"
DEBOUNCE_APP = "tests.celery_debounce_app"


@pytest.fixture
def services(redis_server: RedisServer) -> Services:
    """The module's server, a fresh queue."""
    return Services.on(redis_server)


def sender(services: Services) -> Celery:
    return services.sender(make_app)


def starts(services: Services, k: str) -> list[dict[str, Any]]:
    return notes(services.obs(), f"starts:{k}")


def booked(services: Services, name: str, task_id: str) -> float | None:
    """The start booked for a task id on a claim name (Redis TIME, µs), or None."""
    return services.locks().zscore(f"fenced:{{{name}}}:rate:starts", f"b:{task_id}")


def revoked_notes(services: Services, task_id: str) -> list[dict[str, Any]]:
    return notes(services.obs(), f"revoked:{task_id}")


def said(log: str, task_id: str) -> list[str]:
    return [line for line in log.splitlines() if task_id in line]


def test_a_call_booked_past_its_expires_ends_expired_and_frees_its_start(
    services: Services,
) -> None:
    """``claim_rate="1/m"``: a call made just after a start is booked a minute out. With
    ``expires=5`` it is not put back for then (it would be discarded when it came): it
    ends ``REVOKED`` at once, its booking goes, and the next call is booked the start
    it left, not one a minute later."""
    task = sender(services).tasks["x.minutely"]
    k = key()
    with Worker(services, app=APP, concurrency=1) as worker:
        first = task.delay(k)
        assert isinstance(first.get(timeout=WAIT), int)
        sent = time.monotonic()
        second = task.apply_async((k,), expires=5)
        with pytest.raises(TaskRevokedError):
            second.get(timeout=10)
        took = time.monotonic() - sent
        assert str(second.state) == "REVOKED"  # (not in the stubs' states)
        assert booked(services, f"xm:{k}", second.id) is None
        third = task.delay(k)
        wait_for("the third call to be put back", lambda: third.state == "RETRY")
        log = worker.log()
    assert took < 4.5, took  # ended at its delivery, not when its put-back would come
    lines = said(log, second.id)
    expired = [line for line in lines if "expired before its rate-limited start" in line]
    assert len(expired) == 1 and "INFO" in expired[0], lines
    assert not [line for line in lines if "put back for" in line], lines
    assert revoked_notes(services, second.id) == [{"expired": True, "terminated": False}]
    # The third call is booked the start the second one let go: one minute after the
    # first start, not two.
    first_start = starts(services, k)[0]["fence"]
    third_start = booked(services, f"xm:{k}", third.id)
    assert third_start is not None
    assert third_start - first_start < 61_000_000, (third_start - first_start) / 1e6
    assert [s["task_id"] for s in starts(services, k)] == [first.id]


def test_a_put_back_keeps_the_same_absolute_expires(services: Services) -> None:
    """A call booked before its expiry is put back with the expiry it was sent with, the
    same instant, not one counted again from the put-back."""
    task = sender(services).tasks["x.minutely"]
    k = key()
    expires = (datetime.now(timezone.utc) + timedelta(seconds=600)).replace(microsecond=123456)
    with Worker(services, app=APP, concurrency=1) as worker:
        assert isinstance(task.delay(k).get(timeout=WAIT), int)
        second = task.apply_async((k,), expires=expires)
        wait_for("the put-back", lambda: f"x.minutely[{second.id}] ignored" in worker.log())
        assert second.state == "RETRY"
        broker = redis.Redis.from_url(services.broker_url)

        def put_back() -> list[dict[str, Any]]:
            # Queued, or taken by the worker to wait for its eta (a moment in neither);
            # the first delivery's message may not be acknowledged yet (no eta).
            held = [json.loads(raw)[0] for raw in broker.hvals("unacked")]
            held += [json.loads(raw) for raw in broker.lrange(services.queue, 0, -1)]
            return [m for m in held if m["headers"]["id"] == second.id and m["headers"]["eta"]]

        again = wait_for("the message put back", put_back, timeout=10)
    assert len(again) == 1, again
    assert again[0]["headers"]["expires"] == expires.isoformat()


def test_a_start_waited_for_in_the_worker_never_comes_after_expires(services: Services) -> None:
    """``claim_rate="1/s"``: a booked start a second off is waited for in the worker, not
    put back; but not past the call's ``expires``: the call ends ``REVOKED`` and never
    starts."""
    task = sender(services).tasks["x.secondly"]
    k = key()
    with Worker(services, app=APP, concurrency=1) as worker:
        first = task.delay(k)
        second = task.apply_async((k,), expires=0.8)
        assert isinstance(first.get(timeout=WAIT), int)
        with pytest.raises(TaskRevokedError):
            second.get(timeout=10)
        # Its start was not taken: the next call starts a second after the first.
        third = task.delay(k)
        assert isinstance(third.get(timeout=WAIT), int)
        log = worker.log()
    assert [s["task_id"] for s in starts(services, k)] == [first.id, third.id]
    lines = said(log, second.id)
    # (Celery itself discards it when it comes after its expiry already.)
    assert [
        line
        for line in lines
        if "expired before its rate-limited start" in line or "Discarding expired task" in line
    ], lines


def test_an_expired_put_back_clears_its_queued_mark(services: Services) -> None:
    """``claim_enqueue="until_finished"``: the name is marked for a queued call until its
    run ends. A call that expires before its rate-limited start never runs: its mark
    goes with it, and the next call is published, not handed the dead call's result."""
    task = sender(services).tasks["x.queued"]
    k = key()
    with Worker(services, app=APP, concurrency=1):
        assert isinstance(task.delay(k).get(timeout=WAIT), int)
        second = task.apply_async((k,), expires=5)
        with pytest.raises(TaskRevokedError):
            second.get(timeout=10)
        assert services.locks().get(f"fenced:{{xq:{k}}}:queued") is None
        third = task.delay(k)
        assert third.id != second.id
        wait_for("the third call to be put back", lambda: third.state == "RETRY")


def test_a_debounced_call_with_expires_ends_expired_while_its_name_is_held(
    services: Services,
) -> None:
    """A call of a debounced task with its own ``expires`` is sent as it is; while a run
    holds its name it waits, but not past its expiry: it ends ``REVOKED`` when its wait
    would outlast it, and a burst of later calls then runs as usual."""
    job = services.sender(make_debounce_app).tasks["d.job"]
    k = key()
    obs = services.obs()
    obs.set(f"hold:{k}", 1)
    with Worker(services, app=DEBOUNCE_APP, concurrency=2) as worker:
        first = job.delay(k, 1)
        wait_for("the first run", lambda: obs.llen(f"runs:{k}") >= 1)
        own = job.apply_async((k, 2), expires=1.5)
        assert own.id != first.id  # not joined: sent as it is
        with pytest.raises(TaskRevokedError):
            own.get(timeout=10)
        later = [job.delay(k, n) for n in (3, 4)]
        obs.set(f"go:{k}", 1)
        assert first.get(timeout=WAIT) == 1
        assert later[0].id == later[1].id != own.id
        assert later[0].get(timeout=WAIT) == 4
        log = worker.log()
    lines = said(log, own.id)
    expired = [line for line in lines if "expired before its debounced start" in line]
    assert len(expired) == 1 and "INFO" in expired[0], lines
    assert "Discarding expired task" not in "\n".join(lines), lines
    ran = [json.loads(x) for x in obs.lrange(f"runs:{k}", 0, -1)]
    assert [r["n"] for r in ran if r["at"] == "start"] == [1, 4]


def test_a_burst_message_that_would_wait_past_its_expires_forgets_its_burst(
    services: Services,
) -> None:
    """A burst's message is published with no expiry; one that carries one all the same
    (sent by another client, or an older fenced) and would wait past it is not
    published again: its burst record goes, so the next call opens a new burst instead
    of joining one whose message never runs. In process, as the worker calls it."""
    app = Celery(
        f"expires_{key()}",
        set_as_current=False,
        broker=services.broker_url,
        backend=services.backend_url,
    )
    app.conf.update(
        fenced_redis_url=services.lock_url,
        fenced_secret_key="expires-tests-secret-key-0123456789",
        task_default_queue=services.queue,
    )

    @app.task(base=ClaimedTask, bind=True, claim="pe:{k}", claim_debounce=5, shared=False)
    def job(self: Any, k: str) -> str:
        return k

    k = key()
    record = f"fenced:{{pe:{k}}}:debounce"
    burst = job.delay(k)
    assert services.locks().hget(record, "id") == burst.id
    expires = datetime.now(timezone.utc) + timedelta(seconds=2)
    job.push_request(
        id=burst.id,
        args=(k,),
        kwargs={},
        expires=expires.isoformat(),
        delivery_info={"exchange": "", "routing_key": services.queue},
        is_eager=False,
        called_directly=False,
    )
    try:
        with pytest.raises(Ignore):
            _debounce.delivered(job, (k,), {}, lambda _: None, lambda _: None)
    finally:
        job.pop_request()
    assert not services.locks().exists(record)
    assert str(job.AsyncResult(burst.id).state) == "REVOKED"
    # Only the burst's first message is in the queue: it was not published again.
    assert services.queued() == 1
    fresh = job.delay(k)
    assert fresh.id != burst.id
    assert services.locks().hget(record, "id") == fresh.id

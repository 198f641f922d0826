"""ClaimedTask in the threads and solo pools: skips, interrupts (an asynchronous exception
in a pool thread; a signal in the solo worker's main thread), and an unreachable claims
Redis, which makes the task retry instead of running unclaimed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key, notes
from fenced import Claim, ClaimLost, records
from fenced._inspect import read_holder
from fenced._lease import ClaimKeys, new_token
from fenced.testing import RedisServer


def _services(server: RedisServer, lock_url: str | None = None) -> Services:
    return Services.on(server, lock_url=lock_url)


@pytest.fixture(scope="module")
def threads(redis_server: RedisServer) -> Iterator[Services]:
    services = _services(redis_server)
    with Worker(services, pool="threads", concurrency=2, name="threads"):
        yield services


@pytest.fixture(scope="module")
def lock_server() -> Iterator[RedisServer]:
    """The solo worker's claims live here, so a test can take it down."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def solo(redis_server: RedisServer, lock_server: RedisServer) -> Iterator[Services]:
    services = _services(redis_server, lock_url=lock_server.url)
    with Worker(services, pool="solo", concurrency=1, name="solo"):
        yield services


def _send(services: Services, task: str, *args: Any, **kwargs: Any) -> Any:
    return services.client().send_task(task, args=args, kwargs=kwargs, queue=services.queue)


# -- threads --------------------------------------------------------------------------------


def test_threads_same_task_twice_one_runs_one_skips(threads: Services) -> None:
    k = key()
    sent = [_send(threads, "t.rebuild", k, "roads", steps=5, step_time=0.4) for _ in range(2)]
    statuses = sorted(r.get(timeout=WAIT)["status"] for r in sent)
    assert statuses == ["ok", "skipped"]
    outcomes = sorted(run.outcome for run in records.history(threads.locks(), f"rebuild:{k}:roads"))
    assert outcomes == ["ok", "skipped"]


def test_threads_lost_claim_interrupts_a_busy_task(threads: Services) -> None:
    k = key()
    obs, locks = threads.obs(), threads.locks()
    result = _send(threads, "t.spinner", k, 30)
    wait_for("the task to start", lambda: notes(obs, f"sleeper:{k}"))
    lock = ClaimKeys.of(f"spin:{k}").lock
    intruder = new_token("someone-else")
    locks.set(lock, intruder, px=20_000)
    with pytest.raises(ClaimLost):
        result.get(timeout=20)
    assert [n["event"] for n in notes(obs, f"sleeper:{k}")] == ["start"]
    assert locks.get(lock) == intruder
    assert records.history(locks, f"spin:{k}")[0].outcome == "lost"
    # The pool thread survives the interrupt and runs the next task.
    assert _send(threads, "t.rebuild", k, "roads", steps=1).get(timeout=WAIT)["status"] == "ok"


# -- solo -----------------------------------------------------------------------------------


def test_solo_skip_then_run(solo: Services) -> None:
    k = key()
    locks = solo.locks()
    holder = Claim(locks, f"rebuild:{k}:roads", ttl=30)
    assert holder.acquire()
    try:
        assert _send(solo, "t.rebuild", k, "roads").get(timeout=WAIT)["status"] == "skipped"
    finally:
        holder.release()
    assert _send(solo, "t.rebuild", k, "roads", steps=2).get(timeout=WAIT)["status"] == "ok"
    outcomes = [run.outcome for run in records.history(locks, f"rebuild:{k}:roads")]
    assert outcomes == ["ok", "skipped"]


def test_solo_lost_claim_wakes_a_sleeping_task(solo: Services) -> None:
    k = key()
    obs, locks = solo.obs(), solo.locks()
    result = _send(solo, "t.sleeper", k, 30)
    wait_for("the task to start", lambda: notes(obs, f"sleeper:{k}"))
    locks.set(ClaimKeys.of(f"sleep:{k}").lock, new_token("someone-else"), px=20_000)
    with pytest.raises(ClaimLost):
        result.get(timeout=20)
    assert [n["event"] for n in notes(obs, f"sleeper:{k}")] == ["start"]
    assert _send(solo, "t.rebuild", k, "roads", steps=1).get(timeout=WAIT)["status"] == "ok"


def test_unreachable_claims_redis_retries_and_never_runs_unclaimed(
    solo: Services, lock_server: RedisServer
) -> None:
    k = key()
    obs = solo.obs()
    lock_server.kill()
    try:
        result = _send(solo, "t.rebuild", k, "roads", steps=2, run=k)
        wait_for(
            "two retries",
            lambda: len([n for n in notes(obs, "signal:retry") if n["task_id"] == result.id]) >= 2,
        )
        assert not notes(obs, f"marks:{k}")  # it never ran without its claim
    finally:
        lock_server.restart()
    assert result.get(timeout=WAIT)["status"] == "ok"
    retries = [n for n in notes(obs, "signal:retry") if n["task_id"] == result.id]
    assert all("ClaimUnavailable" in n["reason"] for n in retries)
    assert len(notes(obs, f"marks:{k}")) == 2
    assert read_holder(solo.locks(), f"rebuild:{k}:roads") is None

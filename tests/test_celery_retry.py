"""A claim kept across a task's retries: HANDOVER and TAKEOVER, in a real prefork worker
and on a test-owned Redis.

A run that asks for a retry (``self.retry()``, ``autoretry_for``) keeps its lease for the
retried message of the same task id, which takes it over under a new fence; a duplicate
sent meanwhile is skipped; a retried message that never comes frees the name after the
countdown plus the claim's ttl. Faults around a takeover: the attempt that took over
killed (twice) beside a copy of its message, and Redis paused during the takeover.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key, notes
from fenced import Claim, records
from fenced._inspect import read_holder
from fenced._lease import ClaimKeys, short_token
from fenced.testing import RedisServer


@dataclass
class Cel:
    """A running worker and the handles a test needs."""

    services: Services
    client: Celery
    obs: redis.Redis
    locks: redis.Redis

    def send(self, task: str, *args: Any, **kwargs: Any) -> AsyncResult[Any]:
        """Send a task to the worker's queue."""
        return self.client.send_task(task, args=args, kwargs=kwargs, queue=self.services.queue)

    def history(self, name: str) -> list[records.RunRecord]:
        """The claim's run records, newest first."""
        return records.history(self.locks, name, limit=50)


@pytest.fixture(scope="module")
def cel(redis_server: RedisServer) -> Iterator[Cel]:
    services = Services.on(redis_server)
    client = services.client()
    try:
        with Worker(services, name="retry"):
            yield Cel(services, client, services.obs(), services.locks())
    finally:
        client.close()


def _outcomes(cel: Cel, name: str) -> list[tuple[str | None, str]]:
    return [(run.task_id, run.outcome) for run in cel.history(name)]


def _retried(cel: Cel, name: str) -> records.RunRecord:
    """The run that asked for a retry, once its end is recorded."""

    def found() -> records.RunRecord | None:
        return next((r for r in cel.history(name) if r.outcome == "retried"), None)

    return wait_for(f"a retried run of {name!r}", found, WAIT, 0.02)


def _kept_then_taken_over(cel: Cel, task: str) -> None:
    k = key()
    name = f"retry:{k}"
    first = cel.send(task, k, gated=True)
    earlier = _retried(cel, name)
    assert earlier.task_id == first.id and earlier.fence is not None
    # The lease is kept for the retried message: a duplicate (another task id) is skipped.
    holder = read_holder(cel.locks, name)
    assert holder is not None and holder.task_id == first.id
    duplicate = cel.send(task, k, gated=True)
    skip = duplicate.get(timeout=WAIT)
    assert skip["status"] == "skipped" and skip["holder"]["task_id"] == first.id
    # The retried attempt runs (it waits at the gate), under a new and larger fence.
    attempts = wait_for(
        "the retried attempt",
        lambda: [a for a in notes(cel.obs, f"attempts:{k}") if a["retries"] == 1],
    )
    assert attempts[0]["task_id"] == first.id
    assert attempts[0]["fence"] > earlier.fence
    cel.obs.set(f"gate:{k}", 1)
    result = first.get(timeout=WAIT)
    assert result["retries"] == 1 and result["fence"] == attempts[0]["fence"]
    # The first attempt ran once, the duplicate never: only two attempts of the body.
    assert [a["task_id"] for a in notes(cel.obs, f"attempts:{k}")] == [first.id, first.id]
    runs = cel.history(name)
    assert sorted((r.task_id, r.outcome) for r in runs) == sorted(
        [(first.id, "ok"), (duplicate.id, "skipped"), (first.id, "retried")]
    )
    ok = next(r for r in runs if r.outcome == "ok")
    assert ok.fence == result["fence"]
    assert earlier.reason is not None and earlier.reason.startswith("retrying in ")
    assert read_holder(cel.locks, name) is None
    assert not cel.locks.exists(ClaimKeys.of(name).handover)


def test_a_retry_keeps_the_claim_and_the_retried_message_takes_it_over(cel: Cel) -> None:
    _kept_then_taken_over(cel, "t.retry_once")


def test_autoretry_for_keeps_the_claim_likewise(cel: Cel) -> None:
    _kept_then_taken_over(cel, "t.autoretry")


def test_retries_exceeded_fail_and_release(cel: Cel) -> None:
    k = key()
    name = f"retry:{k}"
    result = cel.send("t.retry_forever", k)
    with pytest.raises(Exception) as failed:
        result.get(timeout=WAIT)
    assert "MaxRetriesExceeded" in type(failed.value).__name__
    assert read_holder(cel.locks, name) is None
    assert _outcomes(cel, name) == [(result.id, "failed"), (result.id, "retried")]
    fences = [r.fence for r in cel.history(name)]
    assert fences[0] is not None and fences[1] is not None and fences[0] > fences[1]


def test_a_retried_message_that_never_comes_frees_the_name_after_countdown_and_ttl(
    cel: Cel,
) -> None:
    k = key()
    name = f"retry:{k}"
    nowhere = f"nowhere-{k}"
    first = cel.send("t.retry_elsewhere", k, nowhere, countdown=2.0)
    _retried(cel, name)
    # Kept for the countdown plus the ttl (3 s), not renewed: it only runs down.
    keys = ClaimKeys.of(name)
    kept = int(cel.locks.pttl(keys.lock))
    assert 0 < kept <= (2.0 + cel.services.ttl) * 1000
    assert cel.locks.get(keys.handover) == cel.locks.get(keys.lock)
    with cel.client.connection_for_write() as conn:
        channel: Any = conn.default_channel
        purged = channel.queue_purge(nowhere)
    assert purged == 1
    wait_for("the kept lease to expire", lambda: read_holder(cel.locks, name) is None)
    assert not cel.locks.exists(keys.handover)
    # The name is free: a new call runs, under a larger fence.
    again = cel.send("t.retry_once", k, countdown=0.1).get(timeout=WAIT)
    assert again["status"] == "ok"
    retried = [r for r in cel.history(name) if r.task_id == first.id]
    assert [r.outcome for r in retried] == ["retried"]
    assert retried[0].fence is not None and again["fence"] > retried[0].fence


def test_a_taken_over_run_killed_twice_beside_a_copy_never_runs_two_bodies_at_once(
    cel: Cel,
) -> None:
    k = key()
    name = f"retry:{k}"
    first = cel.send("t.retry_once", k, countdown=0.3, gated=True)

    def attempts() -> list[dict[str, Any]]:
        return notes(cel.obs, f"attempts:{k}")

    def retried(n: int) -> dict[str, Any]:
        """The ``n``-th body of a retried attempt (after the first, which asked for it)."""
        found = wait_for(f"retried attempt {n}", lambda: attempts()[n:] or None)
        return found[0]

    took_over = retried(1)
    # A copy of the message (a broker delivering it again) while that attempt runs: it
    # finds its own task id holding the claim, not handed over, and waits its turn.
    cel.client.send_task(
        "t.retry_once",
        args=(k,),
        kwargs={"countdown": 0.3, "gated": True},
        queue=cel.services.queue,
        task_id=first.id,
    )
    wait_for(
        "the copy to wait for the running attempt",
        lambda: [
            n
            for n in notes(cel.obs, "signal:retry")
            if n["task_id"] == first.id and "ClaimHeld" in n["reason"]
        ],
    )
    assert len(attempts()) == 2  # no second body beside the running one
    running = took_over
    for n in (2, 3):  # the pool child killed: the message (or its copy) comes back, twice
        killed_at = time.time()
        os.kill(running["pid"], signal.SIGKILL)
        running = retried(n)
        assert running["at"] > killed_at  # the next body starts after the last one died
    cel.obs.set(f"gate:{k}", 1)
    result = first.get(timeout=WAIT)
    # Every delivery of the task ends (a later one finds it completed and does not run).
    broker = redis.Redis.from_url(cel.services.broker_url)
    wait_for(
        "every delivery to end",
        lambda: not broker.hlen("unacked") and not broker.llen(cel.services.queue),
    )
    bodies = attempts()
    assert [b["task_id"] for b in bodies] == [first.id] * 4
    fences = [b["fence"] for b in bodies]
    assert fences == sorted(set(fences)) and result["fence"] == fences[-1]
    outcomes = Counter(r.outcome for r in cel.history(name) if r.task_id == first.id)
    assert outcomes["ok"] == 1 and outcomes["aborted"] == 2 and outcomes["retried"] == 1
    # The name is not blocked afterwards.
    assert read_holder(cel.locks, name) is None
    assert not cel.locks.exists(ClaimKeys.of(name).handover)
    again = cel.send("t.retry_once", k, countdown=0.1).get(timeout=WAIT)
    assert again["status"] == "ok" and again["fence"] > fences[-1]


def test_redis_paused_during_a_takeover_retries_cleanly_and_runs_once(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCED_TEST_SOCKET_TIMEOUT", "0.5")
    with RedisServer() as claims:
        services = Services.on(redis_server, lock_url=claims.url)
        client, obs, locks = services.client(), services.obs(), services.locks()
        k = key()
        name = f"retry:{k}"
        assert claims.proc is not None
        obs.set(f"pause:{k}", claims.proc.pid)
        try:
            with Worker(services, name="paused"):
                result = client.send_task("t.retry_paused", args=(k,), queue=services.queue)
                wait_for("the pause", lambda: obs.exists(f"paused:{name}"))
                time.sleep(2.0)  # the takeover times out meanwhile
                claims.resume()
                done = result.get(timeout=WAIT)
            assert done["status"] == "ok" and done["retries"] >= 2
            retries = [n for n in notes(obs, "signal:retry") if n["task_id"] == result.id]
            assert any("ClaimUnavailable" in n["reason"] for n in retries)
            # Two bodies: the one that asked for the retry, and one after the pause.
            bodies = notes(obs, f"attempts:{k}")
            assert [b["retries"] for b in bodies][:1] == [0] and len(bodies) == 2
            assert bodies[1]["fence"] > bodies[0]["fence"] == _retried_fence(locks, name)
            assert read_holder(locks, name) is None
            assert not locks.exists(ClaimKeys.of(name).handover)
        finally:
            claims.resume()  # a test that failed while it was paused
            client.close()


def _retried_fence(locks: redis.Redis, name: str) -> int | None:
    run = next((r for r in records.history(locks, name) if r.outcome == "retried"), None)
    return None if run is None else run.fence


# -- the scripts, without a worker ----------------------------------------------------------


def test_a_running_attempt_of_the_same_task_id_is_never_taken_over(
    redis_server: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    running = Claim(client, f"z-{key()}", ttl=5, task_id="task-1", heartbeat=False)
    assert running.acquire()
    retry = Claim(client, running.name, ttl=30, task_id="task-1", heartbeat=False)
    # Still running (a zombie worker, or one slow to end): no handover, no takeover.
    assert not retry.acquire()
    assert not retry.take_over()
    assert running.token is not None
    assert retry.holder is not None and retry.holder.token == short_token(running.token)
    assert running.held
    # Another task id never takes over a kept lease.
    assert running.hand_over(30, "retrying in 27.0s") == "retried"
    # Kept under a value of its own: a renewal of the ended run can no longer touch it.
    assert running.token is not None
    assert client.get(running.key) == f"retry-{running.token}".encode()
    assert int(client.pttl(running.key)) > 5000  # kept longer than its ttl
    assert not running.refresh()
    other = Claim(client, running.name, ttl=30, task_id="task-2", heartbeat=False)
    assert not other.take_over()
    assert retry.take_over()
    assert retry.fence is not None and running.fence is not None and retry.fence > running.fence
    # The earlier attempt's renewals are refused from here on; it never holds again.
    assert not running.held and not running.refresh()
    assert running.hand_over(30) == ""
    assert retry.release(outcome="ok")


def test_a_handover_of_a_lease_already_gone_records_lost(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    claim = Claim(client, f"z-{key()}", ttl=30, task_id="task-1", heartbeat=False, records=True)
    assert claim.acquire()
    client.delete(claim.key)
    assert claim.hand_over(10, "retrying in 7.0s") == "lost"
    assert claim.vanished
    run = records.last(client, claim.name)
    assert run is not None and run.outcome == "lost"
    assert not client.exists(claim.keys.handover)


def test_a_retrys_countdown_is_read_from_seconds_or_an_eta() -> None:
    from datetime import datetime, timedelta, timezone

    from fenced.celery._task import _seconds_until

    app = Celery("eta", set_as_current=False)
    assert _seconds_until(app, 2) == 2.0 and _seconds_until(app, None) == 0.0
    eta = datetime.now(timezone.utc) + timedelta(seconds=30)
    assert 0 < _seconds_until(app, eta) <= 30
    assert 0 < _seconds_until(app, eta.replace(tzinfo=None)) <= 30
    assert _seconds_until(app, eta - timedelta(seconds=60)) == 0.0


def _fence_writes(client: Any, fence_key: str, act: Any) -> list[list[str]]:
    """The commands that touched ``fence_key`` while ``act()`` ran (seen by MONITOR)."""
    seen: list[list[str]] = []
    with client.monitor() as monitor:
        act()
        client.echo("fenced-test-end")  # another connection: MONITOR shows it last
        while True:
            command = str(monitor.next_command()["command"])
            if "fenced-test-end" in command:
                return seen
            words = command.split(" ")
            if fence_key in words[1:2]:
                seen.append(words)


def test_takeover_mints_the_fence_as_acquire_does(redis_server: RedisServer) -> None:
    client = redis.Redis.from_url(redis_server.url)
    watcher = redis.Redis.from_url(redis_server.url, decode_responses=True)
    idle = 600.0
    first = Claim(client, f"z-{key()}", ttl=30, task_id="task-1", heartbeat=False, idle_ttl=idle)
    fence_key = first.keys.fence
    # ACQUIRE's mint: max(fence + 1, TIME in µs), one SET carrying the idle expiry that
    # reads the last fence as it writes the next (GET).
    acquire_writes = _fence_writes(watcher, fence_key, first.acquire)
    assert [w[0] for w in acquire_writes] == ["SET"]
    assert acquire_writes[0][2] == str(first.fence)
    assert acquire_writes[0][3:] == ["PX", str(int(idle * 1000)), "GET"]
    assert first.hand_over(30, "retrying in 1.0s") == "retried"
    retried = Claim(client, first.name, ttl=30, task_id="task-1", heartbeat=False, idle_ttl=idle)
    assert not retried.acquire()
    takeover_writes = _fence_writes(watcher, fence_key, retried.take_over)
    assert retried.held
    # A read, then one write carrying the idle expiry (no INCR, no PEXPIRE after).
    assert [w[0] for w in takeover_writes] == ["GET", "SET"]
    assert takeover_writes[1][2] == str(retried.fence)
    assert takeover_writes[1][3:] == ["PX", str(int(idle * 1000))]
    assert 0 < int(client.pttl(fence_key)) <= idle * 1000


def test_fences_strictly_increase_across_acquire_retry_takeover_and_acquire(
    redis_server: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    name = f"z-{key()}"
    fence_key = ClaimKeys.of(name).fence
    for expired in (False, True):
        fences: list[int] = []
        for task_id in ("task-1", "task-2"):
            first = Claim(client, name, ttl=30, task_id=task_id, heartbeat=False)
            assert first.acquire() and first.fence is not None
            fences.append(first.fence)
            assert first.hand_over(30, "retrying in 0s") == "retried"
            if expired:  # the fence key gone (its idle expiry): the TIME floor holds
                client.delete(fence_key)
            retried = Claim(client, name, ttl=30, task_id=task_id, heartbeat=False)
            assert not retried.acquire() and retried.take_over()
            assert retried.fence is not None
            fences.append(retried.fence)
            assert retried.release(outcome="ok")
            if expired:
                client.delete(fence_key)
        assert fences == sorted(set(fences)), fences
        # The previous fence was at least the server's time: never a small counter.
        assert all(f > 1_000_000_000_000_000 for f in fences)


def test_takeover_of_a_free_name_honours_the_cooldown_a_kept_lease_does_not(
    redis_server: RedisServer,
) -> None:
    client = redis.Redis.from_url(redis_server.url)
    name = f"z-{key()}"

    def claim(task_id: str) -> Claim:
        return Claim(
            client, name, ttl=30, task_id=task_id, heartbeat=False, records=True, cooldown=60
        )

    # A kept lease is taken over: its run began outside any window and held the name.
    first = claim("task-1")
    assert first.acquire()
    assert first.hand_over(30, "retrying in 0s") == "retried"
    retried = claim("task-1")
    assert not retried.acquire() and retried.take_over()
    assert retried.release(outcome="ok")  # the window starts
    # The name is free but ran recently: a takeover skips it as an acquire would.
    late = claim("task-2")
    assert not late.take_over()
    assert not late.held and late.holder is None
    assert late.ran_recently is not None and 0 < late.ran_recently <= 60
    assert late.skips == 1
    skip = records.last(client, name)
    assert skip is not None and skip.outcome == "skipped" and skip.reason == "ran recently"
    assert read_holder(client, name) is None
    # Without a cooldown the free name is taken.
    plain = Claim(client, name, ttl=30, task_id="task-3", heartbeat=False)
    assert plain.take_over() and plain.release()

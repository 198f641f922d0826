"""on_busy="replace": the newest run takes the claim over, and the old one cannot write."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

from _clock import ManualClock
from _wait import wait_for
from fenced import Claim, ClaimLost, events, records
from fenced._guard import POLICIES, RUN, Run, Skip, Skipped, is_skipped
from fenced._lease import HOST, ClaimKeys, Holder
from fenced.aio import Claim as AioClaim
from fenced.testing import RedisServer

REPLACE = POLICIES["replace"]()


def test_a_newer_run_takes_the_claim_over_and_the_old_one_learns_it(
    r: Any, fake_time: ManualClock
) -> None:
    a = Claim(r, "rebuild:roads", ttl=3.0, clock=fake_time, records=True)
    assert a.acquire()
    b = Claim(r, "rebuild:roads", ttl=3.0, clock=fake_time, records=True, task_id="newer (1)")
    assert b.enter(REPLACE) is RUN  # at once: no wait for the holder
    assert a.token is not None and b.token is not None
    a_token, b_token = a.token[:8], b.token[:8]
    assert b.fence is not None and a.fence is not None and b.fence > a.fence
    assert a.held  # it cannot know yet: its next renewal tells it
    fake_time.run(1.5)  # past one refresh interval (ttl / 3)
    assert not a.held and a.lost
    assert a.lost_reason is not None and a.lost_reason.startswith("replaced by ")
    assert b_token in a.lost_reason
    with pytest.raises(ClaimLost, match="replaced by"):
        a.check()
    # Its release is compare-token: the newer run's lease stays, and so does its record.
    assert a.release() is False
    # The cause, in a word, outlives the release; the note names the newer run.
    assert a.lost_cause == "replaced"
    replaced = Skipped.replaced(a)
    assert replaced.holder == Holder(b_token, HOST, os.getpid(), "newer (1)", None, None)
    assert replaced.as_dict()["status"] == "replaced" and replaced.reason == a.lost_reason
    assert not is_skipped(replaced) and not is_skipped(replaced.as_dict())
    assert str(replaced) == f"claim 'rebuild:roads' was {a.lost_reason}"
    assert b.held and b.refresh()
    runs = {run.token: run for run in records.history(r, "rebuild:roads")}
    old, new = runs[a_token], runs[b_token]
    assert old.outcome == "lost" and old.reason is not None
    assert old.reason.startswith(f"replaced by {b_token} (")
    assert new.outcome == "running"
    b.release()
    assert records.last(r, "rebuild:roads").outcome == "ok"


def test_a_dead_holder_is_replaced_at_once_and_its_run_recorded_lost(r: Any) -> None:
    dead = Claim(r, "feeds", ttl=60, heartbeat=False, records=True)  # never renews, never releases
    assert dead.acquire()
    assert dead.token is not None
    dead_token = dead.token[:8]
    b = Claim(r, "feeds", ttl=60, records=True)
    assert b.replace()
    assert b.fence is not None and dead.fence is not None and b.fence > dead.fence
    (old,) = [run for run in records.history(r, "feeds") if run.token == dead_token]
    assert old.outcome == "lost" and "replaced by" in (old.reason or "")
    # The dead run's late renewal is refused, and says why (the "lost" event: its cause).
    seen: list[events.ClaimEvent] = []
    unsubscribe = events.subscribe(seen.append)
    try:
        assert dead.refresh() is False
    finally:
        unsubscribe()
    assert "replaced by" in (dead.lost_reason or "")
    assert [e.reason for e in seen if e.kind == "lost"] == ["replaced"]
    b.release()


def test_a_replaced_run_that_ends_before_any_renewal_learns_it_at_release(r: Any) -> None:
    # No renewal ever runs: only the release can find out that a newer run took over.
    a = Claim(r, "ends-first", ttl=60, heartbeat=False, records=True, task_id="older")
    assert a.acquire()
    assert a.token is not None
    a_token = a.token[:8]
    b = Claim(r, "ends-first", ttl=60, heartbeat=False, records=True, task_id="newer")
    assert b.replace()
    assert b.token is not None
    seen: list[events.ClaimEvent] = []
    unsubscribe = events.subscribe(seen.append)
    try:
        assert a.release() is False  # the newer run's lease stays
    finally:
        unsubscribe()
    assert a.vanished
    assert a.lost_cause == "replaced"
    assert (a.lost_reason or "").startswith(f"replaced by {b.token[:8]} (")
    assert [e.reason for e in seen if e.kind == "lost"] == ["replaced"]
    replaced = Skipped.replaced(a)
    assert replaced.holder is not None and replaced.holder.task_id == "newer"
    (old,) = [run for run in records.history(r, "ends-first") if run.token == a_token]
    assert old.outcome == "lost" and (old.reason or "").startswith("replaced by ")
    # Sent again (its reply lost on the way back), the release gets the same answer and
    # records nothing twice.
    entries = r.llen(a.keys.records)
    again = a._store.release(a._release_call("ok", "{}"))
    assert again == (False, "lost", [], a.lost_reason)
    assert r.llen(a.keys.records) == entries
    assert b.held and b.release()


def test_a_vanished_lease_without_a_replace_note_is_still_vanished(r: Any) -> None:
    a = Claim(r, "gone", ttl=60, heartbeat=False)
    assert a.acquire()
    r.delete(a.key)
    assert a.release() is False
    assert a.lost_cause == "vanished"


def test_a_replaced_celery_run_that_returns_before_any_renewal_ends_replaced(
    server: RedisServer,
) -> None:
    from celery import Celery

    from fenced.celery import ClaimedTask, metrics

    app = Celery("fenced_replaced_before_renewal", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = server.url
    client = server.client()

    @app.task(
        shared=False,
        base=ClaimedTask,
        bind=True,
        claim="ends-early:{x}",
        claim_on_busy="replace",
        claim_ttl=120,  # the first renewal is 40 s away: the body ends long before
    )
    def job(self: ClaimedTask, x: str) -> str:
        newer = Claim(client, f"ends-early:{x}", ttl=60, heartbeat=False, task_id=f"newer-{x}")
        assert newer.replace()
        return "done"

    x = f"{os.getpid()}-{id(app)}"
    replaced_before = metrics["replaced"]
    result = job.apply((x,), task_id=f"older-{x}")
    assert str(result.state) == "SUCCESS", result.traceback
    value = result.get()
    assert value["status"] == "replaced", value
    assert value["reason"].startswith("replaced by ") and f"newer-{x}" in value["reason"]
    assert value["holder"]["task_id"] == f"newer-{x}"
    assert metrics["replaced"] == replaced_before + 1


def test_a_free_name_is_taken_as_acquire_takes_it(r: Any) -> None:
    c = Claim(r, "free", ttl=10, records=True)
    assert c.enter(REPLACE) is RUN
    assert [run.outcome for run in records.history(r, "free")] == ["running"]
    c.release()


def test_replace_with_a_limit_above_one_is_refused(r: Any) -> None:
    from fenced import ConfigError

    c = Claim(r, "slots", ttl=10, limit=2)
    with pytest.raises(ConfigError, match="ambiguous"):
        c.replace()


def test_an_earlier_attempt_of_the_same_task_is_not_replaced(r: Any) -> None:
    first = Claim(r, "task-x", ttl=30, task_id="t-1")
    assert first.acquire()
    again = Claim(r, "task-x", ttl=30, task_id="t-1")
    action = again.enter(REPLACE)
    assert not isinstance(action, Run)
    assert first.held and first.refresh()
    first.release()


def test_asyncio_claims_replace_and_learn_it(server: RedisServer) -> None:
    async def main() -> None:
        client = redis.asyncio.Redis.from_url(server.url)
        try:
            a = AioClaim(client, "aio-replace", ttl=30)
            assert await a.acquire()
            b = AioClaim(client, "aio-replace", ttl=30)
            assert await b.enter(REPLACE) is RUN
            assert await a.refresh() is False
            assert "replaced by" in (a.lost_reason or "")
            assert await a.release() is False
            assert await b.refresh()
            await b.release()
        finally:
            await client.aclose()

    asyncio.run(main())


# -- fenced run --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
FENCED = [sys.executable, "-m", "fenced"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def test_fenced_run_replace_ends_the_running_command_and_runs_the_newer(
    server: RedisServer,
) -> None:
    name = "cron:replace"
    run = [*FENCED, "run", "--redis", server.url, "--ttl", "1.5", "--on-busy", "replace"]
    first = subprocess.Popen(
        [*run, "--grace", "2", name, "--", sys.executable, "-c", "import time; time.sleep(120)"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    client = server.client()
    try:
        lock = ClaimKeys.of(name).lock
        wait_for("the first run to hold the claim", lambda: client.exists(lock), proc=first)
        second = subprocess.run(
            [*run, name, "--", sys.executable, "-c", "print('newest')"],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=60,
        )
        assert second.returncode == 0, second.stderr
        assert "newest" in second.stdout
        _out, err = first.communicate(timeout=60)  # its watchdog ends the command
        assert first.returncode == 76, err
        assert "replaced by" in err, err
        newest, replaced = records.history(client, name)[:2]
        assert newest.outcome == "ok"
        assert replaced.outcome == "lost" and (replaced.reason or "").startswith("replaced by ")
        assert newest.token is not None and newest.token in (replaced.reason or "")
        assert not client.exists(lock)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
        client.close()


def test_a_delivery_of_a_task_id_that_already_ran_ok_replaces_nobody(r: Any) -> None:
    done = Claim(r, "dup", ttl=30, task_id="t-1", redelivery_window=60)
    assert done.acquire()
    done.release()  # ended ok: its done marker is set
    running = Claim(r, "dup", ttl=30, task_id="t-2", redelivery_window=60)
    assert running.acquire()
    again = Claim(r, "dup", ttl=30, task_id="t-1", redelivery_window=60)
    assert not isinstance(again.enter(REPLACE), Run)  # a duplicate: not a newer call
    assert again.completed_before is True
    assert running.refresh()  # untouched
    running.release()
    fresh = Claim(r, "dup", ttl=30, task_id="t-3", redelivery_window=60)
    assert fresh.replace() and fresh.completed_before is False
    fresh.release()


# -- the enqueue marker and call order (issue 43) ---------------------------------------


def test_a_copy_of_a_finished_task_id_is_a_duplicate_while_another_copy_holds_the_name(
    r: Any,
) -> None:
    # Copies of one delivery whose run ended ok (a broker's short visibility timeout hands
    # the message out again): the first takes the free name for as long as it needs to
    # learn it is a duplicate; a copy that arrives meanwhile finds its own task id holding
    # it, and is a duplicate too, not an earlier attempt to wait for (a retry would come
    # back, past the visibility timeout, as more copies).
    def claim(task_id: str) -> Claim:
        return Claim(r, "copies", ttl=30, task_id=task_id, redelivery_window=60)

    first = claim("t-1")
    assert first.acquire()
    first.release()  # ended ok: its done marker is set
    copy = claim("t-1")
    assert copy.replace() and copy.completed_before is True
    for policy in (REPLACE, POLICIES["skip"]()):
        again = claim("t-1")
        action = again.enter(policy)
        assert not isinstance(action, Run), action
        assert again.completed_before is True, policy
        assert again.holder is not None and again.holder.task_id == "t-1"
        assert copy.refresh()  # untouched
    # A lease kept for a retry of the task id is not taken over by such a copy either.
    assert copy.hand_over(30) == "retried"
    kept = r.get(ClaimKeys.of("copies").lock)
    again = claim("t-1")
    assert not isinstance(again.enter(REPLACE), Run)
    assert again.completed_before is True
    assert not again.take_over() and again.completed_before is True
    assert r.get(ClaimKeys.of("copies").lock) == kept
    # Another task id takes a kept lease's name over as ever, and says it did not run.
    newer = claim("t-2")
    assert newer.replace() and newer.completed_before is False
    newer.release()


def test_a_copy_of_a_finished_task_id_is_a_duplicate_inside_its_own_cooldown_window(
    r: Any,
) -> None:
    # The run that ended ok started the window: its copy is told it is a duplicate (its
    # stored result stays), not that the name ran recently (a skipped result stored over it).
    def claim(task_id: str) -> Claim:
        return Claim(r, "cooled", ttl=30, task_id=task_id, redelivery_window=60, cooldown=60)

    first = claim("t-1")
    assert first.acquire()
    first.release()
    copy = claim("t-1")
    assert copy.enter(REPLACE) is RUN and copy.completed_before is True
    copy.release(outcome="skipped")
    retried = claim("t-1")
    assert retried.take_over() and retried.completed_before is True
    retried.release(outcome="skipped")
    other = claim("t-2")
    assert not isinstance(other.enter(REPLACE), Run) and other.ran_recently is not None


def test_replace_and_takeover_clear_the_enqueue_marker_as_acquire_does(r: Any) -> None:
    keys = ClaimKeys.of("marked")
    r.set(keys.queued, "t-1")
    first = Claim(r, "marked", ttl=30, task_id="t-1")
    first.handle_enqueue_marker("-", False)  # until_started: the message left the queue
    assert first.replace()
    assert r.get(keys.queued) is None
    r.set(keys.queued, "t-2")
    second = Claim(r, "marked", ttl=30, task_id="t-2")
    second.handle_enqueue_marker("-", False)
    assert second.replace()  # takes it over, and clears its own call's mark
    assert r.get(keys.queued) is None
    # A marker that holds another task id is left alone.
    r.set(keys.queued, "t-9")
    third = Claim(r, "marked", ttl=30, task_id="t-3")
    third.handle_enqueue_marker("-", False)
    assert third.replace()
    assert r.get(keys.queued) in ("t-9", b"t-9")
    third.release()
    # TAKEOVER, the path of a retry taking its kept lease, handles it too.
    retried = Claim(r, "marked", ttl=30, task_id="t-9")
    retried.handle_enqueue_marker("5000", False)  # until_finished: it covers the run
    assert retried.take_over()
    assert 0 < r.pttl(keys.queued) <= 5000
    retried.release()


def test_a_task_id_a_newer_call_replaced_never_replaces_again(r: Any) -> None:
    older = Claim(r, "order", ttl=30, task_id="call-1", records=True)
    assert older.acquire()
    newer = Claim(r, "order", ttl=30, task_id="call-2", records=True)
    assert newer.replace()
    assert newer.token is not None
    # call 1 again (its retry, its redelivery): refused, the newer run untouched.
    again = Claim(r, "order", ttl=30, task_id="call-1", records=True)
    action = again.enter(REPLACE)
    assert isinstance(action, Skip), action
    assert action.skipped.status == "replaced" and not is_skipped(action.skipped)
    assert again.superseded is not None and again.superseded.startswith("replaced by ")
    assert action.skipped.holder is not None and action.skipped.holder.task_id == "call-2"
    assert not again.held and newer.refresh()
    last = records.history(r, "order")[0]
    assert last.task_id == "call-1" and last.outcome == "skipped"
    assert (last.reason or "").startswith(f"replaced by {newer.token[:8]} ")
    # Nor once the name is free: its newer call ran.
    newer.release()
    assert not Claim(r, "order", ttl=30, task_id="call-1").replace()
    # Nor by the takeover a retry under replace tries next (a free name, a kept lease).
    taking = Claim(r, "order", ttl=30, task_id="call-1")
    taking._replacing = True  # as enter() sets it under replace
    assert not taking.take_over() and taking.superseded == again.superseded
    # A call that was never replaced takes it.
    fresh = Claim(r, "order", ttl=30, task_id="call-3")
    assert fresh.replace()
    fresh.release()


def test_the_replaced_calls_are_bounded_and_expire_with_the_name(r: Any) -> None:
    from fenced._lease import REPLACED_CALLS

    name = "bounded"
    for i in range(REPLACED_CALLS + 5):
        assert Claim(r, name, ttl=30, task_id=f"c-{i}", idle_ttl=60).replace()
    calls = ClaimKeys.of(name).replaced_calls
    assert r.llen(calls) == REPLACED_CALLS
    assert 0 < r.pttl(calls) <= 60_000
    # The newest replaced stay refused; the oldest, forgotten, are not.
    assert not Claim(r, name, ttl=30, task_id=f"c-{REPLACED_CALLS + 3}").replace()
    assert Claim(r, name, ttl=30, task_id="c-0").replace()


def test_a_plain_claim_without_a_task_id_is_replaced_without_remembering_it(r: Any) -> None:
    plain = Claim(r, "anonymous", ttl=30)
    assert plain.acquire()
    assert Claim(r, "anonymous", ttl=30, task_id="t-1").replace()
    assert not r.exists(ClaimKeys.of("anonymous").replaced_calls)

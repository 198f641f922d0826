"""ClaimedTask in a real prefork worker (concurrency 2): the seed's verification steps,
the conflict policies, and claims lost mid-run.

One worker serves the whole module; every test uses fresh claim names. The tests marked
for both brokers also run with RabbitMQ when ``FENCED_TEST_AMQP_URL`` is set.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key, notes
from fenced import ClaimHeld, ClaimLost, records
from fenced._inspect import read_holder
from fenced._lease import ClaimKeys, new_token
from fenced.testing import RedisServer

if TYPE_CHECKING:
    # The channel an amqp:// connection hands out; kombu types it as the base StdChannel.
    from kombu.transport.pyamqp import Channel as AmqpChannel

#: Tests that run with each broker; the others run with the Redis broker only.
BOTH_BROKERS = {
    "test_same_task_enqueued_twice_one_runs_one_skips",
    "test_killed_pool_child_releases_its_claim_and_the_redelivery_completes",
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cel" in metafunc.fixturenames:
        brokers = ["redis", "amqp"] if metafunc.function.__name__ in BOTH_BROKERS else ["redis"]
        metafunc.parametrize("cel", brokers, indirect=True, scope="module")


@dataclass
class Cel:
    """A running worker and the handles a test needs."""

    services: Services
    worker: Worker
    client: Celery
    obs: redis.Redis
    locks: redis.Redis

    def send(self, task: str, *args: Any, **kwargs: Any) -> AsyncResult[Any]:
        """Send a task to the worker's queue."""
        return self.client.send_task(
            task, args=args, kwargs=kwargs, queue=self.services.queue, **kwargs.pop("_opts", {})
        )

    def history(self, name: str) -> list[records.RunRecord]:
        """The claim's run records, newest first."""
        return records.history(self.locks, name, limit=50)


@pytest.fixture(scope="module")
def cel(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[Cel]:
    broker = request.param
    services = Services.on(redis_server, broker)
    client = services.client()
    try:
        with Worker(services, name=f"prefork-{broker}") as worker:
            yield Cel(services, worker, client, services.obs(), services.locks())
    finally:
        if broker == "amqp":
            with client.connection_for_write() as conn:
                cast("AmqpChannel", conn.default_channel).queue_delete(services.queue)
        client.close()


def _signals(cel: Cel, kind: str, task_id: str) -> list[dict[str, Any]]:
    """The signals of one kind the worker sent for a task, once its run has settled."""
    wait_for(f"the end of {task_id}", lambda: _postrun(cel, task_id))
    return [n for n in notes(cel.obs, f"signal:{kind}") if n["task_id"] == task_id]


def _postrun(cel: Cel, task_id: str) -> bool:
    return any(n["task_id"] == task_id for n in notes(cel.obs, "signal:postrun"))


def _open_gate(cel: Cel, k: str, n: int) -> None:
    cel.obs.set(f"gate:{k}:{n}", 1)


def _runs(cel: Cel, k: str) -> list[dict[str, Any]]:
    return notes(cel.obs, f"runs:{k}")


# -- the seed's verification steps ----------------------------------------------------------


def test_same_task_enqueued_twice_one_runs_one_skips(cel: Cel) -> None:
    k = key()
    first = cel.send("t.rebuild", k, "roads", steps=5, step_time=0.4, run=f"{k}-1")
    second = cel.send("t.rebuild", k, "roads", steps=5, step_time=0.4, run=f"{k}-2")
    results = {first.id: first.get(timeout=WAIT), second.id: second.get(timeout=WAIT)}
    ok = [tid for tid, res in results.items() if res["status"] == "ok"]
    skipped = [tid for tid, res in results.items() if res["status"] == "skipped"]
    assert len(ok) == 1 and len(skipped) == 1, results
    skip = results[skipped[0]]
    assert skip["reason"] == "already running"
    assert skip["claim"] == f"rebuild:{k}:roads"
    assert skip["holder"]["task_id"] == ok[0]
    assert 0 < skip["expires_in"] <= cel.services.ttl
    outcomes = {(run.task_id, run.outcome) for run in cel.history(f"rebuild:{k}:roads")}
    assert outcomes == {(ok[0], "ok"), (skipped[0], "skipped")}
    assert not _signals(cel, "failure", skipped[0])
    assert not _signals(cel, "retry", skipped[0])


def test_a_skip_is_recorded_as_a_skip_not_a_failure(cel: Cel) -> None:
    from fenced import Claim

    k = key()
    name = f"rebuild:{k}:roads"
    holder = Claim(cel.locks, name, ttl=30)
    assert holder.acquire()
    try:
        result = cel.send("t.rebuild", k, "roads", run=k)
        skip = result.get(timeout=WAIT)
        assert result.state == "SUCCESS"
        assert skip["status"] == "skipped" and skip["holder"]["pid"] == os.getpid()
        again = cel.send("t.rebuild", k, "roads", run=k).get(timeout=WAIT)
        assert again["skips"] == 2
    finally:
        holder.release()
    last = records.last(cel.locks, name)
    assert last is not None and last.outcome == "skipped" and last.reason == "already running"
    assert last.extra["task"] == "t.rebuild"
    assert last.extra["args"] == {"tenant": k, "layer": "roads"}
    assert records.consecutive_skips(cel.locks, name) == 2
    assert not _signals(cel, "failure", result.id)
    assert not _signals(cel, "retry", result.id)
    # The next successful run resets the count.
    assert cel.send("t.rebuild", k, "roads", steps=1, run=k).get(timeout=WAIT)["status"] == "ok"
    assert records.consecutive_skips(cel.locks, name) == 0


def test_killed_pool_child_releases_its_claim_and_the_redelivery_completes(cel: Cel) -> None:
    # The lease (30 s) is far longer than the test waits: the redelivered message can
    # only run this soon because the main process released the dead child's claim.
    k = key()
    result = cel.send("t.rebuild_long_lease", k, "roads", steps=6, step_time=0.4, run=k)
    first = wait_for("the first step", lambda: notes(cel.obs, f"marks:{k}"))[0]
    os.kill(first["pid"], signal.SIGKILL)
    assert result.get(timeout=25)["status"] == "ok"
    runs = cel.history(f"rebuild:{k}:roads")
    assert [run.outcome for run in runs] == ["ok", "aborted"]
    ok, aborted = runs
    assert aborted.task_id == ok.task_id == result.id
    assert aborted.reason and "died" in aborted.reason
    assert ok.fence is not None and aborted.fence is not None and ok.fence > aborted.fence
    assert not _signals(cel, "retry", result.id)  # it did not wait for the lease
    outputs = [cel.obs.get(f"out:{k}:roads:{i}") for i in range(6)]
    assert outputs == [str(ok.fence)] * 6  # complete, and all from the run that finished
    assert read_holder(cel.locks, f"rebuild:{k}:roads") is None


def test_overrunning_task_aborts_instead_of_writing(cel: Cel) -> None:
    """A pool child paused past its lease: another run takes over; the first aborts."""
    k = key()
    ttl = cel.services.ttl
    paused = cel.send("t.rebuild", k, "roads", steps=10, step_time=1.0, run=f"{k}-old")

    def sleeping() -> dict[str, Any] | None:
        # Both writes of a step are done: the task sleeps until its next check.
        marks = notes(cel.obs, f"marks:{k}-old")
        if marks and cel.obs.exists(f"out:{k}:roads:{marks[-1]['i']}"):
            return marks[-1]
        return None

    pid = wait_for("a step to be written", sleeping)["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        written_before = len(notes(cel.obs, f"marks:{k}-old"))
        wait_for(
            "the paused run's lease to expire",
            lambda: read_holder(cel.locks, f"rebuild:{k}:roads") is None,
            timeout=ttl * 3,
        )
        taker = cel.send("t.rebuild", k, "roads", steps=4, step_time=0.3, run=f"{k}-new")
        wait_for("the new run to start", lambda: notes(cel.obs, f"marks:{k}-new"))
    finally:
        os.kill(pid, signal.SIGCONT)
    with pytest.raises(ClaimLost):
        paused.get(timeout=WAIT)
    assert taker.get(timeout=WAIT)["status"] == "ok"
    assert len(notes(cel.obs, f"marks:{k}-old")) == written_before  # not one more write
    runs = {run.task_id: run for run in cel.history(f"rebuild:{k}:roads")}
    assert runs[paused.id].outcome == "lost"
    assert runs[taker.id].outcome == "ok"
    assert runs[taker.id].fence > runs[paused.id].fence  # type: ignore[operator]
    new_fence = str(runs[taker.id].fence)
    assert all(cel.obs.get(f"out:{k}:roads:{i}") == new_fence for i in range(4))


def test_lost_claim_interrupts_a_task_that_never_checks_and_spares_the_new_holder(
    cel: Cel,
) -> None:
    k = key()
    result = cel.send("t.sleeper", k, 30)
    wait_for("the task to start", lambda: notes(cel.obs, f"sleeper:{k}"))
    lock = ClaimKeys.of(f"sleep:{k}").lock
    intruder = new_token("someone-else")
    cel.locks.set(lock, intruder, px=20_000)  # another holder now has the lease
    with pytest.raises(ClaimLost):
        result.get(timeout=20)  # well before the 30 s sleep would end
    assert [n["event"] for n in notes(cel.obs, f"sleeper:{k}")] == ["start"]
    assert cel.locks.get(lock) == intruder  # the loser's release left it alone
    last = records.history(cel.locks, f"sleep:{k}")[0]
    assert last.outcome == "lost" and last.task_id == result.id


def test_redelivered_task_waits_for_its_earlier_attempts_lease(cel: Cel) -> None:
    k = key()
    task_id = f"redelivered-{k}"
    name = f"rebuild:{k}:roads"
    # An earlier attempt of this task id holds the claim (its process died).
    cel.locks.set(ClaimKeys.of(name).lock, new_token(task_id), px=3000)
    result = cel.client.send_task(
        "t.rebuild",
        args=(k, "roads"),
        kwargs={"steps": 1, "run": k},
        queue=cel.services.queue,
        task_id=task_id,
    )
    assert result.get(timeout=WAIT)["status"] == "ok"
    assert _signals(cel, "retry", task_id)
    assert [run.outcome for run in cel.history(name)] == ["ok"]  # not a skip
    assert records.consecutive_skips(cel.locks, name) == 0


@pytest.mark.parametrize("flagged", [True, False], ids=["retried", "unflagged"])
def test_a_second_delivery_of_a_completed_task_does_not_run_again(cel: Cel, flagged: bool) -> None:
    """Flagged (a retry, a broker's redelivered flag) or not (SQS sets no flag; a publish
    kombu retried, or a caller's own task_id sent twice): the grant says the task id ran."""
    k = key()
    task_id = f"done-{k}"
    name = f"rebuild:{k}:roads"

    def send(**options: Any) -> AsyncResult[Any]:
        return cel.client.send_task(
            "t.rebuild",
            args=(k, "roads"),
            kwargs={"steps": 2, "run": k},
            queue=cel.services.queue,
            task_id=task_id,
            **options,
        )

    first = send().get(timeout=WAIT)
    assert first["status"] == "ok"
    # The same message once more, as a retry or a redelivery arrives, or sent again.
    send(**({"retries": 1} if flagged else {}))
    # Its run record opens as "running" when the claim is taken, then ends as a skip.
    wait_for(
        "the second delivery to end",
        lambda: len(runs := cel.history(name)) == 2 and runs[0].outcome != "running",
    )
    duplicate = cel.history(name)[0]
    assert duplicate.outcome == "skipped" and duplicate.task_id == task_id
    assert duplicate.reason == "duplicate delivery of a completed task"
    assert len(notes(cel.obs, f"marks:{k}")) == 2  # the steps ran once
    assert AsyncResult(task_id, app=cel.client).get(timeout=WAIT) == first  # result kept
    ends = wait_for(
        "both deliveries to end",
        lambda: [n for n in notes(cel.obs, "signal:postrun") if n["task_id"] == task_id][1:],
    )
    assert ends[0]["state"] == "IGNORED"
    assert not _signals(cel, "failure", task_id)
    assert not _signals(cel, "retry", task_id)


def test_a_completed_task_sent_again_does_not_run_inside_its_own_cooldown_window(
    cel: Cel,
) -> None:
    """The window lets a delivery of the task id that started it reach the lease (a
    redelivery is not 'ran recently'); the grant then says that task id ended ok."""
    k = key()
    task_id = f"cooled-{k}"

    def send() -> AsyncResult[Any]:
        return cel.client.send_task(
            "t.cooled", args=(k,), queue=cel.services.queue, task_id=task_id
        )

    assert send().get(timeout=WAIT)["status"] == "ok"
    send()  # unflagged, inside the 60 s window
    name = f"cooled:{k}"
    wait_for(
        "the second delivery to end",
        lambda: len(runs := cel.history(name)) == 2 and runs[0].outcome != "running",
    )
    assert cel.history(name)[0].reason == "duplicate delivery of a completed task"
    assert len(notes(cel.obs, f"runs:{k}")) == 1  # the body ran once


# -- many runs, policies ---------------------------------------------------------------------


def test_two_tenants_overlap_while_one_tenant_and_layer_never_does(cel: Cel) -> None:
    k = key()
    tenants = [f"{k}-a", f"{k}-b"]
    sent = [
        cel.send("t.rebuild", tenant, "roads", steps=5, step_time=0.3, run=f"{k}-{i}")
        for i in range(3)
        for tenant in tenants
    ]
    results = [r.get(timeout=WAIT) for r in sent]
    assert {r["status"] for r in results} <= {"ok", "skipped"}
    spans = [n for n in notes(cel.obs, "spans") if n["tenant"] in tenants]
    assert len(spans) == sum(r["status"] == "ok" for r in results)

    def overlap(a: dict[str, Any], b: dict[str, Any]) -> bool:
        return bool(a["start"] < b["end"] and b["start"] < a["end"])

    pairs = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1 :]]
    assert not [p for p in pairs if p[0]["tenant"] == p[1]["tenant"] and overlap(*p)]
    assert [p for p in pairs if p[0]["tenant"] != p[1]["tenant"] and overlap(*p)]


def test_rerun_policy_coalesces_triggers_into_one_more_run(cel: Cel) -> None:
    k = key()
    cel.send("t.rerun", k)
    wait_for("the first run", lambda: len(_runs(cel, k)) == 1)
    triggers = [cel.send("t.rerun", k) for _ in range(10)]
    for t in triggers:
        res = t.get(timeout=WAIT)
        assert res["status"] == "skipped"
        assert res["reason"] == "already running; rerun requested"
    _open_gate(cel, k, 0)
    wait_for("the rerun", lambda: len(_runs(cel, k)) == 2)
    # A trigger that arrives after the rerun started asks for one more.
    assert cel.send("t.rerun", k).get(timeout=WAIT)["status"] == "skipped"
    _open_gate(cel, k, 1)
    wait_for("the second rerun", lambda: len(_runs(cel, k)) == 3)
    _open_gate(cel, k, 2)
    wait_for("the last run to end", lambda: len(notes(cel.obs, f"ends:{k}")) == 3)
    _open_gate(cel, k, 3)  # should a fourth run start, it would finish and be counted
    time.sleep(1.5)
    assert len(_runs(cel, k)) == 3
    assert read_holder(cel.locks, f"gated:{k}") is None


def test_replace_policy_stops_the_running_task_and_refuses_its_late_write(cel: Cel) -> None:
    from fenced.store import RedisPointer

    k = key()
    old = cel.send("t.replace", k)
    wait_for("the first run to publish", lambda: len(notes(cel.obs, f"published:{k}")) == 1)
    new = cel.send("t.replace", k)  # takes the claim over at once
    wait_for("the newer run to publish", lambda: len(notes(cel.obs, f"published:{k}")) == 2)
    # Interrupted at its next renewal: intended, so a result, not a failure.
    stopped = old.get(timeout=WAIT)
    assert stopped["status"] == "replaced" and stopped["claim"] == f"replace:{k}", stopped
    assert stopped["reason"].startswith("replaced by ") and new.id in stopped["reason"]
    assert stopped["holder"]["task_id"] == new.id and stopped["holder"]["fence"] is None
    assert old.state == "SUCCESS"
    assert not _signals(cel, "failure", old.id)
    # One line says so, naming the newer run; no error, no traceback.
    log = cel.worker.log()
    since = log[log.index(f"t.replace[{old.id}] received") :]  # this test's part of the log
    said = [line for line in since.splitlines() if old.id in line]
    ended = [line for line in said if "ended as replaced" in line]
    assert len(ended) == 1 and "INFO" in ended[0] and f"task {new.id})" in ended[0], said
    assert not [line for line in said if "ERROR" in line or "raised" in line], said
    assert "Traceback" not in since, since
    late = [(n["n"], n["refused"]) for n in notes(cel.obs, f"late:{k}")]
    assert late == [(0, True)]  # its write after the takeover: refused as stale
    _open_gate(cel, k, 1)
    assert new.get(timeout=WAIT)["status"] == "ok"
    runs = {run.task_id: run for run in cel.history(f"replace:{k}")}
    assert runs[old.id].outcome == "lost", runs[old.id]
    assert (runs[old.id].reason or "").startswith("replaced by "), runs[old.id]
    assert runs[new.id].outcome == "ok"
    assert runs[new.id].fence > runs[old.id].fence  # type: ignore[operator]
    published = RedisPointer(cel.locks, f"replace:{k}").read()
    assert published is not None and published.target == "run-1"


def test_a_completed_task_sent_again_while_its_name_is_held_is_ignored(cel: Cel) -> None:
    """Busy or not, a delivery of a task id that ran to the end is a duplicate: no skip
    result over the stored one, no rerun asked of the holder."""
    k = key()
    task_id = f"done-busy-{k}"
    _open_gate(cel, k, 0)
    first = cel.send("t.rerun", k, _opts={"task_id": task_id}).get(timeout=WAIT)
    assert first["status"] == "ok"
    holder = cel.send("t.rerun", k)
    wait_for("the holder's run", lambda: len(_runs(cel, k)) == 2)
    cel.send("t.rerun", k, _opts={"task_id": task_id})  # unflagged, while held
    ends = wait_for(
        "the duplicate to end",
        lambda: [n for n in notes(cel.obs, "signal:postrun") if n["task_id"] == task_id][1:],
    )
    assert ends[0]["state"] == "IGNORED"
    assert AsyncResult(task_id, app=cel.client).get(timeout=WAIT) == first  # result kept
    assert not cel.locks.scard(ClaimKeys("fenced", f"gated:{k}").rerun)  # no rerun asked
    assert records.consecutive_skips(cel.locks, f"gated:{k}") == 0
    _open_gate(cel, k, 1)
    assert holder.get(timeout=WAIT)["status"] == "ok"


def test_rerun_policy_runs_each_distinct_skipped_call_once(cel: Cel) -> None:
    # The claim (per key) is coarser than the arguments (key, layer): a trigger for
    # another layer must not be answered by a rerun of the holder's layer.
    k = key()
    cel.send("t.rerun_layers", k, "roads")
    wait_for("the first run", lambda: len(_runs(cel, k)) == 1)
    for layer in ("rivers", "rivers", "rails", "roads", "rivers"):
        assert cel.send("t.rerun_layers", k, layer).get(timeout=WAIT)["status"] == "skipped"

    def started(count: int) -> Callable[[], bool]:
        return lambda: len(_runs(cel, k)) >= count

    for n in range(4):
        _open_gate(cel, k, n)
        wait_for(f"run {min(n + 2, 4)}", started(min(n + 2, 4)))
    wait_for("the last run to end", lambda: len(notes(cel.obs, f"ends:{k}")) == 4)
    _open_gate(cel, k, 4)  # should a fifth run start, it would finish and be counted
    time.sleep(1.5)
    layers = [run["layer"] for run in _runs(cel, k)]
    assert layers[0] == "roads"
    assert sorted(layers[1:]) == ["rails", "rivers", "roads"]


def test_retry_policy_retries_after_the_holders_lease(cel: Cel) -> None:
    k = key()
    holder = cel.send("t.retry", k)
    wait_for("the holder", lambda: len(_runs(cel, k)) == 1)
    waiter = cel.send("t.retry", k)
    wait_for("the waiter to retry", lambda: _signals(cel, "retry", waiter.id))
    _open_gate(cel, k, 0)
    assert holder.get(timeout=WAIT) == {"status": "ok", "run": 0}
    _open_gate(cel, k, 1)
    assert waiter.get(timeout=WAIT) == {"status": "ok", "run": 1}
    assert [r["task_id"] for r in _runs(cel, k)] == [holder.id, waiter.id]
    assert "ClaimHeld" in _signals(cel, "retry", waiter.id)[0]["reason"]


def test_raise_policy_fails_with_claim_held(cel: Cel) -> None:
    from fenced import Claim

    k = key()
    holder = Claim(cel.locks, f"gated:{k}", ttl=30)
    assert holder.acquire()
    try:
        result = cel.send("t.raise", k)
        with pytest.raises(ClaimHeld) as info:
            result.get(timeout=WAIT)
    finally:
        holder.release()
    assert f"gated:{k}" in str(info.value)
    assert _signals(cel, "failure", result.id)


def test_consecutive_skips_alert_by_signal_and_callback(cel: Cel) -> None:
    k = key()
    holder = cel.send("t.alert", k)
    wait_for("the holder", lambda: len(_runs(cel, k)) == 1)
    skips = [cel.send("t.alert", k).get(timeout=WAIT)["skips"] for _ in range(5)]
    assert skips == [1, 2, 3, 4, 5]
    name = f"gated:{k}"
    alerts = [n for n in notes(cel.obs, "signal:skips_exceeded") if n["name"] == name]
    assert [a["skips"] for a in alerts] == [2, 4]  # at the threshold and each multiple
    assert {a["holder"] for a in alerts} == {holder.id}
    calls = [n for n in notes(cel.obs, "callback:skips_exceeded") if n["name"] == name]
    assert [c["skips"] for c in calls] == [2, 4] and calls[0]["task"] == "t.alert"
    _open_gate(cel, k, 0)
    assert holder.get(timeout=WAIT)["status"] == "ok"
    assert records.consecutive_skips(cel.locks, name) == 0


def test_soft_time_limit_releases_the_claim(cel: Cel) -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    k = key()
    result = cel.send("t.soft", k)
    with pytest.raises(SoftTimeLimitExceeded):
        result.get(timeout=WAIT)
    assert read_holder(cel.locks, f"soft:{k}") is None
    last = records.last(cel.locks, f"soft:{k}")
    assert last is not None and last.outcome == "failed"
    assert last.reason == "soft time limit exceeded"


# -- groups and chords ----------------------------------------------------------------------


def _rebuilds(cel: Cel, k: str, layers: list[str]) -> list[Any]:
    return [
        cel.client.signature(
            "t.rebuild",
            args=(k, layer),
            kwargs={"steps": 1, "step_time": 0.05, "run": k},
            queue=cel.services.queue,
        )
        for layer in layers
    ]


def test_a_chord_body_receives_a_skipped_members_result_and_can_filter_it(cel: Cel) -> None:
    from celery import chord

    from fenced import Claim

    k = key()
    layers = ["roads", "rivers", "rails"]
    holder = Claim(cel.locks, f"rebuild:{k}:roads", ttl=30)
    assert holder.acquire()
    try:
        body = cel.client.signature("t.collect", queue=cel.services.queue)
        out = chord(_rebuilds(cel, k, layers))(body).get(timeout=WAIT)
    finally:
        holder.release()
    # The body runs (a skip is a result, not a failure), with the skip in its place.
    results = out["results"]
    assert len(results) == 3
    assert results[0]["status"] == "skipped" and results[0]["claim"] == f"rebuild:{k}:roads"
    assert results[0]["holder"]["pid"] == os.getpid()
    assert out["skipped"] == [f"rebuild:{k}:roads"]
    assert [r["layer"] for r in out["ran"]] == ["rivers", "rails"]
    assert all(r["status"] == "ok" for r in out["ran"])


def test_a_groups_results_carry_a_skipped_members_result(cel: Cel) -> None:
    from celery import group

    from fenced import Claim, is_skipped

    k = key()
    holder = Claim(cel.locks, f"rebuild:{k}:rivers", ttl=30)
    assert holder.acquire()
    try:
        results = group(_rebuilds(cel, k, ["roads", "rivers"]))().get(timeout=WAIT)
    finally:
        holder.release()
    assert [is_skipped(r) for r in results] == [False, True]
    assert results[0]["status"] == "ok" and results[1]["claim"] == f"rebuild:{k}:rivers"

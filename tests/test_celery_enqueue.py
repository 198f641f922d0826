"""Deduplication at enqueue (``claim_enqueue``) with real brokers and real workers.

The sending side runs here (tests/celery_enqueue_app.py's ``make_app``); the runs happen
in a ``celery worker`` running the same module. The broker's queue is a Redis list, so
its length (LLEN) is how many messages were published and not yet taken.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from celery import Celery

from _wait import wait_for
from celery_enqueue_app import make_app
from celery_harness import WAIT, Services, Worker, key
from fenced import ConfigError
from fenced.celery import ClaimedTask, metrics
from fenced.testing import RedisServer

APP = "tests.celery_enqueue_app"


def sender(services: Services) -> Celery:
    """The app a test sends from: the tasks of the worker's module, on its servers."""
    return services.sender(make_app)


def queued(services: Services) -> int:
    """Messages waiting in the test's queue."""
    return services.queued()


def marker(services: Services, k: str) -> str | None:
    """The task id the name ``hold:<k>`` is marked with, or None."""
    value = services.locks().get(f"fenced:{{hold:{k}}}:queued")
    return None if value is None else str(value)


def runs(services: Services, k: str) -> list[dict[str, Any]]:
    """The runs of ``hold:<k>`` that started, oldest first."""
    return [json.loads(x) for x in services.obs().lrange(f"runs:{k}", 0, -1)]


def go(services: Services, k: str) -> None:
    """Let the runs of ``hold:<k>`` end."""
    services.obs().set(f"go:{k}", 1)


@pytest.fixture
def services(redis_server: RedisServer) -> Services:
    """The module's server, a fresh queue."""
    return Services.on(redis_server)


# -- options -------------------------------------------------------------------------------


def test_an_unknown_mode_fails_when_the_task_is_made_naming_the_modes() -> None:
    app = Celery("enqueue_config", set_as_current=False, broker="memory://")
    app.finalize()  # tasks are built (and checked) as they are defined
    with pytest.raises(ConfigError, match=r"until_started.*until_finished"):

        @app.task(base=ClaimedTask, claim="x:{a}", claim_enqueue="until_executed", shared=False)
        def bad(a: int) -> None: ...

    with pytest.raises(ConfigError, match="claim_enqueue_ttl=0"):

        @app.task(base=ClaimedTask, claim="x:{a}", claim_enqueue_ttl=0, shared=False)
        def bad_ttl(a: int) -> None: ...


def test_the_setting_gives_the_mode_and_a_bad_setting_fails_at_bind() -> None:
    app = Celery("enqueue_setting", set_as_current=False, broker="memory://")
    app.conf.fenced_claim_enqueue = "until_finished"
    app.finalize()

    @app.task(base=ClaimedTask, claim="x:{a}", shared=False)
    def job(a: int) -> None: ...

    assert job._options().enqueue == "until_finished"
    assert job._options().enqueue_ttl == 3600.0
    other = Celery("enqueue_bad_setting", set_as_current=False, broker="memory://")
    other.conf.fenced_claim_enqueue = "yes"
    with pytest.raises(ConfigError, match="claim_enqueue='yes'"):
        other.finalize()  # binds the shared tasks other tests made, if any

        @other.task(base=ClaimedTask, claim="x:{a}", shared=False)
        def job2(a: int) -> None: ...


# -- at enqueue, no worker -------------------------------------------------------------------


def test_a_queued_name_publishes_nothing_and_returns_the_queued_task_id(
    services: Services,
) -> None:
    app = sender(services)
    task = app.tasks["e.finished"]
    k = key()
    before = metrics["enqueue_skipped"]
    first = task.delay(k)
    again = [task.delay(k), task.apply_async((k,)), task.apply_async(kwargs={"key": k})]
    assert [r.id for r in again] == [first.id] * 3
    assert queued(services) == 1
    assert marker(services, k) == first.id
    assert metrics["enqueue_skipped"] - before == 3


def test_the_marker_never_blocks_another_name(services: Services) -> None:
    app = sender(services)
    task = app.tasks["e.finished"]
    a, b = key(), key()
    ra, rb = task.delay(a), task.delay(b)
    assert ra.id != rb.id
    assert queued(services) == 2
    assert (marker(services, a), marker(services, b)) == (ra.id, rb.id)


def test_signatures_go_through_the_marker(services: Services) -> None:
    app = sender(services)
    task = app.tasks["e.finished"]
    k = key()
    first = task.s(k).delay()
    assert task.s(k).apply_async().id == first.id
    assert task.s(key=k).delay().id == first.id
    assert queued(services) == 1


def test_concurrent_calls_publish_one_message(services: Services) -> None:
    app = sender(services)
    task = app.tasks["e.finished"]
    k = key()
    barrier = threading.Barrier(8)
    ids: list[str] = []

    def call() -> None:
        barrier.wait()
        ids.append(task.delay(k).id)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # And from other processes, each with its own app and connections.
    children = []
    for _ in range(2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                child = sender(services)
                code = 0 if child.tasks["e.finished"].delay(k).id == ids[0] else 3
            finally:
                os._exit(code)
        children.append(pid)
    assert [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children] == [0, 0]
    assert len(ids) == 8 and len(set(ids)) == 1
    assert queued(services) == 1


def test_countdown_and_eta_keep_the_marker_until_the_message_is_due(
    services: Services,
) -> None:
    app = sender(services)
    task = app.tasks["e.short"]  # claim_enqueue_ttl=1
    locks = services.locks()
    a, b = key(), key()
    first = task.apply_async((a,), countdown=30)
    ttl_a = locks.pttl(f"fenced:{{hold:{a}}}:queued")
    assert 29_000 < ttl_a <= 31_000
    eta = datetime.now(timezone.utc) + timedelta(seconds=40)
    second = task.apply_async((b,), eta=eta)
    ttl_b = locks.pttl(f"fenced:{{hold:{b}}}:queued")
    assert 39_000 < ttl_b <= 41_000
    assert task.delay(a).id == first.id and task.delay(b).id == second.id
    assert queued(services) == 2


def test_a_lost_message_unblocks_its_name_when_the_marker_expires(services: Services) -> None:
    app = sender(services)
    task = app.tasks["e.short"]  # claim_enqueue_ttl=1
    k = key()
    lost = task.delay(k)
    redis.Redis.from_url(services.broker_url).delete(services.queue)  # the message is gone
    assert task.delay(k).id == lost.id  # still marked: nothing sent
    assert queued(services) == 0
    wait_for("the marker to expire", lambda: marker(services, k) is None)
    fresh = task.delay(k)
    assert fresh.id != lost.id
    assert queued(services) == 1


def cli(services: Services, *args: str) -> subprocess.CompletedProcess[str]:
    """The fenced command on the test's claims Redis."""
    env = dict(os.environ, FENCED_REDIS_URL=services.lock_url)
    return subprocess.run(
        [sys.executable, "-m", "fenced.cli", *args], capture_output=True, text=True, env=env,
        timeout=60,
    )  # fmt: skip


def test_a_purged_queue_blocks_its_names_until_fenced_unqueue_clears_them(
    services: Services,
) -> None:
    app = sender(services)
    task = app.tasks["e.finished"]
    a, b, c = key(), key(), key()
    lost = {k: task.delay(k).id for k in (a, b)}
    assert app.control.purge() == 2  # celery purge: both messages are gone, not their marks
    assert task.delay(a).id == lost[a] and queued(services) == 0  # blocked: nothing sent

    listed = {i["name"]: i for i in json.loads(cli(services, "ls", "--json").stdout)}
    for k in (a, b):
        mark = listed[f"hold:{k}"]
        assert mark["holder"] is None
        assert mark["queued"]["task_id"] == lost[k]
        assert 3000 < mark["queued"]["expires_in"] <= 3600  # claim_enqueue_ttl: an hour
    table = cli(services, "ls").stdout
    assert f"queued: task {lost[a][:8]}" in table, table
    shown = json.loads(cli(services, "show", f"hold:{a}", "--json").stdout)
    assert shown["queued"]["task_id"] == lost[a]
    title = " ".join(cli(services, "show", f"hold:{a}", "--wide").stdout.split())
    assert f"not held; queued: task {lost[a]} (marked 59m" in title, title

    one = cli(services, "unqueue", f"hold:{a}", f"hold:{c}", "--reason", "purged")
    assert one.returncode == 0, one.stderr
    assert f"cleared the enqueue marker of 'hold:{a}' (task {lost[a]})" in one.stdout
    assert f"'hold:{c}' had no enqueue marker" in one.stdout
    assert "enqueue marker of 'hold:" in one.stderr and "reason: purged" in one.stderr  # audit
    fresh = task.delay(a)
    assert fresh.id != lost[a] and queued(services) == 1  # a publishes again
    assert task.delay(b).id == lost[b]  # b is still blocked

    every = json.loads(cli(services, "unqueue", "--all", "--json").stdout)
    # every marker of the namespace (the module's other tests leave theirs too)
    assert {(f"hold:{a}", fresh.id), (f"hold:{b}", lost[b])} <= {
        (r["name"], r["task_id"]) for r in every
    }
    assert not cli(services, "unqueue", "--all", "--json").stdout.strip("[]\n")
    assert task.delay(b).id != lost[b] and queued(services) == 2
    gone = json.loads(cli(services, "show", f"hold:{c}", "--json").stdout)
    assert gone["queued"] is None


def test_fenced_unqueue_refuses_bad_input_and_leaves_foreign_keys_alone(
    services: Services,
) -> None:
    for args in ((), ("hold:x", "--all")):
        res = cli(services, "unqueue", *args)
        assert res.returncode == 2, res
        assert "--all" in res.stderr, res.stderr
    app = sender(services)
    marked = app.tasks["e.finished"].delay(k := key()).id
    foreign = f"fenced:{{hold:{key()}}}:queued"
    services.locks().hset(foreign, "not", "ours")
    undecodable = b"fenced:{hold:\xff}:queued"  # a name that cannot be named back
    redis.Redis.from_url(services.lock_url).set(undecodable, "t-x")
    res = cli(services, "unqueue", "--all", "--json")
    assert res.returncode == 1, res
    assert "is a hash, not fenced's enqueue marker: left alone" in res.stderr, res.stderr
    assert services.locks().hgetall(foreign) == {"not": "ours"}
    cleared = [r for r in json.loads(res.stdout) if "error" not in r]
    assert {"name": f"hold:{k}", "task_id": marked} in cleared  # the others went on
    assert all(r["task_id"] is not None for r in cleared)  # none claims a marker it missed
    assert redis.Redis.from_url(services.lock_url).get(undecodable) == b"t-x"
    # ls and show name the foreign key instead of failing
    listed = {i["name"]: i for i in json.loads(cli(services, "ls", "--json").stdout)}
    assert "WRONGTYPE" in listed[foreign.split(":{")[1].split("}:")[0]]["unreadable"]
    services.locks().delete(foreign)
    redis.Redis.from_url(services.lock_url).delete(undecodable)


def test_a_failed_publish_leaves_no_marker(services: Services) -> None:
    with RedisServer() as broker:
        app = make_app(broker.url, None, services.lock_url, services.obs_url, services.queue)
        task = app.tasks["e.finished"]
        k = key()
        task.delay(k)  # connected, the broker works
        assert marker(services, k) is not None
        services.locks().delete(f"fenced:{{hold:{k}}}:queued")
        broker.stop()
        with pytest.raises(Exception) as caught:
            task.apply_async((k,), retry=False)
        assert not isinstance(caught.value, ConfigError)
        assert marker(services, k) is None


# -- with a worker ---------------------------------------------------------------------------


def test_until_finished_holds_while_the_run_runs_until_started_does_not(
    services: Services,
) -> None:
    app = sender(services)
    finished, started = app.tasks["e.finished"], app.tasks["e.started"]
    f, s = key(), key()
    with Worker(services, concurrency=1, app=APP):
        first = finished.delay(f)
        wait_for("the run to start", lambda: runs(services, f))
        during = finished.delay(f)
        assert during.id == first.id  # running: still marked
        assert marker(services, f) == first.id
        go(services, f)
        assert first.get(timeout=WAIT) == first.id
        assert marker(services, f) is None  # cleared before the result was stored
        after = finished.delay(f)
        assert after.id != first.id
        assert after.get(timeout=WAIT) == after.id
        assert [run["task_id"] for run in runs(services, f)] == [first.id, after.id]

        one = started.delay(s)
        wait_for("the run to start", lambda: runs(services, s))
        assert marker(services, s) is None  # cleared as the run started
        two = started.delay(s)
        assert two.id != one.id and queued(services) == 1
        assert started.delay(s).id == two.id  # the second is queued: marked
        go(services, s)
        assert one.get(timeout=WAIT) == one.id
        assert two.get(timeout=WAIT) == two.id
        assert [run["task_id"] for run in runs(services, s)] == [one.id, two.id]


def test_a_killed_pool_child_leaves_its_name_blocked_only_until_the_redelivered_run_ends(
    services: Services,
) -> None:
    app = sender(services)
    task = app.tasks["e.finished"]
    k = key()
    with Worker(services, concurrency=1, app=APP):
        first = task.delay(k)
        doomed = wait_for("the run to start", lambda: runs(services, k))[0]
        os.kill(doomed["pid"], signal.SIGKILL)
        # reject_on_worker_lost: the message goes back to the queue and runs again.
        again = wait_for("the redelivered run", lambda: runs(services, k)[1:])[0]
        assert again["task_id"] == first.id and again["pid"] != doomed["pid"]
        assert task.delay(k).id == first.id  # its message runs: still marked
        go(services, k)
        assert first.get(timeout=WAIT) == first.id
        assert marker(services, k) is None
        after = task.delay(k)
        assert after.id != first.id
        assert after.get(timeout=WAIT) == after.id


def test_a_killed_pool_child_without_acks_late_unblocks_its_name_at_once(
    services: Services,
) -> None:
    app = sender(services)
    task = app.tasks["e.early"]  # acknowledged as it starts: never delivered again
    k = key()
    with Worker(services, concurrency=1, app=APP):
        first = task.delay(k)
        doomed = wait_for("the run to start", lambda: runs(services, k))[0]
        os.kill(doomed["pid"], signal.SIGKILL)
        with pytest.raises(Exception) as lost:
            first.get(timeout=WAIT)
        assert type(lost.value).__name__ == "WorkerLostError"
        # The worker's main process freed the claim and the marker with it.
        assert marker(services, k) is None
        go(services, k)
        after = task.delay(k)
        assert after.id != first.id
        assert after.get(timeout=WAIT) == after.id
        assert [run["task_id"] for run in runs(services, k)] == [first.id, after.id]


def test_a_canvas_part_is_sent_while_its_name_is_queued(services: Services) -> None:
    """A group or chord member, a chain step and a call with a callback wait for their own
    task ids: they are published although the name is queued; the claim guards the runs."""
    from celery import chain, chord, group

    app = sender(services)
    finished, collect = app.tasks["e.finished"], app.tasks["e.collect"]
    k, other = key(), key()
    go(services, k)
    go(services, other)
    first = finished.delay(k)  # no worker yet: queued, and the name marked
    in_chord = chord([finished.s(k), finished.s(other)])(collect.s())
    in_group = group([finished.s(k)]).apply_async()
    in_chain = chain(finished.si(k), finished.si(other)).apply_async()
    linked = finished.apply_async((k,), link=collect.s())
    assert marker(services, k) == first.id  # the queued message keeps the name's marker
    assert queued(services) == 6  # the first, then 2 + 1 + 1 + 1 of the canvases
    with Worker(services, concurrency=1, app=APP):
        assert first.get(timeout=WAIT) == first.id
        done = in_chord.get(timeout=WAIT)
        assert len(done) == 2 and first.id not in done
        assert in_group.get(timeout=WAIT)[0] != first.id
        assert in_chain.get(timeout=WAIT) == in_chain.id
        assert linked.get(timeout=WAIT) == linked.id
    # Each ran as itself, one at a time under the claim: no canvas waited on a dropped id.
    ran = [run["task_id"] for run in runs(services, k)]
    assert len(ran) == len(set(ran)) == 5


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_run_revoked_with_terminate_frees_its_lease_and_its_name_at_once(
    services: Services, sig: str
) -> None:
    from fenced import read_holder

    app = sender(services)
    task = app.tasks["e.finished"]
    k = key()
    with Worker(services, concurrency=1, app=APP):
        first = task.delay(k)
        wait_for("the run to start", lambda: runs(services, k))
        assert read_holder(services.locks(), f"hold:{k}") is not None
        app.control.revoke(first.id, terminate=True, signal=sig)
        # The worker's main process frees the dead child's lease, then the marker: no
        # wait for the lease's ttl, nor for claim_enqueue_ttl (an hour).
        wait_for("the marker to clear", lambda: marker(services, k) is None, timeout=30)
        assert read_holder(services.locks(), f"hold:{k}") is None
        after = task.delay(k)
        assert after.id != first.id
        go(services, k)
        assert after.get(timeout=WAIT) == after.id
        assert [run["task_id"] for run in runs(services, k)] == [first.id, after.id]


def test_a_retry_under_another_name_moves_the_marker(services: Services) -> None:
    app = sender(services)
    task = app.tasks["e.moving"]
    a, b = key(), key()
    go(services, a)
    with Worker(services, concurrency=1, app=APP):
        result = task.delay(a, b)  # retries as e.moving(b): the claim of hold:<b>
        retried = wait_for("the retried run", lambda: runs(services, b))[0]
        assert retried["task_id"] == result.id
        assert marker(services, a) is None  # the first name is free again
        assert marker(services, b) == result.id
        assert task.delay(b).id == result.id  # the retried message holds its new name
        fresh = task.delay(a)
        assert fresh.id != result.id
        go(services, b)
        assert result.get(timeout=WAIT) == result.id
        assert fresh.get(timeout=WAIT) == fresh.id
        assert marker(services, b) is None and marker(services, a) is None


def test_a_retry_is_sent_while_its_own_message_holds_the_marker(services: Services) -> None:
    app = sender(services)
    task = app.tasks["e.retrying"]
    k = key()
    go(services, k)
    with Worker(services, concurrency=1, app=APP):
        result = task.delay(k)
        assert result.get(timeout=WAIT) == 1
        assert [run["task_id"] for run in runs(services, k)] == [result.id] * 2
        wait_for("the marker to clear", lambda: marker(services, k) is None)


def test_send_task_bypasses_the_marker_and_the_claim_still_guards_the_run(
    services: Services,
) -> None:
    app = sender(services)
    task = app.tasks["e.rerun"]
    k = key()
    with Worker(services, concurrency=2, app=APP):
        first = task.delay(k)
        wait_for("the run to start", lambda: runs(services, k))
        bypass = app.send_task("e.rerun", (k,))  # not deduplicated: the claim skips it
        assert bypass.get(timeout=WAIT)["status"] == "skipped"
        assert task.delay(k).id == first.id
        go(services, k)
        assert first.get(timeout=WAIT) == first.id
        # The rerun the skipped call asked for is sent from the run itself, which holds
        # the marker: the marker passes to the rerun's message.
        rerun = wait_for("the rerun", lambda: runs(services, k)[1:])[0]
        assert rerun["task_id"] not in (first.id, bypass.id)
        wait_for("the marker to clear", lambda: marker(services, k) is None)


def test_beat_sends_through_the_marker(services: Services) -> None:
    from celery.beat import ScheduleEntry, Scheduler
    from celery.schedules import schedule

    app = sender(services)
    k = key()
    beat = Scheduler(app, lazy=True)
    entry = ScheduleEntry(
        name=f"refresh-{k}",
        task="e.finished",
        schedule=schedule(timedelta(seconds=60)),
        args=(k,),
        app=app,
    )
    first = beat.apply_async(entry, advance=False)
    assert beat.apply_async(entry, advance=False).id == first.id
    assert queued(services) == 1


def test_an_unreachable_claims_redis_sends_unmarked(services: Services) -> None:
    with RedisServer() as gone:
        lock_url = gone.url
    app = make_app(services.broker_url, None, lock_url, services.obs_url, services.queue)
    task = app.tasks["e.finished"]
    k = key()
    first, second = task.delay(k), task.delay(k)
    assert first.id != second.id  # the claim keeps the second run out instead
    assert queued(services) == 2


@pytest.mark.parametrize("seed", ["not UTF-8", "a hash"])
def test_a_marker_fenced_never_writes_sends_unmarked_naming_its_key(
    seed: str, services: Services, caplog: pytest.LogCaptureFixture
) -> None:
    app = sender(services)
    task = app.tasks["e.finished"]
    k = key()
    marker_key = f"fenced:{{hold:{k}}}:queued"
    locks = redis.Redis.from_url(services.lock_url)
    if seed == "a hash":
        locks.hset(marker_key, "a", "b")
    else:
        locks.set(marker_key, b"\xff\xfe")
    with caplog.at_level("WARNING", logger="fenced"):
        task.delay(k)
    assert queued(services) == 1  # the claim still keeps a second run out
    assert f"DEL {marker_key}" in caplog.text
    locks.close()


def test_the_marker_sits_in_the_names_cluster_slot(cluster_server: RedisServer) -> None:
    from redis.cluster import RedisCluster
    from redis.crc import key_slot

    from fenced._lease import ClaimKeys
    from fenced.celery import _enqueue

    keys = ClaimKeys.of("feed:acme")
    assert key_slot(keys.queued.encode()) == key_slot(keys.lock.encode())
    client = RedisCluster(host="127.0.0.1", port=cluster_server.port, decode_responses=True)
    try:
        assert _enqueue.mark(client, keys, "t1", 60_000, None) is None
        assert _enqueue.mark(client, keys, "t2", 60_000, None) == "t1"
        assert not _enqueue.clear(client, keys, "t2")  # not its marker
        assert _enqueue.clear(client, keys, "t1")
        assert _enqueue.mark(client, keys, "t2", 60_000, None) is None
    finally:
        client.close()


@pytest.mark.parametrize("mode", ["until_started", "until_finished"])
def test_a_run_handles_its_marker_in_its_acquire_and_release(
    redis_server: RedisServer, mode: str
) -> None:
    # The marker is the lease scripts' business: a run makes two round trips for its
    # claim and its marker together, not one more for the marker at each end.
    app = Celery(f"fenced_enqueue_{mode}", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = redis_server.url
    locks = redis_server.client()
    seen: list[tuple[Any, int]] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="q:{x}", claim_enqueue=mode)
    def job(self: ClaimedTask, x: str) -> str:
        marked = f"fenced:{{q:{x}}}:queued"
        seen.append((locks.get(marked), locks.pttl(marked)))
        return "done"

    def scripts() -> int:
        return int(locks.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))

    x = key()
    marked = f"fenced:{{q:{x}}}:queued"
    locks.set(marked, "the-run", px=5_000)  # as apply_async marks it
    locks.set(f"fenced:{{q:{x}-other}}:queued", "the-run", px=5_000)  # another name's
    before = scripts()
    assert job.apply((x,), task_id="the-run").get() == "done"
    assert scripts() - before == 2  # ACQUIRE and RELEASE
    value, pttl = seen[0]
    if mode == "until_started":
        assert value is None  # deleted as the run started
    else:
        # it lives as the lease does (60 s), not claim_enqueue_ttl (an hour)
        assert value == b"the-run" and 50_000 < pttl <= 60_000
    assert not locks.exists(marked)
    assert locks.get(f"fenced:{{q:{x}-other}}:queued") == b"the-run"
    # A marker that holds another task id (a newer message) stays.
    locks.set(marked, "newer", px=5_000)
    # (Another run: the-run ended ok, so a delivery of it again is a duplicate, ignored.)
    assert job.apply((x,), task_id="another-run").get() == "done"
    assert locks.get(marked) == b"newer" and 0 < locks.pttl(marked) <= 5_000


def _marker_events(services: Services, k: str) -> tuple[list[str], Any]:
    """What happens to the marker of ``hold:<k>`` from now on (keyspace notifications of
    the tests' own server), and how to stop listening."""
    locks = services.locks()
    locks.config_set("notify-keyspace-events", "Kg$x")
    db = locks.connection_pool.connection_kwargs.get("db", 0)
    pubsub = locks.pubsub()
    pubsub.subscribe(f"__keyspace@{db}__:fenced:{{hold:{k}}}:queued")
    seen: list[str] = []
    stop = threading.Event()

    def listen() -> None:
        try:
            while not stop.is_set():
                message = pubsub.get_message(timeout=0.05)
                if message and message["type"] == "message":
                    seen.append(str(message["data"]))
        except Exception as exc:
            seen.append(repr(exc))

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    wait_for("the subscription", lambda: pubsub.subscribed)

    def close() -> None:
        stop.set()
        thread.join(5)
        pubsub.close()
        locks.close()  # (held until now: the client closes its pool, the pubsub's too)

    return seen, close


def test_a_call_put_back_under_until_started_keeps_its_marker_throughout(
    services: Services,
) -> None:
    """A call over its rate is put back; its name's marker holds its task id from its
    send to its start, never deleted between its refused acquire and the put-back (a
    gap another call's message could be published into)."""
    app = sender(services)
    rated = app.tasks["e.rated"]
    k = key()
    go(services, k)  # runs end at once
    with Worker(services, concurrency=1, app=APP) as worker:
        first = rated.delay(k)
        assert first.get(timeout=WAIT) == first.id
        seen, close = _marker_events(services, k)
        try:
            second = rated.delay(k)
            wait_for("the put-back", lambda: f"[{second.id}] put back for" in worker.log())
            assert marker(services, k) == second.id
            # Nothing deleted the marker: it was set when sent, and kept.
            assert "del" not in seen and seen[:1] == ["set"], seen
            assert rated.delay(k).id == second.id  # no second message meanwhile
        finally:
            close()


def test_a_call_skipped_as_busy_under_until_started_clears_its_marker(
    services: Services,
) -> None:
    app = sender(services)
    started = app.tasks["e.started"]
    k = key()
    with Worker(services, concurrency=2, app=APP):
        first = started.delay(k)
        wait_for("the run to start", lambda: runs(services, k))
        second = started.delay(k)
        assert second.id != first.id
        skipped = second.get(timeout=WAIT)
        assert skipped["status"] == "skipped"
        assert marker(services, k) is None  # the call ended: its name is free to send
        third = started.delay(k)
        assert third.id not in (first.id, second.id)  # published: a message of its own
        go(services, k)
        assert first.get(timeout=WAIT) == first.id
        third.get(timeout=WAIT)  # (skipped too, or run after the first: either way, sent)

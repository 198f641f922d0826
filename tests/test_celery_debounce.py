"""Debounce (``claim_debounce``) with a real broker and real workers.

The sending side runs here (tests/celery_debounce_app.py's ``make_app``); the runs happen
in a ``celery worker`` running the same module. The broker's queue is a Redis list, so
its length (LLEN) is how many messages were published and not yet taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from _wait import wait_for
from celery_debounce_app import make_app
from celery_harness import ROOT, WAIT, Services, Worker, key
from fenced import ConfigError
from fenced._lease import ClaimKeys
from fenced.celery import ClaimedTask, _debounce, _rerun, metrics
from fenced.testing import RedisServer, TcpProxy

APP = "tests.celery_debounce_app"


def sender(services: Services) -> Celery:
    """The app a test sends from: the tasks of the worker's module, on its servers."""
    return services.sender(make_app)


def queued(services: Services) -> int:
    """Messages waiting in the test's queue."""
    return services.queued()


def burst(services: Services, k: str) -> dict[str, str]:
    """The open burst of ``deb:<k>`` (empty: none)."""
    found = services.locks().hgetall(f"fenced:{{deb:{k}}}:debounce")
    return {str(f): str(v) for f, v in found.items()}


def runs(services: Services, k: str) -> list[dict[str, Any]]:
    """The start and end notes of the runs of ``deb:<k>``, oldest first."""
    return [json.loads(x) for x in services.obs().lrange(f"runs:{k}", 0, -1)]


def starts(services: Services, k: str) -> list[dict[str, Any]]:
    return [note for note in runs(services, k) if note["at"] == "start"]


@pytest.fixture
def services(redis_server: RedisServer) -> Services:
    """The module's server, a fresh queue."""
    return Services.on(redis_server)


# -- options -------------------------------------------------------------------------------


def _define(app: Celery, name: str = "job", **options: Any) -> Any:
    @app.task(base=ClaimedTask, claim="x:{a}", shared=False, name=name, **options)
    def job(a: int) -> None: ...

    return job


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"claim_debounce": 0}, r"claim_debounce=0 is not a duration"),
        ({"claim_debounce": "soon"}, r"claim_debounce='soon' is not a duration"),
        ({"claim_debounce": True}, r"claim_debounce=True is not a duration"),
        ({"claim_debounce": 5, "claim_debounce_max": "2s"}, r"debounce_max=2s is shorter"),
        ({"claim_debounce_max": 5}, r"give claim_debounce too"),
        ({"claim_debounce": 1, "claim_enqueue": "until_started"}, r"with claim_enqueue"),
        ({"claim_debounce": 1, "claim_on_busy": "skip"}, r"claim_on_busy='skip'"),
        ({"claim_debounce": 1, "claim_on_busy": "replace"}, r"claim_on_busy='replace'"),
        ({"claim_debounce": 1, "claim_limit": 2}, r"claim_limit=2"),
        ({"claim_debounce": 1, "claim_cooldown": 10}, r"with claim_cooldown"),
    ],
)
def test_contradictory_or_bad_options_fail_when_the_task_is_made(
    options: dict[str, Any], match: str
) -> None:
    app = Celery("debounce_config", set_as_current=False, broker="memory://")
    app.finalize()
    with pytest.raises(ConfigError, match=match):
        _define(app, **options)


def test_durations_read_as_seconds_and_a_debounce_waits_for_a_busy_name() -> None:
    app = Celery("debounce_ok", set_as_current=False, broker="memory://")
    app.finalize()
    job = _define(app, claim_debounce="300ms", claim_debounce_max="1m")
    opts = job._options()
    assert (opts.values["claim_debounce"], opts.values["claim_debounce_max"]) == (0.3, 60.0)
    assert opts.on_busy == "retry"
    assert _define(app, "plain")._options().on_busy == "skip"  # no debounce: the usual default
    # An app-wide policy for the other tasks does not reach a debounced one: skipping
    # would lose its burst. The task's own policy other than retry is refused.
    other = Celery("debounce_setting", set_as_current=False, broker="memory://")
    other.conf.fenced_claim_on_busy = "skip"
    other.finalize()
    assert _define(other, claim_debounce=1)._options().on_busy == "retry"
    assert _define(other, "plain")._options().on_busy == "skip"
    with pytest.raises(ConfigError, match="claim_on_busy='skip'"):
        _define(other, "own", claim_debounce=1, claim_on_busy="skip")._options()


# -- a burst ---------------------------------------------------------------------------------


def test_a_burst_is_one_message_and_one_run_with_the_last_call(services: Services) -> None:
    app = sender(services)
    job = app.tasks["d.job"]
    k = key()
    before = metrics["debounced"]
    results = [job.delay(k, n) for n in range(20)]
    # A signature, and options given as None (as some senders pass them), join it too.
    none: dict[str, Any] = {"countdown": None, "eta": None}
    results += [job.apply_async((k, 20), **none), job.s(k, 21).delay()]
    assert len({r.id for r in results}) == 1
    assert queued(services) == 1  # one message for the whole burst
    assert metrics["debounced"] - before == 21
    assert burst(services, k)["id"] == results[0].id
    with Worker(services, concurrency=1, app=APP):
        assert results[-1].get(timeout=WAIT) == 21
    assert [(s["task_id"], s["n"]) for s in starts(services, k)] == [(results[0].id, 21)]
    assert burst(services, k) == {}  # the run took it


def test_debounce_max_runs_a_burst_that_never_pauses(services: Services) -> None:
    app = sender(services)
    job = app.tasks["d.job"]
    k = key()
    with Worker(services, concurrency=1, app=APP):
        first = job.delay(k, 0)
        n = 0
        # A call every 0.1 s never leaves 0.3 s of quiet: only the cap can start a run.
        while not starts(services, k) and n < 300:
            n += 1
            job.delay(k, n)
            time.sleep(0.1)
        ran = starts(services, k)
        assert ran, "the burst never ran while its calls went on"
        assert ran[0]["task_id"] == first.id and 0 < ran[0]["n"] <= n
        last = job.delay(k, n + 1)  # after the cap: the next burst
        assert last.get(timeout=WAIT) == n + 1
    assert first.get(timeout=WAIT) == ran[0]["n"]


def test_a_call_during_the_run_starts_the_next_burst_which_waits_for_it(
    services: Services,
) -> None:
    app = sender(services)
    job = app.tasks["d.job"]
    k = key()
    obs = services.obs()
    obs.set(f"hold:{k}", 1)
    with Worker(services, concurrency=2, app=APP):
        first = job.delay(k, 1)
        wait_for("the first run", lambda: starts(services, k))
        second = [job.delay(k, n) for n in (2, 3, 4)]
        assert len({r.id for r in second}) == 1 and second[0].id != first.id
        # Its message comes and goes again while the name is held: no second run yet.
        wait_for("the next burst's message", lambda: burst(services, k) and queued(services) == 0)
        assert len(starts(services, k)) == 1
        obs.set(f"go:{k}", 1)
        assert first.get(timeout=WAIT) == 1
        assert second[0].get(timeout=WAIT) == 4
    notes = [(note["at"], note["n"]) for note in runs(services, k)]
    assert notes == [("start", 1), ("end", 1), ("start", 4), ("end", 4)]  # never overlapping


def test_the_waiting_burst_runs_after_its_worker_is_killed(services: Services) -> None:
    app = sender(services)
    slow = app.tasks["d.slow"]
    k = key()
    # The victim keeps the broker's hour-long visibility timeout: while it lives, it
    # never hands its own message back to the queue.
    with Worker(services, concurrency=1, app=APP, name="victim"):
        results = [slow.delay(k, n) for n in (1, 2)]
        # Recorded as unacknowledged, not only gone from the queue: a Redis broker loses
        # a message its consumer had popped but not yet recorded.
        wait_for("the worker to hold the message", lambda: results[0].id in services.unacked())
        assert queued(services) == 0 and not starts(services, k)
    # Killed while the burst waits: the broker brings the message back to a new worker.
    with Worker(services, concurrency=1, app=APP, visibility=2, name="successor"):
        assert results[0].get(timeout=WAIT) == 2
    assert [s["n"] for s in starts(services, k)] == [2]


# -- what the burst record holds is checked ---------------------------------------------------


def test_a_planted_call_is_dropped_and_the_message_runs_with_its_own(
    services: Services,
) -> None:
    app = sender(services)
    job = app.tasks["d.job"]
    planted: list[Callable[[str], str]] = [
        lambda k: json.dumps([[k, 666], {}]),  # unsigned
        lambda k: f"m1:{'0' * 64}:" + json.dumps([[k, 666], {}]),  # forged
        lambda k: "m1:nonsense",  # malformed
    ]
    sent = {}
    for text in planted:
        k = key()
        sent[k] = job.delay(k, 1)
        services.locks().hset(f"fenced:{{deb:{k}}}:debounce", "call", text(k))
    with Worker(services, concurrency=1, app=APP) as worker:
        assert [r.get(timeout=WAIT) for r in sent.values()] == [1, 1, 1]
        assert worker.log().count("dropped the stored call of a burst") == 3
    assert [[s["n"] for s in starts(services, k)] for k in sent] == [[1]] * 3


def test_a_lost_burst_record_runs_the_first_call(services: Services) -> None:
    """What a Redis restart can lose: the record, so the later calls' arguments."""
    app = sender(services)
    job = app.tasks["d.job"]
    k = key()
    first, *_ = [job.delay(k, n) for n in (1, 2, 3)]
    services.locks().delete(f"fenced:{{deb:{k}}}:debounce")
    with Worker(services, concurrency=1, app=APP):
        assert first.get(timeout=WAIT) == 1
    assert [s["n"] for s in starts(services, k)] == [1]


# -- a canvas's part is not coalesced ------------------------------------------------------


def test_a_call_with_a_callback_or_its_own_task_id_is_sent_as_it_is(services: Services) -> None:
    app = sender(services)
    job, collect = app.tasks["d.job"], app.tasks["d.collect"]
    k = key()
    first = job.delay(k, 1)
    linked = job.apply_async((k, 2), link=collect.s())
    own = job.apply_async((k, 3), task_id=f"mine-{k}")
    assert len({first.id, linked.id, own.id}) == 3 and own.id == f"mine-{k}"
    assert queued(services) == 3
    assert burst(services, k)["id"] == first.id
    with Worker(services, concurrency=1, app=APP):
        assert (first.get(timeout=WAIT), linked.get(timeout=WAIT), own.get(timeout=WAIT)) == (
            1,
            2,
            3,
        )
    assert sorted(s["n"] for s in starts(services, k)) == [1, 2, 3]


# -- a burst belongs to its task, and to a message that exists --------------------------------


def test_tasks_that_share_a_name_debounce_apart(services: Services) -> None:
    """d.job and d.other share their names (one resource): a call of one never joins
    the other's burst, so it is never answered with the other's task id, nor run as it."""
    app = sender(services)
    job, other = app.tasks["d.job"], app.tasks["d.other"]
    k = key()
    first = job.delay(k, 1)
    second = other.delay(k, 2)
    assert second.id != first.id, "d.other's call joined d.job's burst"
    assert queued(services) == 2
    with Worker(services, concurrency=1, app=APP):
        assert (first.get(timeout=WAIT), second.get(timeout=WAIT)) == (1, 2)
    ran = sorted((s["task"], s["n"]) for s in starts(services, k))
    assert ran == [("d.job", 1), ("d.other", 2)]


def test_a_planted_burst_id_is_never_a_callers_task_id(services: Services) -> None:
    """A burst record's id is checked as the enqueue marker's is: one fenced never writes
    is not handed back, and the call is sent as it is."""
    app = sender(services)
    job = app.tasks["d.job"]
    k = key()
    planted = "x" * 300  # longer than any task id fenced writes
    record = f"fenced:{{deb:{k}}}:debounce"
    services.locks().hset(record, mapping={"id": planted, "first": 0, "task": "d.job"})
    services.locks().pexpire(record, 60_000)
    result = job.delay(k, 1)
    assert result.id != planted
    assert queued(services) == 1
    with Worker(services, concurrency=1, app=APP):
        assert result.get(timeout=WAIT) == 1


_DYING_SENDER = """
import sys
sys.path.insert(0, sys.argv[1])
from celery_debounce_app import make_app
app = make_app(sys.argv[2], None, sys.argv[3], sys.argv[4], sys.argv[5])
app.tasks["d.job"].delay(sys.argv[6], 1)
"""


def test_a_burst_whose_sender_died_before_publishing_runs_within_debounce_max(
    services: Services,
) -> None:
    """A sender killed between the burst's record and its message: a later call
    publishes the message, so the name runs within claim_debounce_max (1.5 s) of it."""
    app = sender(services)
    job = app.tasks["d.job"]
    k = key()
    broker_port = int(services.broker_url.split(":")[-1].split("/")[0])
    proxy = TcpProxy(broker_port)
    proxy.blackhole()  # the sender's publish hangs
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    dying = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _DYING_SENDER,
            str(ROOT / "tests"),
            proxy.url,
            services.lock_url,
            services.obs_url,
            services.queue,
            k,
        ],
        env=env,
    )
    try:
        wait_for("the sender's burst record", lambda: burst(services, k).get("id"))
        time.sleep(0.3)  # inside its publish, which hangs
        assert dying.poll() is None, "the sender did not hang in its publish"
        dying.kill()
        dying.wait(timeout=WAIT)
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait()
        proxy.close()
    dead = burst(services, k)["id"]
    with Worker(services, concurrency=1, app=APP):
        begun = time.monotonic()
        n = 1
        while not starts(services, k) and time.monotonic() - begun < 8.0:
            n += 1
            job.delay(k, n)
            time.sleep(0.3)
        took = time.monotonic() - begun
        ran = starts(services, k)
        assert ran, f"no run within {took:.1f}s of {n - 1} later calls"
        assert took < 1.5 + 2.5, f"the first run came {took:.1f}s after the later calls began"
        assert ran[0]["task_id"] == dead  # the burst's own id: its callers' result
        assert job.AsyncResult(dead).get(timeout=WAIT) == ran[0]["n"]


def test_a_burst_whose_sender_died_runs_when_no_call_comes_after_its_one_joiner(
    services: Services,
) -> None:
    """A sender killed between the burst's record and its message, then one call that
    joins, then none: the joiner sent a backup of the burst's message (its opener never
    said it published one), so the burst runs within claim_debounce_max of its opening,
    with the joiner's call; and the calls of a healthy burst send no backup."""
    app = sender(services)
    job: Any = app.tasks["d.job"]
    k = key()
    opts = job._options()
    keys = ClaimKeys(opts.claim.namespace, job.claim_name_for((k, 0), {}))
    call = _rerun.encode((k, 0), {}, keys.name, job._rerun_key(), job.name, _rerun.DEBOUNCE)
    debounce, most = opts.values["claim_debounce"], opts.values["claim_debounce_max"]
    # The opener: its record written, then it died before it published anything.
    dead, what = _debounce.join(
        services.locks(), keys, "dead-opener", call, 60.0, debounce, most, job.name
    )
    assert (dead, what) == ("dead-opener", _debounce.OPENED)
    with Worker(services, concurrency=1, app=APP):
        begun = time.monotonic()
        joined = job.delay(k, 1)  # the one call after it; then none
        assert joined.id == dead
        assert joined.get(timeout=WAIT) == 1  # the joiner's call ran, under the burst's id
        took = time.monotonic() - begun
        assert took < (most or debounce) + 2.5, f"the burst ran {took:.1f}s after its joiner"
        # A healthy burst: its opener confirms its message before a call joins.
        healthy = key()
        first = job.delay(healthy, 1)
        assert job.delay(healthy, 2).id == first.id
        assert "backup" not in burst(services, healthy)  # one message: no backup sent
        assert first.get(timeout=WAIT) == 2


def test_a_burst_waiting_out_a_long_run_keeps_its_last_call(services: Services) -> None:
    """The burst's message, waiting while a run holds the name, keeps the burst record
    alive past its expiry (here 2 s after its first call): the burst runs with its last
    call, not its message's own (the first call's)."""
    app = sender(services)
    brief = app.tasks["d.brief"]
    k = key()
    obs = services.obs()
    obs.set(f"hold:{k}", 1)
    with Worker(services, concurrency=2, app=APP):
        first = brief.delay(k, 1)
        wait_for("the first run", lambda: starts(services, k))
        later = [brief.delay(k, n) for n in (2, 3)]
        time.sleep(5.0)  # the run holds the name well past the record's own expiry
        obs.set(f"go:{k}", 1)
        assert first.get(timeout=WAIT) == 1
        assert later[0].get(timeout=WAIT) == 3
    assert [s["n"] for s in starts(services, k)] == [1, 3]


def test_a_burst_message_never_expires_while_it_waits(services: Services) -> None:
    """A task's default ``expires`` is not given to its bursts' messages (a deferred one
    would expire and leave its burst with no message), and a call with its own
    ``expires`` is sent as it is."""
    app = sender(services)
    expiring = app.tasks["d.expiring"]
    k = key()
    obs = services.obs()
    obs.set(f"hold:{k}", 1)
    with Worker(services, concurrency=2, app=APP):
        first = expiring.delay(k, 1)
        wait_for("the first run", lambda: starts(services, k))
        later = [expiring.delay(k, n) for n in (2, 3)]
        own = expiring.apply_async((k, 4), expires=60)
        assert own.id != later[0].id  # not joined
        time.sleep(4.0)  # past the task's expires, its burst's message waiting all along
        obs.set(f"go:{k}", 1)
        assert first.get(timeout=WAIT) == 1
        assert later[0].get(timeout=WAIT) == 3
        assert own.get(timeout=WAIT) == 4
    assert sorted(s["n"] for s in starts(services, k)) == [1, 3, 4]

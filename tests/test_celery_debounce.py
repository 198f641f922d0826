"""Debounce (``claim_debounce``) with a real broker and real workers.

The sending side runs here (tests/celery_debounce_app.py's ``make_app``); the runs happen
in a ``celery worker`` running the same module. The broker's queue is a Redis list, so
its length (LLEN) is how many messages were published and not yet taken.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from _wait import wait_for
from celery_debounce_app import make_app
from celery_harness import WAIT, Services, Worker, key
from fenced import ConfigError
from fenced.celery import ClaimedTask, metrics
from fenced.testing import RedisServer

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

"""fenced.celery.beat in one process: the dispatch script, due times, catch-up, a new
leader continuing, a cut-off leader refused, the alarm, the settings.

Real Redis (the ``server`` fixture); the schedulers publish to Celery's in-memory broker
and the tests read what was sent from Celery's ``after_task_publish`` signal. Wall
clock and alarm clock are the scheduler's seams, driven here.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab, schedule
from prometheus_client import CollectorRegistry
from redis.backoff import NoBackoff
from redis.retry import Retry

from fenced import Claim
from fenced._errors import ConfigError
from fenced._inspect import read_holder
from fenced._lease import ClaimKeys
from fenced._scripts import BEAT_DISPATCH
from fenced.celery import beat
from fenced.celery.beat import CatchUp, Scheduler, next_due, plan, status, task_id
from fenced.testing import RedisServer

#: 2026-01-15T08:00Z, on a whole minute: in Redis's past, as a due time must be (one
#: ahead of Redis's clock is refused)
T0 = 1_768_464_000_000


def _dispatch(client: Any, claim: Claim, *triples: tuple[str, int, str]) -> list[int]:
    keys = ClaimKeys.of(claim.name)
    args: list[Any] = [claim.token, str(claim.fence), "0", secrets.token_hex(8)]
    for triple in triples:
        args.extend(triple)
    answer = BEAT_DISPATCH(client, [keys.lock, keys.fence, keys.beat], args)
    return [int(answer[0]), *(int(x) for x in answer[3:])]


def test_dispatch_grants_each_due_once_to_the_holder(server: RedisServer) -> None:
    client = server.client()
    with Claim(client, "beat:x", ttl=5, heartbeat=False) as claim:
        assert _dispatch(client, claim, ("a", T0, "skip")) == [1, 0]
        assert _dispatch(client, claim, ("a", T0 + 1000, "500")) == [1, 1]
        # The same due again, an earlier one, one closer than the gap: refused.
        assert _dispatch(client, claim, ("a", T0 + 1000, "500")) == [1, 0]
        assert _dispatch(client, claim, ("a", T0 + 500, "0")) == [1, 0]
        assert _dispatch(client, claim, ("a", T0 + 1400, "500")) == [1, 0]
        assert _dispatch(client, claim, ("a", T0 + 2000, "500"), ("a", T0 + 3000, "500")) == [
            1,
            1,
            1,
        ]
        stored = client.hget(ClaimKeys.of("beat:x").beat, "entry:a").decode()
        assert stored == f"{T0 + 3000}:{claim.fence}:pending"


def test_dispatch_refuses_a_stale_token_or_fence(server: RedisServer) -> None:
    client = server.client()
    old = Claim(client, "beat:x", ttl=5, heartbeat=False)
    assert old.acquire()
    assert _dispatch(client, old, ("a", T0, "skip")) == [1, 0]
    # Its lease is gone (expired while paused, cut off): a new leader takes it.
    client.delete(ClaimKeys.of("beat:x").lock)
    new = Claim(client, "beat:x", ttl=5, heartbeat=False)
    assert new.acquire() and new.fence is not None and old.fence is not None
    assert new.fence > old.fence
    assert _dispatch(client, old, ("a", T0 + 1000, "0")) == [0]
    assert _dispatch(client, new, ("a", T0 + 1000, "0")) == [1, 1]
    # The holder's token with another fence (the fence key moved on): refused too.
    new.fence = new.fence - 1
    assert _dispatch(client, new, ("a", T0 + 2000, "0")) == [0]
    new.fence = new.fence + 1
    # A due stored under a higher fence than the caller's is not overwritten.
    keys = ClaimKeys.of("beat:x")
    client.hset(keys.beat, "entry:b", f"{T0}:{new.fence + 10}:sent")
    assert _dispatch(client, new, ("b", T0 + 5000, "0")) == [1, 0]
    new.release()
    assert _dispatch(client, new, ("a", T0 + 3000, "0")) == [0]


def test_due_times_are_the_same_for_every_beat() -> None:
    every = schedule(2.5)
    assert next_due(every, T0) == T0 + 2500
    cron = crontab(minute="*/15")
    due = next_due(cron, T0 + 1)
    assert due == T0 + 15 * 60 * 1000
    assert next_due(cron, due) == due + 15 * 60 * 1000


@pytest.mark.parametrize(
    ("mode", "every", "now", "runs", "passed"),
    [
        ("skip", 1, T0 + 1_050, [T0 + 1_000], None),  # on time
        ("skip", 1, T0 + 900, [], None),  # not due yet
        ("skip", 60, T0 + 75_000, [T0 + 60_000], None),  # late by less than the window
        ("skip", 60, T0 + 110_000, [], T0 + 60_000),  # 50 s late: passed over
        ("skip", 1, T0 + 60_500, [T0 + 60_000], None),  # the latest is 0.5 s late
        ("latest", 60, T0 + 170_000, [T0 + 120_000], None),
        ("all", 1, T0 + 3_200, [T0 + 1_000, T0 + 2_000, T0 + 3_000], None),
    ],
)
def test_catch_up(mode: str, every: float, now: int, runs: list[int], passed: int | None) -> None:
    catch_up = CatchUp.of({"fenced_catch_up": mode}, ttl=10.0, where="t")
    assert plan(schedule(every), T0, now, catch_up) == (runs, passed)


def test_catch_up_all_keeps_to_its_window_and_limit() -> None:
    catch_up = CatchUp.of({"fenced_catch_up": "all", "fenced_catch_up_window": 2.5}, 10.0, "t")
    assert plan(schedule(1.0), T0, T0 + 10_000, catch_up) == (
        [T0 + 8_000, T0 + 9_000, T0 + 10_000],
        None,
    )
    wide = CatchUp.of({"fenced_catch_up": "all", "fenced_catch_up_window": 1e9}, 10.0, "t")
    runs, _ = plan(schedule(1.0), T0, T0 + 5_000_000, wide)
    assert len(runs) == beat.ALL_LIMIT and runs[-1] == T0 + 5_000_000
    cron = CatchUp.of({"fenced_catch_up": "all", "fenced_catch_up_window": 3600}, 10.0, "t")
    runs, _ = plan(crontab(minute="*/15"), T0, T0 + 3_600_000, cron)
    assert runs == [T0 + k * 900_000 for k in range(1, 5)]


def test_bad_options_fail_at_start() -> None:
    with pytest.raises(ConfigError, match="fenced_catch_up="):
        CatchUp.of({"fenced_catch_up": "some"}, 10.0, "t")
    with pytest.raises(ConfigError, match="fenced_catch_up_window"):
        CatchUp.of({"fenced_catch_up_window": -1}, 10.0, "t")
    app = Celery("bad", broker="memory://")
    app.conf.update(fenced_beat_ttl=0, fenced_redis_url="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match="fenced_beat_ttl"):
        Scheduler(app, lazy=True)
    app.conf.update(fenced_beat_ttl=1, fenced_beat_alarm_after=-3)
    with pytest.raises(ConfigError, match="fenced_beat_alarm_after"):
        Scheduler(app, lazy=True)


# -- schedulers in this process ---------------------------------------------------------


class Wall:
    """The wall clock of a scheduler, in seconds, moved by the test."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms / 1000


def _app(server: RedisServer, **entries: Any) -> Celery:
    app = Celery("beat_unit", broker="memory://")
    app.conf.update(
        fenced_redis_url=server.url,
        fenced_beat_name="unit",
        fenced_beat_ttl=10.0,
        beat_schedule={
            name: {"task": "unit.tick", "schedule": 60.0, "options": options}
            for name, options in entries.items()
        },
    )
    return app


def _scheduler(app: Celery, wall: Wall) -> Scheduler:
    sched = Scheduler(app)
    sched.wall = wall
    return sched


def _two(server: RedisServer, wall: Wall) -> tuple[Scheduler, Scheduler]:
    """Two beats of one app with an entry ``a`` every minute; the first leads."""
    app = _app(server, a={})
    first, other = _scheduler(app, wall), _scheduler(app, wall)
    first.tick()
    assert first.leading
    return first, other


def test_a_new_leader_continues_the_cadence(server: RedisServer, sent: list[str]) -> None:
    wall = Wall(T0)
    app = _app(server, skip={}, latest={"fenced_catch_up": "latest"})
    first = _scheduler(app, wall)
    second = _scheduler(app, wall)
    first.tick()  # leads; each entry's cadence starts now
    assert first.leading and not sent
    assert second.tick() > 0 and not second.leading
    assert second.tick() > 0 and not second.leading
    # A stand-by's polls are not skipped runs of the leader's claim.
    assert server.client().get(ClaimKeys.of("beat:unit").skips) in (None, b"0")
    wall.ms = T0 + 60_010
    first.tick()
    assert sorted(sent) == [task_id("unit", n, T0 + 60_000) for n in ("latest", "skip")]
    assert first.schedule["skip"].last_run_at == datetime.fromtimestamp(T0 / 1000, timezone.utc)
    first.close()  # gives the lead up at once
    sent.clear()
    # 90 s later (the due at +120 s passed while nobody led), the other beat leads.
    wall.ms = T0 + 150_000
    second.tick()
    assert second.leading
    assert sent == [task_id("unit", "latest", T0 + 120_000)]
    sent.clear()
    wall.ms = T0 + 180_001
    second.tick()
    assert sorted(sent) == [task_id("unit", n, T0 + 180_000) for n in ("latest", "skip")]
    report = status(server.client(), "unit")
    assert report.leader is not None and report.leader.fence == second._claim.fence
    assert {n: (e.due_ms, e.state) for n, e in report.entries.items()} == {
        "skip": (T0 + 180_000, "sent"),
        "latest": (T0 + 180_000, "sent"),
    }
    shown = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "beat", "unit", "--redis", server.url, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    seen = json.loads(shown.stdout)
    assert seen["leader"]["fence"] == second._claim.fence
    assert seen["leader"]["pid"] == os.getpid()
    assert seen["entries"]["skip"]["state"] == "sent"
    second.close()
    shown = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "beat", "unit", "--redis", server.url],
        capture_output=True,
        text=True,
        check=True,
    )
    assert shown.stdout.startswith("beat unit: no leader"), shown.stdout
    assert "  latest: " in shown.stdout


def test_a_tick_that_fails_to_send_is_sent_again_even_when_an_older_one_was_resent(
    server: RedisServer, sent: list[str]
) -> None:
    wall = Wall(T0)
    sched = _scheduler(_app(server, a={}), wall)
    tried: set[str] = set()
    send_task = sched.send_task

    def first_try_fails(*args: Any, **options: Any) -> Any:
        # A broker that refuses each task id's first publish (and takes the second).
        if options["task_id"] not in tried:
            tried.add(options["task_id"])
            raise ConnectionError("broker down")
        return send_task(*args, **options)

    sched.send_task = first_try_fails  # type: ignore[method-assign]
    due = [task_id("unit", "a", T0 + k * 60_000) for k in (1, 2)]
    sched.tick()  # leads; the cadence starts now
    wall.ms = T0 + 60_010
    sched.tick()  # the due at +60 s is granted, its publish fails
    assert sent == []
    wall.ms = T0 + 120_010
    sched.tick()  # +60 s sent again (and taken); +120 s granted, its publish fails
    assert sent == [due[0]]
    wall.ms = T0 + 125_000
    sched.tick()  # +120 s sent again
    assert sent == due
    entries = status(server.client(), "unit").entries
    assert (entries["a"].due_ms, entries["a"].state) == (T0 + 120_000, "sent")
    sched.close()


def test_a_cut_off_leader_sends_nothing_and_stands_by(server: RedisServer, sent: list[str]) -> None:
    wall = Wall(T0)
    leader, other = _two(server, wall)
    # Its lease ends behind its back (expired while it was paused, or cut off), and
    # the other beat takes the lead before the old leader's next tick.
    server.client().delete(ClaimKeys.of("beat:unit").lock)
    other.tick()
    assert other.leading
    wall.ms = T0 + 60_000
    assert leader.leading  # by its own clock it still leads...
    assert leader.tick() > 0  # ...but the script refuses: it sends nothing, stands by
    assert not leader.leading and not sent
    other.tick()
    assert sent == [task_id("unit", "a", T0 + 60_000)]
    other.close()
    leader.tick()  # and it leads again once the lead is free
    assert leader.leading
    leader.close()


def test_no_leader_for_long_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture, registry: CollectorRegistry
) -> None:
    dead = RedisServer().start()
    dead.stop()  # nothing listens on its port any more
    app = Celery("beat_alarm", broker="memory://")
    app.conf.update(
        fenced_redis_url=dead.url,
        fenced_redis_options={"retry": Retry(NoBackoff(), 0)},
        fenced_beat_ttl=1.0,
        fenced_beat_alarm_after=5.0,
    )
    now = [100.0]
    sched = Scheduler(app)
    sched.clock = lambda: now[0]
    sched._led_at = now[0]
    alarms = ("fenced_beat_leaderless_alarms_total", {"beat": "beat_alarm"})
    with caplog.at_level(logging.WARNING, logger="fenced.beat"):
        sched.tick()
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert registry.get_sample_value(*alarms) is None
        now[0] += 6
        sched.tick()
        sched.tick()  # said once per alarm period
        assert registry.get_sample_value(*alarms) == 1
        now[0] += 5
        sched.tick()
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == [
        "fenced beat beat_alarm: no beat has led for 6 s: nothing is being sent",
        "fenced beat beat_alarm: no beat has led for 11 s: nothing is being sent",
    ]
    assert registry.get_sample_value(*alarms) == 2
    assert registry.get_sample_value("fenced_beat_leading", {"beat": "beat_alarm"}) == 0


def test_beat_settings_are_known(server: RedisServer) -> None:
    from fenced.celery._options import KNOWN_SETTINGS

    assert {"fenced_beat_name", "fenced_beat_ttl", "fenced_beat_alarm_after"} <= KNOWN_SETTINGS


def test_a_tick_granted_and_never_sent_is_sent_by_the_next_leader(
    server: RedisServer, sent: list[str]
) -> None:
    wall = Wall(T0)
    app = _app(server, a={})
    first = _scheduler(app, wall)
    first.tick()  # leads, and starts the entry's cadence
    claim = first._claim
    assert claim is not None
    # It is granted the tick due at +60 s and dies before it sends it.
    assert _dispatch(server.client(), claim, ("a", T0 + 60_000, "0")) == [1, 1]
    claim.release()
    wall.ms = T0 + 61_000
    second = _scheduler(app, wall)
    second.tick()
    assert second.leading
    assert sent == [task_id("unit", "a", T0 + 60_000)]  # the same tick, the same task id
    assert status(server.client(), "unit").entries["a"].state == "sent"
    second.tick()
    assert sent == [task_id("unit", "a", T0 + 60_000)]  # and only once
    second.close()


def test_a_tick_that_fails_gives_the_lead_up_and_stays_up(
    server: RedisServer, sent: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    wall = Wall(T0)
    first, other = _two(server, wall)
    # Something fenced never writes where the beat keeps its entries.
    beat_key = ClaimKeys.of("beat:unit").beat
    server.client().delete(beat_key)
    server.client().set(beat_key, "not a hash")
    with caplog.at_level(logging.ERROR, logger="fenced.beat"):
        assert first.tick() > 0
    assert not first.leading
    assert "tick failed; giving up the lead" in caplog.text
    assert read_holder(server.client(), "beat:unit") is None  # given up at once
    server.client().delete(beat_key)
    other.tick()  # another beat leads, its entry's cadence starts again
    assert other.leading
    wall.ms = T0 + 60_000
    other.tick()
    assert sent == [task_id("unit", "a", T0 + 60_000)]
    assert first.tick() > 0 and not first.leading  # the beat that failed stands by
    other.close()

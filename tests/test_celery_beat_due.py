"""fenced.celery.beat's due times: every shape of schedule users write is sent at each
of its due times (the shortest gap the dispatch script allows is measured back from a
due time, so uneven crontabs are not refused), and due times follow Redis's clock (a
leader whose clock runs ahead cannot store a due time in Redis's future).

Pure-function tables for the gap; the real scheduler and the real ``BEAT_DISPATCH``
on a real redis-server (``server``) with the beat's wall clock driven, and Redis's own
clock for the skewed leader.
"""

from __future__ import annotations

import itertools
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule

from fenced import Claim
from fenced._lease import ClaimKeys
from fenced.celery.beat import Scheduler, min_gap, next_due, status, task_id
from fenced.testing import RedisServer
from test_celery_beat import _dispatch

UTC = timezone.utc


def ms(year: int, month: int, day: int, hour: int = 0, minute: int = 0, second: int = 0) -> int:
    """A UTC time in ms since the epoch."""
    return round(datetime(year, month, day, hour, minute, second, tzinfo=UTC).timestamp() * 1000)


def at(when_ms: int) -> datetime:
    return datetime.fromtimestamp(when_ms / 1000, UTC)


class Events(BaseSchedule):
    """Events at irregular times, asked as Celery asks ``solar`` (how long from now until
    the first event after the last run): a sunrise that moves a little every day."""

    def __init__(self, times_ms: list[int]) -> None:
        super().__init__()
        self.times = sorted(times_ms)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        last = last_run_at.timestamp() * 1000
        upcoming = next(t for t in self.times if t > last)
        return at(upcoming) - datetime.now(UTC)


#: Sunrise-like: once a day, a few minutes earlier or later each day.
SUNRISES = Events(
    [ms(2026, 1, 1, 7) + d * 86_400_000 + ((d * d * 37) % 600) * 1000 for d in range(60)]
)

#: Every shape users write, each with how many of its due times to walk.
SHAPES: dict[str, tuple[Any, int]] = {
    "every 2.5 s": (schedule(2.5), 50),
    "every minute": (schedule(60.0), 50),
    "every 15 min": (crontab(minute="*/15"), 200),
    "weekdays at midnight": (crontab(hour=0, minute=0, day_of_week="mon-fri"), 30),
    "hourly from 9 to 17": (crontab(minute=0, hour="9-17"), 60),
    "9:00 and 9:30": (crontab(minute="0,30", hour=9), 30),
    "month ends (28th to 31st)": (crontab(minute=0, hour=0, day_of_month="28-31"), 30),
    "1st and 15th": (crontab(minute=0, hour=6, day_of_month="1,15"), 24),
    "Mondays and Fridays at 8": (crontab(minute=0, hour=8, day_of_week="mon,fri"), 20),
    "Feb 29": (crontab(minute=0, hour=12, day_of_month=29, month_of_year=2), 3),
    "sunrise-like (solar)": (SUNRISES, 50),
}

START = ms(2026, 1, 1)  # a Thursday


def walk(sched: Any, start: int, count: int) -> list[int]:
    """The first ``count`` due times of a schedule after ``start``."""
    dues = [next_due(sched, start)]
    while len(dues) < count:
        dues.append(next_due(sched, dues[-1]))
    return dues


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_due_time_is_allowed_after_the_one_before_it(shape: str) -> None:
    sched, count = SHAPES[shape]
    dues = walk(sched, START, count)
    for before, due in itertools.pairwise(dues):
        # The shortest gap allowed is half the gap back from the due time to the one
        # before it (not forward to the next): each due time is allowed after the last.
        gap = min_gap(sched, due)
        assert gap == (due - before) // 2, (shape, at(before), at(due), gap)
        assert due - before >= gap


@pytest.mark.parametrize(
    ("sched", "before", "due"),
    [
        # Friday is one day after Thursday (and three before Monday).
        (crontab(hour=0, minute=0, day_of_week="mon-fri"), ms(2026, 1, 15), ms(2026, 1, 16)),
        # Monday is three days after Friday.
        (crontab(hour=0, minute=0, day_of_week="mon-fri"), ms(2026, 1, 16), ms(2026, 1, 19)),
        # 17:00 is an hour after 16:00 (and 16 hours before 9:00).
        (crontab(minute=0, hour="9-17"), ms(2026, 1, 15, 16), ms(2026, 1, 15, 17)),
        (crontab(minute=0, hour="9-17"), ms(2026, 1, 15, 17), ms(2026, 1, 16, 9)),
        # 9:30 is half an hour after 9:00.
        (crontab(minute="0,30", hour=9), ms(2026, 1, 15, 9), ms(2026, 1, 15, 9, 30)),
        # The 31st a day after the 30th, the 28th four weeks after it.
        (crontab(minute=0, hour=0, day_of_month="28-31"), ms(2026, 1, 30), ms(2026, 1, 31)),
        (crontab(minute=0, hour=0, day_of_month="28-31"), ms(2026, 1, 31), ms(2026, 2, 28)),
        # Four years between two Feb 29s.
        (
            crontab(minute=0, hour=12, day_of_month=29, month_of_year=2),
            ms(2024, 2, 29, 12),
            ms(2028, 2, 29, 12),
        ),
        (schedule(90.0), ms(2026, 1, 15), ms(2026, 1, 15) + 90_000),
    ],
)
def test_the_gap_is_measured_back_from_the_due_time(sched: Any, before: int, due: int) -> None:
    assert next_due(sched, before) == due
    assert min_gap(sched, due) == (due - before) // 2


# -- the real scheduler and script, the wall clock driven --------------------------------


class Wall:
    """The beat's wall clock, in ms, moved by the test."""

    def __init__(self, ms: int) -> None:
        self.ms = ms

    def __call__(self) -> float:
        return self.ms / 1000


def _app(url: str, name: str, entries: dict[str, Any]) -> Celery:
    app = Celery(f"beat_{name}", broker="memory://")
    app.conf.update(
        fenced_redis_url=url,
        fenced_beat_name=name,
        fenced_beat_ttl=10.0,
        beat_schedule={n: {"task": f"{name}.tick", "schedule": s} for n, s in entries.items()},
    )
    return app


CRONTABS = {
    "weekdays": crontab(hour=0, minute=0, day_of_week="mon-fri"),
    "office": crontab(minute=0, hour="9-17"),
    "nine": crontab(minute="0,30", hour=9),
    "month-ends": crontab(minute=0, hour=0, day_of_month="28-31"),
}


def test_a_leader_sends_every_due_time_of_uneven_crontabs_once(
    server: RedisServer, sent: list[str]
) -> None:
    # A Wednesday, 30 s before 9:00: each entry is first seen then (its cadence starts),
    # and 9:00 is its first due time, as with Celery's own scheduler.
    start = ms(2026, 1, 14, 8, 59, 30)
    end = start + 21 * 86_400_000  # three weeks: past the month's end too
    expected: list[tuple[int, str]] = []
    for name, sched in CRONTABS.items():
        due = next_due(sched, start)
        while due <= end:
            expected.append((due, name))
            due = next_due(sched, due)
    expected.sort()
    wall = Wall(start)
    beat = Scheduler(_app(server.url, "cron", CRONTABS))
    beat.wall = wall
    try:
        beat.tick()
        assert beat.leading and not sent
        for due in sorted({d for d, _ in expected}):
            wall.ms = due + 10
            beat.tick()
        want = [task_id("cron", name, due) for due, name in expected]
        assert sorted(sent) == sorted(want)
        assert len(sent) == len(set(sent))
        # What the issue saw refused: Friday after Thursday, 17:00 after 16:00, 9:30
        # after 9:00, the 9:00 half a minute after the entry was first seen, the 31st.
        for name, due in [
            ("weekdays", ms(2026, 1, 16)),
            ("office", ms(2026, 1, 14, 17)),
            ("nine", ms(2026, 1, 14, 9, 30)),
            ("nine", ms(2026, 1, 14, 9)),
            ("month-ends", ms(2026, 1, 31)),
        ]:
            assert task_id("cron", name, due) in sent, (name, at(due))
        entries = status(server.client(), "cron").entries
        assert {n: e.state for n, e in entries.items()} == dict.fromkeys(CRONTABS, "sent")
    finally:
        beat.close()


# -- Redis's clock ------------------------------------------------------------------------


def _redis_ms(client: Any) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def test_the_script_stores_no_due_time_in_redis_future(server: RedisServer) -> None:
    client = server.client()
    field = "entry:a"
    with Claim(client, "beat:x", ttl=5, heartbeat=False) as claim:
        now = _redis_ms(client)
        # A first-seen mark 45 s ahead of Redis's clock: not stored.
        assert _dispatch(client, claim, ("a", now + 45_000, "skip")) == [1, 0]
        assert client.hget(ClaimKeys.of("beat:x").beat, field) is None
        assert _dispatch(client, claim, ("a", now - 5_000, "skip")) == [1, 0]
        # A due time 45 s ahead: refused, not stored; within a second of it: granted.
        assert _dispatch(client, claim, ("a", now + 45_000, "0")) == [1, 0]
        assert _dispatch(client, claim, ("a", now + 500, "0")) == [1, 1]
        stored = client.hget(ClaimKeys.of("beat:x").beat, field).decode()
        assert stored == f"{now + 500}:{claim.fence}:pending"


def test_a_due_time_after_a_first_seen_mark_needs_no_gap(server: RedisServer) -> None:
    client = server.client()
    with Claim(client, "beat:x", ttl=5, heartbeat=False) as claim:
        base = ms(2026, 1, 15, 8, 59, 30)
        # First seen 30 s before 9:00: 9:00 runs (nothing ran at the mark to be too near).
        assert _dispatch(client, claim, ("a", base, "skip")) == [1, 0]
        assert _dispatch(client, claim, ("a", base + 30_000, str(12 * 3_600_000))) == [1, 1]
        # After a run the gap holds.
        assert _dispatch(client, claim, ("a", base + 60_000, str(12 * 3_600_000))) == [1, 0]


def test_a_successor_of_a_leader_whose_clock_ran_ahead_sends_on_time(
    server: RedisServer, sent: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    client = server.client()
    app = _app(server.url, "skew", {"a": schedule(1.0)})
    keys = ClaimKeys.of("beat:skew")
    # The entry ran 5 s ago (under an old leader's fence).
    client.hset(keys.beat, "entry:a", f"{_redis_ms(client) - 5_000}:1:sent")
    fast = Scheduler(app)
    fast.wall = lambda: time.time() + 45.0  # 45 s ahead of Redis's clock
    with caplog.at_level(logging.WARNING, logger="fenced.beat"):
        for _ in range(3):
            fast.tick()
    assert fast.leading
    assert "ahead of Redis" in caplog.text
    stored = status(client, "skew").entries["a"]
    assert stored.due_ms <= _redis_ms(client) + 1_000, "a due time in Redis's future was stored"
    # Every tick it sent was due by Redis's clock (within its tolerance), not 45 s early.
    for tid in sent:
        assert int(tid.rsplit(":", 1)[1]) <= _redis_ms(client) + 1_000, tid
    # It dies (its lease ends); a beat with a correct clock leads next.
    claim = fast._claim
    assert claim is not None
    claim.release()
    fast._claim = None
    sent.clear()
    successor = Scheduler(app)
    try:
        successor.tick()
        assert successor.leading
        # The entry's next tick comes within its period of Redis's clock, not 45 s on.
        deadline = time.monotonic() + 3.0
        while not sent and time.monotonic() < deadline:
            time.sleep(min(successor.tick(), 0.2))
        assert sent, "the successor sent nothing for 3 s of an every-second entry"
    finally:
        successor.close()


# -- what a writer of the claims' Redis planted ----------------------------------------------

PLANTED = {
    "superscript digits": "\u00b2:\u00b3:sent".encode(),
    "digits past int()'s limit": b"9" * 4400 + b":1:sent",
    "a due time past year 9999": b"999999999999999:1:sent",
    "a fence past 2**63": b"1700000000000:" + b"9" * 30 + b":sent",
    "not UTF-8": b"\xff\xfe:1:sent",
    "a state of escapes": b"1700000000000:1:\x1b[2J",
}


@pytest.mark.parametrize("case", list(PLANTED))
def test_a_leader_reads_past_planted_state_and_sends(
    case: str, server: RedisServer, sent: list[str]
) -> None:
    client = server.client()
    keys = ClaimKeys.of("beat:planted")
    client.hset(keys.beat, mapping={"entry:a": PLANTED[case], "tick": PLANTED[case]})
    beat = Scheduler(_app(server.url, "planted", {"a": schedule(1.0)}))
    try:
        deadline = time.monotonic() + 5.0
        while not sent and time.monotonic() < deadline:
            time.sleep(min(beat.tick(), 0.2))
        assert beat.leading, "the leader gave up the lead over a planted value"
        assert sent, "nothing sent for 5 s of an every-second entry"
        assert status(client, "planted").entries["a"].state in ("pending", "sent")
    finally:
        beat.close()

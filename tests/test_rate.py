"""Rate limits (``rate="10/m"``): N starts per period of a name, across every process.

Against a Redis the module owns. The starts are timed by Redis's own clock (the
script's TIME): a test moves the client's clock, never sleeps a period out, and reads
the spacing of starts from their fences (minted from the same TIME, in µs).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import pytest
import redis

from _clock import ManualClock
from _wait import wait_for
from celery_harness import WAIT, key
from fenced import Claim, ClaimHeld, ClaimOptions, ConfigError, Skipped, aio, events, exclusive
from fenced._lease import ClaimKeys
from fenced.testing import RedisServer


@pytest.fixture
def rc(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(decode_responses=True)
    yield client
    client.close()


def _next_start(client: Any, name: str) -> int | None:
    """When the rate key says the name's next start is allowed (Redis TIME, µs)."""
    value = client.get(ClaimKeys.of(name).rate)
    return None if value is None else int(value)


def _forget_starts(client: Any, name: str) -> None:
    """As if the window since the name's last start had passed."""
    keys = ClaimKeys.of(name)
    client.delete(keys.rate, keys.rate_starts)


def _starts(client: Any, name: str) -> dict[str, int]:
    """What the name's rate counts: each start granted (by fence) and booked
    ("b:<task id>"), with its time (Redis TIME, µs)."""
    return {
        member: int(score)
        for member, score in client.zrange(ClaimKeys.of(name).rate_starts, 0, -1, withscores=True)
    }


def _move(client: Any, name: str, by_us: int, member: str | None = None) -> None:
    """Move the counted starts (or one of them) ``by_us`` µs, as if time had passed."""
    starts = ClaimKeys.of(name).rate_starts
    for who, at in _starts(client, name).items():
        if member is None or who == member:
            client.zadd(starts, {who: at + by_us})
    client.delete(ClaimKeys.of(name).rate)  # it is written again by the next call


# -- the option --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["10/d", "ten/m", "0/s", "10", 10, "1.5/m", "/m", True])
def test_a_bad_rate_is_refused_naming_the_fix(bad: Any) -> None:
    with pytest.raises(ConfigError, match=r"'N/s', 'N/m' or 'N/h'.*rate='10/m'"):
        ClaimOptions(rate=bad)
    with pytest.raises(ConfigError, match=r"rate="):
        exclusive("x", redis="redis://127.0.0.1:1", rate=bad)


def test_a_rate_is_one_start_per_interval_rounded_up() -> None:
    assert ClaimOptions(rate="10/m").rate_us == 6_000_000
    assert ClaimOptions(rate=" 3 / s ").rate_us == 333_334  # never faster than asked
    assert ClaimOptions(rate="1/h").rate_us == 3_600_000_000
    assert ClaimOptions().rate_us == 0


def test_a_rate_counts_n_starts_in_a_window_of_its_period_or_spreads_them() -> None:
    def window(**given: Any) -> tuple[int, int]:
        options = ClaimOptions(**given)
        return options.rate_per, options.rate_window_us

    assert window(rate="10/m") == (10, 60_000_000)
    assert window(rate="3/s") == (3, 1_000_000)
    assert window(rate="1/h") == (1, 3_600_000_000)
    # Spread: one start in any window of period/N, rounded up.
    assert window(rate="10/m", rate_spread=True) == (1, 6_000_000)
    assert window(rate=" 3 / s ", rate_spread=True) == (1, 333_334)
    assert window() == (0, 0)


def test_a_window_too_large_to_keep_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"rate='20000/h'.*rate_spread=True"):
        ClaimOptions(rate="20000/h")
    assert ClaimOptions(rate="20000/h", rate_spread=True).rate_per == 1
    assert ClaimOptions(rate="10000/h").rate_per == 10_000
    with pytest.raises(ConfigError, match=r"rate_spread='yes' must be True"):
        ClaimOptions(rate="1/m", rate_spread="yes")  # type: ignore[arg-type]


def test_replace_does_not_take_a_rate(rc: redis.Redis) -> None:
    with pytest.raises(ConfigError, match=r"on_busy='replace' does not take a rate"):
        exclusive("x", redis="redis://127.0.0.1:1", on_busy="replace", rate="1/m")
    with pytest.raises(ConfigError, match=r"replace does not take a rate"):
        Claim(rc, key(), rate="1/m").replace()


# -- the script --------------------------------------------------------------------------


def test_the_client_clock_plays_no_part(rc: redis.Redis, fake_time: ManualClock) -> None:
    name = key()
    first = Claim(rc, name, rate="1/h", clock=fake_time)
    assert first.acquire()
    first.release()
    fake_time.advance(7200.0)  # two periods by the client's clock: none by Redis's
    again = Claim(rc, name, rate="1/h", clock=fake_time)
    assert not again.acquire()
    assert again.holder is None and again.throttled is not None
    assert 3500 < again.throttled <= 3600
    assert not again.held
    # The key lives until the next start is allowed, and holds that time.
    assert 0 < rc.pttl(ClaimKeys.of(name).rate) <= 3_600_000
    assert _next_start(rc, name) is not None


def test_a_busy_call_takes_no_start_and_a_limited_one_no_lease(rc: redis.Redis) -> None:
    name = key()
    holder = Claim(rc, name, rate="1/h")
    assert holder.acquire()
    _forget_starts(rc, name)  # as if the hour had passed
    busy = Claim(rc, name, rate="1/h")
    assert not busy.acquire()
    assert busy.holder is not None and busy.throttled is None  # busy, not rate limited
    assert _next_start(rc, name) is None  # the busy call took no start
    holder.release()
    assert Claim(rc, name, rate="1/h").acquire()  # the start the busy call did not take
    # Two at a time and at most one an hour: the free slot is not taken.
    other = key()
    one, two = Claim(rc, other, rate="1/h", limit=2), Claim(rc, other, rate="1/h", limit=2)
    assert one.acquire()
    assert not two.acquire() and two.throttled is not None and two.holder is None
    keys = ClaimKeys.of(other)
    assert rc.exists(keys.slot(0)) + rc.exists(keys.slot(1)) == 1
    one.release()


def _starts_of(name: str, calls: int, **options: Any) -> list[int]:
    """The fences (Redis TIME, µs) of ``calls`` waiting calls of ``name`` in a row."""

    @exclusive(name, redis=options.pop("rc"), on_busy="wait", wait_timeout=WAIT, **options)
    def work() -> None:
        pass

    seen: list[int] = []
    unsubscribe = events.subscribe(
        lambda e: seen.append(e.fence or 0) if e.kind == "acquired" and e.name == name else None
    )
    try:
        for _ in range(calls):
            work()
    finally:
        unsubscribe()
    assert len(seen) == calls
    return sorted(seen)


def test_spread_starts_are_one_interval_apart(rc: redis.Redis) -> None:
    """A rate of 20/s spread, on a claim of limit 3: every start is 50 ms (by Redis)
    after the last, however many callers wait for it."""
    fences = _starts_of(key(), 8, rc=rc, rate="20/s", rate_spread=True, limit=3)
    assert all(b - a >= 50_000 for a, b in pairwise(fences))


def test_a_window_lets_n_go_at_once_and_no_more_within_it(rc: redis.Redis) -> None:
    """4/s: eight callers waiting; four start at once, the next four a second after."""
    fences = _starts_of(key(), 8, rc=rc, rate="4/s", limit=3)
    assert all(fences[i + 4] - fences[i] >= 1_000_000 for i in range(4))
    assert fences[3] - fences[0] < 500_000  # at once, as fast as the calls come


# -- booked starts (fenced.celery's claim_rate_policy="delay") ----------------------------


def _booker(
    rc: redis.Redis,
    name: str,
    task_id: str,
    rate: str = "1/h",
    hold: float = 60.0,
    spread: bool = False,
) -> Claim:
    """A claim for ``task_id`` that books a start when it is over the rate."""
    claim = Claim(
        rc, name, rate=rate, rate_spread=spread, limit=2, task_id=task_id, heartbeat=False
    )
    claim.booking = hold
    return claim


def _one_start(rc: redis.Redis, name: str, rate: str, spread: bool = False) -> None:
    """A start of the name, released at once."""
    first = Claim(rc, name, rate=rate, rate_spread=spread, limit=2, heartbeat=False)
    assert first.acquire()
    first.release()


def _booked_at(rc: redis.Redis, name: str, task_id: str) -> int | None:
    return _starts(rc, name).get(f"b:{task_id}")


def _now_us(rc: redis.Redis) -> int:
    seconds, micros = rc.time()
    return seconds * 1_000_000 + micros


def test_successive_bookings_get_successive_starts(rc: redis.Redis) -> None:
    name = key()
    assert Claim(rc, name, rate="1/h", limit=2).acquire()
    first_free = _next_start(rc, name)
    assert first_free is not None
    booked = []
    for task_id in ("a", "b", "c"):
        claim = _booker(rc, name, task_id)
        assert not claim.acquire() and claim.holder is None
        assert claim.booked is not None and claim.booked == claim.throttled
        booked.append(_booked_at(rc, name, task_id))
    # One interval apart from the first free start on; the next free start after them.
    hour = 3_600_000_000
    assert booked == [first_free, first_free + hour, first_free + 2 * hour]
    assert _next_start(rc, name) == first_free + 3 * hour
    # Asking again keeps a booking where it is: no second start is booked for a task id.
    again = _booker(rc, name, "b")
    assert not again.acquire() and again.booked is not None
    assert 3600 < again.booked <= 7200
    assert _booked_at(rc, name, "b") == first_free + hour
    assert _next_start(rc, name) == first_free + 3 * hour
    # A call that books nothing is told when the next free start is: after the bookings.
    plain = Claim(rc, name, rate="1/h", limit=2)
    assert not plain.acquire() and plain.booked is None
    assert plain.throttled is not None and plain.throttled > 3 * 3600 - 60
    # The counted starts live as long as the latest of them counts.
    assert 3 * 3600_000 < rc.pttl(ClaimKeys.of(name).rate_starts) <= 4 * 3600_000


def test_bookings_drain_one_every_period_over_n(rc: redis.Redis) -> None:
    """3/m: three starts at once; the calls booked after them start a minute after the
    first, then one every 20 s (never in bursts a claim's slots would find busy), and
    every window of a minute still holds three starts at most."""
    name = key()
    for _ in range(3):
        _one_start(rc, name, "3/m")
    first = min(_starts(rc, name).values())
    second = 1_000_000
    booked = []
    for task_id in ("a", "b", "c", "d", "e"):
        claim = _booker(rc, name, task_id, rate="3/m")
        assert not claim.acquire() and claim.booked is not None
        booked.append(_booked_at(rc, name, task_id))
    assert booked == [first + (60 + 20 * i) * second for i in range(5)]
    everything = sorted(_starts(rc, name).values())
    assert all(b - a >= 60 * second for a, b in zip(everything, everything[3:], strict=False))
    # A call that books nothing is told a minute after the third-latest booking.
    assert _next_start(rc, name) == (booked[2] or 0) + 60 * second


def test_a_booked_call_gets_its_start_and_nobody_else_does(rc: redis.Redis) -> None:
    name = key()
    hour = 3_600_000_000
    _one_start(rc, name, "1/h")
    assert not _booker(rc, name, "mine").acquire()
    next_free = _next_start(rc, name)
    # Its start has come (everything moved an hour back, as if the hour had passed).
    _move(rc, name, -hour)
    assert not Claim(rc, name, rate="1/h", limit=2).acquire()  # not theirs to take
    mine = _booker(rc, name, "mine")
    assert mine.acquire() and mine.booked is None
    # Not counted again: the booking became the start (its fence), nothing else moved.
    starts = _starts(rc, name)
    # (the first start, an hour back now, no longer counts)
    assert starts == {str(mine.fence): starts[str(mine.fence)]}
    assert next_free is not None and _next_start(rc, name) == starts[str(mine.fence)] + hour
    mine.release()


def test_a_late_booked_start_still_keeps_the_window(rc: redis.Redis) -> None:
    """A booked call that comes late starts later than booked; the next booked call,
    on time, is then told to wait until the window lets the late one go."""
    name = key()
    hour = 3_600_000_000
    _one_start(rc, name, "1/h")
    assert not _booker(rc, name, "late").acquire()
    assert not _booker(rc, name, "next").acquire()
    # "late" comes half an hour after its start (held that long), "next" on time.
    _move(rc, name, -hour - hour // 2)
    late = _booker(rc, name, "late", hold=7200.0)
    assert late.acquire()
    _move(rc, name, -hour // 2, "b:next")  # its start has come
    after = _booker(rc, name, "next", hold=7200.0)
    assert not after.acquire() and after.booked is not None
    assert 3500 < after.booked <= 3600  # an hour after the late start, not its booking
    assert _booked_at(rc, name, "next") == _starts(rc, name)[str(late.fence)] + hour
    late.release()


def test_a_booked_call_that_comes_early_is_told_to_wait(rc: redis.Redis) -> None:
    name = key()
    assert Claim(rc, name, rate="1/h", limit=2).acquire()
    assert not _booker(rc, name, "early").acquire()
    start = _booked_at(rc, name, "early")
    early = _booker(rc, name, "early")
    assert not early.acquire() and early.booked is not None and 3500 < early.booked <= 3600
    assert _booked_at(rc, name, "early") == start  # still its own start


def test_an_unused_booking_voids_and_blocks_no_later_start(rc: redis.Redis) -> None:
    """A booking nobody comes for holds its one start, then is void ``hold`` after it."""
    name = key()
    _one_start(rc, name, "2/s", spread=True)
    gone = _booker(rc, name, "gone", rate="2/s", hold=0.05, spread=True)
    assert not gone.acquire() and gone.booked is not None and gone.booked <= 0.5
    first = _booked_at(rc, name, "gone")
    assert first is not None
    wait_for("the next free start", lambda: not rc.exists(ClaimKeys.of(name).rate), 5.0)
    # Nothing holds it back: the start after the booking's.
    assert Claim(rc, name, rate="2/s", rate_spread=True, limit=2).acquire()
    # Its call, come later than the hold, is a new call: over the rate now, it books anew.
    assert _now_us(rc) > first + 50_000
    late = _booker(rc, name, "gone", rate="2/s", hold=0.05, spread=True)
    assert not late.acquire() and late.booked is not None
    assert (_booked_at(rc, name, "gone") or 0) > first + 400_000
    # Nothing outlives what it counts for: the set expires with its latest start.
    wait_for("the starts to expire", lambda: not rc.exists(ClaimKeys.of(name).rate_starts), 5.0)


def test_a_booking_let_go_frees_its_start_for_a_later_call(rc: redis.Redis) -> None:
    """RATE_UNBOOK (a booked call that will never come: its message expired): the
    booking goes, the rate key is written as ACQUIRE writes it, and the start is free."""
    name = key()
    keys = ClaimKeys.of(name)
    hour = 3_600_000_000
    _one_start(rc, name, "1/h")
    first_free = _next_start(rc, name)
    assert first_free is not None
    for task_id in ("stays", "goes"):
        assert not _booker(rc, name, task_id).acquire()
    assert _booked_at(rc, name, "stays") == first_free
    assert _booked_at(rc, name, "goes") == first_free + hour
    assert _next_start(rc, name) == first_free + 2 * hour
    # The latest booking goes: one window after the start now latest ("stays").
    assert _booker(rc, name, "goes").unbook()
    assert "b:goes" not in _starts(rc, name) and _booked_at(rc, name, "stays") == first_free
    assert _next_start(rc, name) == first_free + hour
    assert 0 < rc.pttl(keys.rate) <= 2 * 3_600_000
    # Nothing to let go of a second time: nothing is written.
    rc.set(keys.rate, "1")
    assert not _booker(rc, name, "goes").unbook()
    assert rc.get(keys.rate) == "1"
    rc.delete(keys.rate)
    # A later call gets the start freed: booked at it, where "goes" was not.
    later = _booker(rc, name, "later")
    assert not later.acquire() and later.booked is not None
    assert _booked_at(rc, name, "later") == first_free + hour
    assert _next_start(rc, name) == first_free + 2 * hour
    # No start left counting ("later" let go, the first start moved two windows back,
    # then "stays" let go): the rate key is deleted, as ACQUIRE deletes it.
    assert _booker(rc, name, "later").unbook()
    _move(rc, name, -2 * hour)
    rc.set(keys.rate, "1")
    assert _booker(rc, name, "stays").unbook()
    assert not rc.exists(keys.rate)
    assert Claim(rc, name, rate="1/h", limit=2).acquire()


def test_a_booking_let_go_leaves_the_next_start_a_window_after_the_nth_latest(
    rc: redis.Redis,
) -> None:
    """3/m: the rate key after a booking goes is one minute after the third-latest start
    left, as ACQUIRE's publish() writes it."""
    name = key()
    second = 1_000_000
    for _ in range(3):
        _one_start(rc, name, "3/m")
    first = min(_starts(rc, name).values())
    for task_id in ("a", "b", "c", "d", "e"):
        assert not _booker(rc, name, task_id, rate="3/m").acquire()
    assert _next_start(rc, name) == first + (100 + 60) * second  # after "c", at 100 s
    assert _booker(rc, name, "e", rate="3/m").unbook()
    assert _next_start(rc, name) == first + (80 + 60) * second  # after "b"
    assert _booker(rc, name, "c", rate="3/m").unbook()
    assert _next_start(rc, name) == first + (60 + 60) * second  # after "a"
    assert set(_starts(rc, name)) >= {"b:a", "b:b", "b:d"}
    assert not {"b:c", "b:e"} & set(_starts(rc, name))


def test_the_acquire_call_sends_the_window_and_its_count(rc: redis.Redis) -> None:
    name = key()
    keys = ClaimKeys.of(name)
    claim = Claim(rc, name, rate="1/h", task_id="t")
    _script, sent, args = claim._acquire_call("tok", False, False)
    assert sent[-2:] == (keys.rate, keys.rate_starts)
    assert len(args) == 13 and args[-1] == 3_600_000_000
    claim.booking = 2.0
    _script, sent, args = claim._acquire_call("tok", False, False)
    assert sent[-2:] == (keys.rate, keys.rate_starts) and args[-1] == 2000
    # Without a task id there is nothing to book for.
    untold = Claim(rc, name, rate="1/h")
    untold.booking = 2.0
    assert len(untold._acquire_call("tok", False, False)[2]) == 13
    # A window of more than one start sends its count last.
    _script, sent, args = Claim(rc, name, rate="3/m")._acquire_call("tok", False, False)
    assert args[-3:] == [60_000_000, "", 3]


# -- N in any window of one period --------------------------------------------------------


@pytest.mark.parametrize(("spread", "ran"), [(False, 3), (True, 1)])
def test_eight_calls_at_once_on_3_a_minute(rc: redis.Redis, spread: bool, ran: int) -> None:
    name = key()

    @exclusive(name, redis=rc, rate="3/m", rate_spread=spread)
    def work() -> str:
        return "ran"

    results = [work() for _ in range(8)]
    assert results.count("ran") == ran
    skipped = [r for r in results if isinstance(r, Skipped)]
    assert len(skipped) == 8 - ran and all(s.reason == "rate limited" for s in skipped)
    # Told when the window allows the next: a minute after the first start, or 20 s.
    expected = 20 if spread else 60
    assert all(s.expires_in is not None and expected - 1 < s.expires_in <= expected
               for s in skipped)  # fmt: skip


def test_the_window_slides(rc: redis.Redis) -> None:
    """2/h: a start half an hour ago and one a quarter ago; the next when the first
    leaves the window (in half an hour), then the one after when the second does."""
    name = key()
    hour = 3_600_000_000
    _one_start(rc, name, "2/h")
    _move(rc, name, -hour // 2)
    _one_start(rc, name, "2/h")
    second = max(_starts(rc, name).values())
    _move(rc, name, -hour // 4, next(m for m, t in _starts(rc, name).items() if t == second))
    third = Claim(rc, name, rate="2/h", limit=2)
    assert not third.acquire() and third.throttled is not None
    assert 1790 < third.throttled <= 1800  # when the first start leaves the window
    _move(rc, name, -hour // 2 - 1)  # half an hour on: the first has left the window
    assert Claim(rc, name, rate="2/h", limit=2, heartbeat=False).acquire()
    fourth = Claim(rc, name, rate="2/h", limit=2)
    assert not fourth.acquire() and fourth.throttled is not None
    assert 890 < fourth.throttled <= 900  # the second leaves a quarter hour later


def test_a_fixed_window_edge_lets_no_more_through(rc: redis.Redis) -> None:
    """No 2N across a window's edge: 3/m, three starts late in one minute, and none
    early in the next."""
    name = key()
    for _ in range(3):
        _one_start(rc, name, "3/m")
    _move(rc, name, -50_000_000)  # 50 s ago: the "next minute" began 10 s ago
    late = Claim(rc, name, rate="3/m", limit=2)
    assert not late.acquire() and late.throttled is not None and 9 < late.throttled <= 10


def test_the_policies(rc: redis.Redis) -> None:
    name = key()

    @exclusive(name, redis=rc, rate="1/h")
    def skip() -> str:
        return "ran"

    assert skip() == "ran"
    skipped = skip()
    assert isinstance(skipped, Skipped) and not skipped
    assert skipped.reason == "rate limited" and skipped.holder is None
    assert skipped.expires_in is not None and 3500 < skipped.expires_in <= 3600
    assert "rate limited; the next start is allowed in" in str(skipped)

    @exclusive(name, redis=rc, rate="1/h", on_busy="raise")
    def refuse() -> str:
        return "ran"

    with pytest.raises(ClaimHeld, match=r"is rate limited; the next start is allowed in"):
        refuse()
    with pytest.raises(ClaimHeld, match=r"rate limited"), Claim(rc, name, rate="1/h"):
        pass

    @exclusive(name, redis=rc, rate="1/h", on_busy="wait", wait_timeout=0.2)
    def wait() -> str:
        return "ran"

    with pytest.raises(ClaimHeld, match=r"rate limited.* after waiting 0.2s"):
        wait()


def test_the_throttled_event(rc: redis.Redis) -> None:
    name = key()
    seen: list[events.ClaimEvent] = []
    unsubscribe = events.subscribe(lambda e: seen.append(e) if e.name == name else None)
    try:
        assert Claim(rc, name, rate="1/h").acquire()
        assert not Claim(rc, name, rate="1/h", limit=2).acquire()
    finally:
        unsubscribe()
    throttled = [e for e in seen if e.kind == "throttled"]
    assert len(throttled) == 1 and throttled[0].reason == "rate limited"
    assert throttled[0].duration is not None and throttled[0].duration > 3500
    assert not [e for e in seen if e.kind == "skipped"]


def test_the_throttled_metric(rc: redis.Redis) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    import fenced.metrics

    registry = CollectorRegistry()
    fenced.metrics.install(registry)
    try:
        name = key()
        assert Claim(rc, name, rate="1/h", label="hourly").acquire()
        assert not Claim(rc, name, rate="1/h", label="hourly", limit=2).acquire()
        labels = {"label": "hourly"}
        assert registry.get_sample_value("fenced_claims_throttled_total", labels) == 1
        assert not registry.get_sample_value(
            "fenced_claims_skipped_total", {**labels, "reason": "other"}
        )
    finally:
        fenced.metrics.uninstall()


def test_asyncio(redis_server: RedisServer) -> None:
    async def main() -> tuple[bool, bool, float | None]:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_server.url)
        try:
            name = key()
            first = aio.Claim(client, name, rate="1/h")
            took = await first.acquire()
            await first.release()
            second = aio.Claim(client, name, rate="1/h")
            return took, await second.acquire(), second.throttled
        finally:
            await client.aclose()

    took, again, throttled = asyncio.run(main())
    assert took and not again and throttled is not None and throttled > 3500


def test_cluster(cluster_server: RedisServer) -> None:
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        name = f"cl:{key()}"
        first = Claim(client, name, rate="1/h", limit=2, records=True)
        assert first.acquire()
        second = Claim(client, name, rate="1/h", limit=2, records=True, task_id="t")
        second.booking = 60.0  # its booking key in the name's slot too
        assert not second.acquire() and second.booked is not None
        first.release()
        assert b"b:t" in client.zrange(ClaimKeys.of(name).rate_starts, 0, -1)
        assert client.pttl(ClaimKeys.of(name).rate) > 0
    finally:
        client.close()


def test_fenced_run(redis_server: RedisServer) -> None:
    def run(*flags: str) -> tuple[int, str]:
        argv = [sys.executable, "-m", "fenced.cli", "run", name, "--redis", redis_server.url]
        done = subprocess.run([*argv, *flags, "--", "true"], capture_output=True, text=True)
        return done.returncode, done.stdout + done.stderr

    name = key()
    assert run("--rate", "1/h") == (0, "")
    code, said = run("--rate", "1/h")
    assert code == 0 and "rate limited" in said
    code, said = run("--rate", "1/h", "--on-busy", "raise")
    assert code == 75 and "rate limited" in said
    spread = key()
    argv = [sys.executable, "-m", "fenced.cli", "run", spread, "--redis", redis_server.url]
    told = [
        subprocess.run([*argv, *flags, "--", "true"], capture_output=True, text=True).stderr
        for flags in (["--rate", "2/h"], ["--rate", "2/h", "--rate-spread"])
    ]
    assert told[0] == "" and re.search(
        r"rate limited; the next start is allowed in 1[78]\d\ds", told[1]
    )
    code, said = run("--rate", "10/d")
    assert code != 0 and "--rate='10/d'" in said and "'N/s', 'N/m' or 'N/h'" in said


@pytest.mark.parametrize("booking", [False, True])
def test_an_acquire_over_a_rate_still_handles_its_enqueue_marker(
    rc: redis.Redis, booking: bool
) -> None:
    # The marker is the last key but the rate's (two, or three with a booking): a run's
    # acquire handles it first, whatever the answer, rate limited or granted.
    name = key()
    queued = ClaimKeys.of(name).queued
    _one_start(rc, name, "1/h")
    rc.set(queued, "t1", px=3_600_000)
    claim = Claim(rc, name, rate="1/h", limit=2, task_id="t1", heartbeat=False)
    if booking:
        claim.booking = 60.0
    claim.handle_enqueue_marker("5000", True)
    assert not claim.acquire()  # over the rate
    assert rc.get(queued) == "t1" and 0 < rc.pttl(queued) <= 5_000
    other = Claim(rc, name, rate="1/h", limit=2, task_id="t2", heartbeat=False)
    other.handle_enqueue_marker("-", False)
    assert not other.acquire()  # not its marker: left alone
    assert rc.get(queued) == "t1"
    claim.handle_enqueue_marker("-", False)
    assert not claim.acquire()
    assert rc.get(queued) is None


@pytest.mark.parametrize("rate", [None, "1/h"])
def test_a_refused_acquire_keeps_the_marker_a_granted_one_deletes(
    rc: redis.Redis, rate: str | None
) -> None:
    """``"~"``: the marker goes with the grant only; a call refused (busy, or over the
    rate) keeps it, for the message it puts back (no gap a duplicate could slip into)."""
    name = key()
    queued = ClaimKeys.of(name).queued
    holder = Claim(rc, name, rate=rate, limit=2, heartbeat=False)
    assert holder.acquire()  # over the rate now, or (limit 1 below) busy
    rc.set(queued, "t1", px=3_600_000)
    refused = Claim(rc, name, rate=rate, limit=1 if rate is None else 2, task_id="t1",
                    heartbeat=False)  # fmt: skip
    refused.handle_enqueue_marker("~", False)
    assert not refused.acquire()
    assert rc.get(queued) == "t1"
    holder.release()
    if rate is not None:
        _forget_starts(rc, name)
    granted = Claim(rc, name, rate=rate, task_id="t1", heartbeat=False)
    granted.handle_enqueue_marker("~", False)
    assert granted.acquire()  # the plain claim's common grant, or the rate's
    assert rc.get(queued) is None
    granted.release()

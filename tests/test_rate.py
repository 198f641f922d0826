"""Rate limits (``rate="10/m"``): N starts per period of a name, across every process.

Against a Redis the module owns. The starts are timed by Redis's own clock (the
script's TIME): a test moves the client's clock, never sleeps a period out, and reads
the spacing of starts from their fences (minted from the same TIME, in µs).
"""

from __future__ import annotations

import asyncio
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
    rc.delete(ClaimKeys.of(name).rate)  # as if the hour had passed
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


def test_starts_are_spaced_by_one_interval(rc: redis.Redis) -> None:
    """A rate of 20/s on a claim of limit 3: every start is 50 ms (by Redis) after the
    last, however many callers wait for it."""
    name = key()

    @exclusive(name, redis=rc, rate="20/s", limit=3, on_busy="wait", wait_timeout=WAIT)
    def work() -> None:
        pass

    seen: list[int] = []
    unsubscribe = events.subscribe(
        lambda e: seen.append(e.fence or 0) if e.kind == "acquired" and e.name == name else None
    )
    try:
        for _ in range(8):
            work()
    finally:
        unsubscribe()
    fences = sorted(seen)
    assert len(fences) == 8
    assert all(b - a >= 50_000 for a, b in pairwise(fences))


# -- booked starts (fenced.celery's claim_rate_policy="delay") ----------------------------


def _booker(
    rc: redis.Redis, name: str, task_id: str, rate: str = "1/h", hold: float = 60.0
) -> Claim:
    """A claim for ``task_id`` that books a start when it is over the rate."""
    claim = Claim(rc, name, rate=rate, limit=2, task_id=task_id, heartbeat=False)
    claim.booking = hold
    return claim


def _one_start(rc: redis.Redis, name: str, rate: str) -> None:
    """A start of the name, released at once: the next is an interval off."""
    first = Claim(rc, name, rate=rate, limit=2, heartbeat=False)
    assert first.acquire()
    first.release()


def _booked_at(rc: redis.Redis, name: str, task_id: str) -> int | None:
    value = rc.get(ClaimKeys.of(name).rate_booking(task_id))
    return None if value is None else int(value)


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


def test_a_booked_call_gets_its_start_and_nobody_else_does(rc: redis.Redis) -> None:
    name = key()
    keys = ClaimKeys.of(name)
    _one_start(rc, name, "1/h")
    rc.delete(keys.rate_last)  # as if the hour since the last start had passed
    assert not _booker(rc, name, "mine").acquire()
    next_free = _next_start(rc, name)
    # Its start has come (the booking rewritten to now, as if the hour had passed).
    rc.set(keys.rate_booking("mine"), _now_us(rc), keepttl=True)
    other = Claim(rc, name, rate="1/h", limit=2)
    assert not other.acquire() and other.throttled is not None  # not theirs to take
    mine = _booker(rc, name, "mine")
    assert mine.acquire() and mine.booked is None
    # Not counted again: the next free start stays where the booking put it.
    assert _next_start(rc, name) == next_free
    assert not rc.exists(keys.rate_booking("mine"))
    # The start granted is the last one: a second booking due now waits an interval.
    assert not _booker(rc, name, "next").acquire()
    rc.set(keys.rate_booking("next"), _now_us(rc), keepttl=True)
    after = _booker(rc, name, "next")
    assert not after.acquire() and after.booked is not None and 3500 < after.booked <= 3600
    mine.release()


def test_a_booked_call_that_comes_early_is_told_to_wait(rc: redis.Redis) -> None:
    name = key()
    assert Claim(rc, name, rate="1/h", limit=2).acquire()
    assert not _booker(rc, name, "early").acquire()
    start = _booked_at(rc, name, "early")
    early = _booker(rc, name, "early")
    assert not early.acquire() and early.booked is not None and 3500 < early.booked <= 3600
    assert _booked_at(rc, name, "early") == start  # still its own start


def test_an_unused_booking_voids_and_blocks_no_later_start(rc: redis.Redis) -> None:
    """A booking nobody comes for holds its one start, then expires ``hold`` after it."""
    name = key()
    keys = ClaimKeys.of(name)
    _one_start(rc, name, "20/s")
    gone = _booker(rc, name, "gone", rate="20/s", hold=0.05)
    assert not gone.acquire() and gone.booked is not None and gone.booked <= 0.05
    assert 0 < rc.pttl(keys.rate_booking("gone")) <= 100  # its start, then 50 ms
    wait_for("the booking to expire", lambda: not rc.exists(keys.rate_booking("gone")), 5.0)
    wait_for("the next free start", lambda: not rc.exists(keys.rate), 5.0)
    assert Claim(rc, name, rate="20/s", limit=2).acquire()  # nothing holds it back
    # Its call, come too late, is a new call: over the rate now, it books anew.
    late = _booker(rc, name, "gone", rate="20/s", hold=0.05)
    assert not late.acquire() and late.booked is not None and late.booked <= 0.05


def test_a_claim_without_booking_sends_no_booking_key(rc: redis.Redis) -> None:
    name = key()
    claim = Claim(rc, name, rate="1/h", task_id="t")
    _script, keys, args = claim._acquire_call("tok", False, False)
    assert keys[-2:] == (ClaimKeys.of(name).rate, ClaimKeys.of(name).rate_last)
    assert len(args) == 13
    claim.booking = 2.0
    _script, keys, args = claim._acquire_call("tok", False, False)
    assert keys[-1] == ClaimKeys.of(name).rate_booking("t") and args[-1] == 2000
    # Without a task id there is nothing to book for.
    untold = Claim(rc, name, rate="1/h")
    untold.booking = 2.0
    assert untold._acquire_call("tok", False, False)[1][-1] == ClaimKeys.of(name).rate_last


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
        assert client.exists(ClaimKeys.of(name).rate_booking("t"))
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

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
        second = Claim(client, name, rate="1/h", limit=2, records=True)
        assert not second.acquire() and second.throttled is not None
        first.release()
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

"""The core claim behaviours on a Redis Cluster and behind Sentinel, by URL.

The same checks as on one server (``test_claim.py``), run through the clients a
deployment gets from ``redis+cluster://`` and ``redis+sentinel://`` URLs: exclusivity
under a race, owner-only release and refresh, fences, run records, loss by a stolen
key, blocking waits, the operator's release, and 1,000 claims renewed by the heartbeat.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from _clock import ManualClock
from _wait import wait_for
from fenced import Claim, ClaimHeld, ClaimLost, force_release, read_holder, records
from fenced._client import connect
from fenced._heartbeat import heartbeat
from fenced._lease import short_token
from fenced.testing import RedisCluster, SentinelGroup


@pytest.fixture(scope="module")
def _sentinels() -> Iterator[SentinelGroup]:
    with SentinelGroup(service="fenced-core") as group:
        yield group


@pytest.fixture(params=["cluster", "sentinel"])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A client built from the topology's URL, on emptied servers."""
    if request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("ha_cluster")
        yield connect(cluster.startup_url, decode_responses=True)
    else:
        group: SentinelGroup = request.getfixturevalue("_sentinels")
        c = connect(group.url, decode_responses=True)
        c.flushall()
        yield c


def _race(client: Any, name: str, contenders: int) -> list[int]:
    """Who acquired ``name`` among ``contenders`` threads released at once."""
    barrier = threading.Barrier(contenders)
    won: list[int] = []

    def contend(i: int) -> None:
        claim = Claim(client, name, ttl=10, heartbeat=False)
        barrier.wait()
        if claim.acquire():
            won.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(contenders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won


def test_fifty_threads_race_and_exactly_one_wins(client: Any) -> None:
    for round_ in range(5):
        won = _race(client, f"race:{round_}", 50)
        assert len(won) == 1, won


def test_owner_only_release_and_refresh_and_increasing_fences(client: Any) -> None:
    fences = []
    for _ in range(50):
        claim = Claim(client, "owner", ttl=10, heartbeat=False)
        assert claim.acquire()
        fences.append(claim.fence or 0)
        other = Claim(client, "owner", ttl=10, heartbeat=False)
        assert not other.acquire()
        assert other.holder is not None and other.holder.token == short_token(claim.token)
        claim.release()
    assert fences == sorted(set(fences))
    mine = Claim(client, "owner", ttl=10, heartbeat=False)
    assert mine.acquire()
    client.set(mine.key, "someone-else:h:1:")  # taken over behind its back
    assert not mine.refresh()
    assert mine.lost
    assert client.get(mine.key) == "someone-else:h:1:"  # never touched
    assert mine.release() is False
    assert client.get(mine.key) == "someone-else:h:1:"


def test_with_raises_when_busy_and_records_each_run(client: Any) -> None:
    name = "recorded"
    with Claim(client, name, ttl=10, records=True) as held:
        with pytest.raises(ClaimHeld), Claim(client, name, ttl=10, records=True):
            raise AssertionError("the body of a busy claim ran")
        holder = read_holder(client, name)
        assert holder is not None and holder.token == short_token(held.token)
    runs = records.history(client, name)
    assert sorted(r.outcome for r in runs) == ["ok", "skipped"]
    assert read_holder(client, name) is None


def test_a_blocking_acquire_gets_the_claim_when_the_holder_releases(client: Any) -> None:
    holder = Claim(client, "queue", ttl=10)
    assert holder.acquire()
    threading.Timer(0.5, holder.release).start()
    waiter = Claim(client, "queue", ttl=10)
    start = time.monotonic()
    assert waiter.acquire(blocking=True, timeout=10)
    assert 0.3 < time.monotonic() - start < 5
    assert (waiter.fence or 0) > (holder.fence or 0)
    waiter.release()


def test_a_stolen_key_is_noticed_by_the_heartbeat(client: Any, fake_time: ManualClock) -> None:
    lost = threading.Event()
    claim = Claim(
        client, "stolen", ttl=2, refresh_every=0.3, on_lost=lambda _c: lost.set(), clock=fake_time
    )
    assert claim.acquire()
    client.delete(claim.key)
    fake_time.run_until("on_lost", lost.is_set, 2)
    with pytest.raises(ClaimLost):
        claim.check()


def test_the_operators_release_ends_the_run(client: Any) -> None:
    claim = Claim(client, "stuck", ttl=30, heartbeat=False, records=True)
    assert claim.acquire()
    cleared = force_release(client, "stuck", reason="operator")
    assert cleared is not None and cleared.token == short_token(claim.token)
    assert read_holder(client, "stuck") is None
    assert records.last(client, "stuck") is not None


def test_a_thousand_claims_renewed_in_pipelined_rounds(client: Any, fake_time: ManualClock) -> None:
    # On the clock the test moves, with a lease long enough that a round may take its
    # whole socket timeout (2 s of real time) on a loaded machine.
    claims = [
        Claim(client, f"held:{i}", ttl=15, refresh_every=5, records=False, clock=fake_time)
        for i in range(1000)
    ]
    for claim in claims:
        assert claim.acquire()
    try:
        beat = heartbeat()
        trips = beat.round_trips
        fake_time.run(45, every=0.5)  # three ttls
        assert not [c.name for c in claims if not c.held]
        # A few round trips per server and interval, never one per claim.
        assert beat.round_trips - trips < 9 * 12
        wait_for("all still held", lambda: all(c.held for c in claims), 1)
    finally:
        for claim in claims:
            claim.release()

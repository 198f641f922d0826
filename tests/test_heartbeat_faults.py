"""The heartbeat under faults: a partitioned server, two servers, many clients."""

from __future__ import annotations

import gc
import threading
import time

import redis

from _clock import ManualClock
from _wait import wait_for
from fenced import Claim
from fenced._heartbeat import heartbeat
from fenced.testing import RedisServer, TcpProxy


def _partitioned_client(proxy: TcpProxy) -> redis.Redis:
    # What a user may well have: redis-py's default retries (ten since redis-py 6) and a
    # generous socket timeout. The heartbeat must not inherit either.
    # (redis.Redis() has those retries; from_url() does not.)
    return redis.Redis(
        host="127.0.0.1", port=proxy.port, socket_timeout=5.0, socket_connect_timeout=5.0
    )


def test_a_black_holed_server_is_declared_lost_by_the_deadline_plus_one_interval(
    redis_server: RedisServer, fake_time: ManualClock
) -> None:
    with TcpProxy(redis_server.port) as proxy:
        client = _partitioned_client(proxy)
        lost_at: list[float] = []
        claim = Claim(
            client,
            "partitioned",
            ttl=3.0,
            on_lost=lambda _c: lost_at.append(fake_time()),
            clock=fake_time,
        )
        start = fake_time()
        assert claim.acquire()
        proxy.blackhole()
        try:
            # Each round waits out the heartbeat's own socket timeout in real time.
            fake_time.run_until("the loss", lambda: lost_at, 30)
        finally:
            proxy.heal()
        # The local deadline is about start + ttl; loss within one refresh interval of it.
        assert lost_at[0] - start <= claim.ttl + claim.refresh_every + 0.5
        assert claim.lost and not claim.held


def test_a_partitioned_server_never_delays_renewals_on_another(
    redis_server: RedisServer, server: RedisServer
) -> None:
    healthy_client = server.client()
    with TcpProxy(redis_server.port) as proxy:
        stuck = Claim(_partitioned_client(proxy), "stuck-side", ttl=2.0)
        healthy = Claim(healthy_client, "healthy-side", ttl=2.0)
        assert stuck.acquire() and healthy.acquire()
        proxy.blackhole()
        try:
            until = time.monotonic() + 3 * healthy.ttl
            while time.monotonic() < until:
                assert healthy.held, "a claim on a healthy server lost its lease"
                time.sleep(0.1)
            assert stuck.lost
            assert healthy_client.pttl(healthy.key) > 0
        finally:
            proxy.heal()
        healthy.release()


def test_clients_made_per_job_leave_no_connections_behind(
    server: RedisServer, fake_time: ManualClock
) -> None:
    admin = server.client()

    def connected() -> int:
        return int(admin.info("clients")["connected_clients"])

    before = connected()
    for i in range(100):
        client = server.client()
        claim = Claim(client, f"per-job:{i}", ttl=1.0, clock=fake_time)
        assert claim.acquire()
        fake_time.run(0.4, every=0.2)  # past its refresh time: renewed through the heartbeat
        claim.release()
        client.close()
        del client, claim
    gc.collect()
    wait_for(
        "the heartbeat's connections to close",
        lambda: connected() <= before + 4,
        timeout=30,
    )
    assert heartbeat().lanes() <= 4


def test_lanes_are_threads_of_their_own(server: RedisServer, fake_time: ManualClock) -> None:
    claim = Claim(server.client(), "lane-thread", ttl=1.0, clock=fake_time)
    assert claim.acquire()
    fake_time.run_until(
        "a renewal", lambda: heartbeat().round_trips > 0 and heartbeat().lanes() > 0, 1.0
    )
    names = {t.name for t in threading.enumerate()}
    assert "fenced-heartbeat" in names and "fenced-heartbeat-lane" in names
    claim.release()

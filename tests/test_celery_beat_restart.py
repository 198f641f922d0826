"""Real ``celery beat`` processes under fenced's scheduler: SIGTERM gives the lead up at
once, and a restart of the Redis that holds broker and claims (nothing persisted)
leaves a leader and a schedule that goes on, without a tick run twice."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from _beat import beats_and_worker, check_runs, drain, leader, runs, wait_runs
from _wait import wait_for
from celery_harness import Services
from fenced._inspect import read_holder
from fenced.testing import RedisServer

TTL = 1.5
GAP_MS = (TTL * 1.2 + 3.0) * 1000


@pytest.fixture
def restartable() -> Iterator[RedisServer]:
    """The broker's and the claims' Redis, which the test restarts empty."""
    srv = RedisServer().start()
    try:
        yield srv
    finally:
        srv.stop()


def _services(restartable: RedisServer, obs: RedisServer) -> Services:
    base = restartable.url.rsplit("/", 1)[0]
    return Services(
        broker_url=f"{base}/0",
        backend_url=f"{base}/1",
        lock_url=f"{base}/2",
        obs_url=obs.url.rsplit("/", 1)[0] + "/3",
    )


def test_sigterm_gives_up_the_lead_at_once(redis_server: RedisServer) -> None:
    services = Services.on(redis_server)
    with beats_and_worker(services, TTL) as beats:
        first = leader(services, beats)
        wait_runs(services, 3)
        first.signal(signal.SIGTERM)
        assert first.proc is not None
        assert first.proc.wait(30) == 0
        # Its lease was given back as it stopped: free, or already another beat's.
        holder = read_holder(services.locks(), "beat:tests")
        assert holder is None or holder.pid != first.pid
        leader(services, beats, not_pid=first.pid)
        wait_runs(services, 3)
        for beat in beats:
            beat.stop()
        drain(services)
    check_runs(runs(services), GAP_MS)


def test_a_redis_restart_without_persistence(
    restartable: RedisServer, redis_server: RedisServer
) -> None:
    services = _services(restartable, redis_server)
    with beats_and_worker(services, TTL) as beats:
        first = leader(services, beats)
        wait_runs(services, 4)
        restartable.restart()
        # Every beat stays up; one leads again (under a fence above the last) and sends.
        leader(services, beats)
        before = len(runs(services))
        wait_for("runs after the restart", lambda: len(runs(services)) >= before + 4, 60, 0.1)
        assert all(b.alive() for b in beats), [b.log()[-2000:] for b in beats]
        assert first.alive()
        for beat in beats:
            beat.stop()
        drain(services)
    check_runs(runs(services), GAP_MS)

"""Three real ``celery beat`` processes under fenced's scheduler and a real worker: the
leader is paused for several leases, then killed; every due tick runs once, or falls in
a gap bounded by the lease, and the paused leader stays up as a stand-by."""

from __future__ import annotations

import signal

from _beat import beats_and_worker, check_runs, drain, leader, runs, wait_runs
from _wait import wait_for
from celery_harness import Services
from fenced.testing import RedisServer

TTL = 1.5
#: A failover: the lease runs out, a stand-by polls (ttl/5), and a busy machine's slack.
GAP_MS = (TTL * 1.2 + 3.0) * 1000


def test_a_paused_then_killed_leader_is_replaced_without_double_runs(
    redis_server: RedisServer,
) -> None:
    services = Services.on(redis_server)
    with beats_and_worker(services, TTL) as beats:
        first = leader(services, beats)
        wait_runs(services, 4)
        first.signal(signal.SIGSTOP)
        second = leader(services, beats, not_pid=first.pid)
        wait_runs(services, 7)  # several leases: the new leader sends, the old one is stopped
        first.signal(signal.SIGCONT)
        wait_for(
            "the paused leader to stand by",
            lambda: "no longer leading" in first.log(),
            30.0,
            0.1,
        )
        assert leader(services, beats) is second
        wait_runs(services, 3)
        second.signal(signal.SIGKILL)
        third = leader(services, beats, not_pid=second.pid)
        wait_runs(services, 4)
        assert first.alive() and third.alive()
        for beat in beats:
            beat.stop()
        drain(services)
    dues = check_runs(runs(services), GAP_MS)
    assert all(len(dues[e]) >= 3 for e in ("every-1s", "every-2s", "claimed-2s")), dues

"""replicas=N: an acquire (and each renewal) waits for N replicas, or fails closed.

A real master and a real replica (``REPLICAOF``); the replica is paused with SIGSTOP
to stop it acknowledging.
"""

from __future__ import annotations

from typing import Any

import pytest

from _clock import ManualClock
from fenced import Claim, ClaimUnavailable, ConfigError
from fenced.testing import RedisServer


def _lock_keys(client: Any) -> list[bytes]:
    return list(client.scan_iter(match="fenced:lock:*"))


def test_acquire_waits_for_the_replica_and_the_lease_is_on_it(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    claim = Claim(master.client(), "replicated", ttl=10, replicas=1, heartbeat=False)
    assert claim.acquire()
    # WAIT returned only after the replica had the write.
    assert replica.client().get(claim.key) is not None
    claim.release()


def test_an_unacknowledged_acquire_removes_its_lease_and_fails_closed(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    client = master.client()
    replica.pause()
    try:
        claim = Claim(client, "unacked", ttl=10, replicas=1, replica_timeout=0.3, heartbeat=False)
        with pytest.raises(ClaimUnavailable, match="0 of the 1 replica"):
            claim.acquire()
        assert not claim.held
        assert _lock_keys(client) == []  # the lease it wrote was removed
        # Asking for more replicas than exist fails the same way.
        with pytest.raises(ClaimUnavailable, match="replica"):
            Claim(client, "two", ttl=10, replicas=2, replica_timeout=0.2).acquire()
        assert _lock_keys(client) == []
    finally:
        replica.resume()
    # Once the replica answers again, the same name can be taken.
    claim = Claim(client, "unacked", ttl=10, replicas=1, heartbeat=False)
    assert claim.acquire()
    claim.release()


def test_renewals_not_acknowledged_end_in_loss_by_the_deadline(
    pair: tuple[RedisServer, RedisServer], fake_time: ManualClock
) -> None:
    master, replica = pair
    lost: list[str] = []
    claim = Claim(
        master.client(),
        "renewed",
        ttl=2,
        refresh_every=0.5,
        replicas=1,
        replica_timeout=0.1,
        on_lost=lambda c: lost.append(c.lost_reason or ""),
        clock=fake_time,
    )
    assert claim.acquire()
    try:
        fake_time.run(2.5)  # several renewals, each acknowledged
        assert claim.held and not lost
        replica.pause()
        # Each round's WAIT takes its real 0.1 s; the deadline is the clock's.
        took = fake_time.run_until("the claim to be declared lost", lambda: bool(lost), 6)
        # By its deadline (ttl after the last confirmed renewal) plus one interval.
        assert took <= 2 + 0.5 + 0.5
        assert "deadline" in lost[0]
    finally:
        replica.resume()
        claim.release()


def test_manual_refresh_without_acknowledgement_is_unconfirmed(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    claim = Claim(
        master.client(), "manual", ttl=10, replicas=1, replica_timeout=0.2, heartbeat=False
    )
    assert claim.acquire()
    replica.pause()
    try:
        with pytest.raises(ClaimUnavailable, match="0 of the 1 replica"):
            claim.refresh()
        assert claim.held  # not lost: unconfirmed, until its deadline
    finally:
        replica.resume()
    assert claim.refresh()
    claim.release()


@pytest.mark.parametrize(
    ("replicas", "timeout", "match"),
    [
        (-1, 1.0, "whole number"),
        (True, 1.0, "whole number"),
        (1.5, 1.0, "whole number"),
        (1, 0, "seconds > 0"),
        (1, 20.0, "below half the ttl"),
    ],
)
def test_bad_replica_settings_name_the_fix(
    server: RedisServer, replicas: Any, timeout: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        Claim(server.client(), "x", ttl=30, replicas=replicas, replica_timeout=timeout)


def test_fenced_run_with_replicas_fails_closed_when_unacknowledged(
    pair: tuple[RedisServer, RedisServer], tmp_path: Any
) -> None:
    import subprocess
    import sys

    master, replica = pair
    marker = tmp_path / "ran"
    cmd = [sys.executable, "-m", "fenced.cli", "run", "--redis", master.url, "--replicas", "1"]
    body = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w').write('x')"]
    replica.pause()
    try:
        done = subprocess.run(
            [*cmd, "--replica-timeout", "0.3", "nightly", *body],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        replica.resume()
    assert done.returncode == 69, done.stderr
    assert "replica" in done.stderr and not marker.exists()
    assert _lock_keys(master.client()) == []
    done = subprocess.run([*cmd, "nightly", *body], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert marker.exists()


def test_celery_and_exclusive_take_replicas(pair: tuple[RedisServer, RedisServer]) -> None:
    from celery import Celery

    from fenced import exclusive
    from fenced.celery import ClaimedTask

    master, replica = pair
    app = Celery("fenced_replicas", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = master.url
    app.conf.fenced_claim_replicas = 1
    app.conf.fenced_claim_replica_timeout = 0.3
    app.finalize()

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="replicated:{t}")
    def task(self: Any, t: str) -> int:
        return int(replica.client().exists(self.claim.key))

    assert task("a") == 1  # the lease was on the replica before the body ran

    with pytest.raises(ConfigError, match="claim_replicas=-2 must be a whole number"):

        @app.task(shared=False, base=ClaimedTask, bind=True, claim="x", claim_replicas=-2)
        def bad(self: Any) -> None: ...

    @exclusive(name="job", redis=master.url, replicas=1, replica_timeout=0.3)
    def job() -> str:
        return "done"

    assert job() == "done"
    replica.pause()
    try:
        with pytest.raises(ClaimUnavailable, match="replica"):
            job()
    finally:
        replica.resume()


def test_a_claim_whose_replicas_stay_away_costs_its_neighbours_nothing(
    pair: tuple[RedisServer, RedisServer], fake_time: ManualClock
) -> None:
    """Renewals of claims with and without replicas share a round trip; a WAIT that
    gets no answer must not hold the others' replies past the socket timeout."""
    master, replica = pair
    client = master.client()
    lost: list[str] = []
    # refresh_every just under 2 s: the heartbeat's socket timeout is then 0.5 s.
    waiting = Claim(
        client, "waits", ttl=6, refresh_every=1.999, replicas=1, replica_timeout=1.0,
        on_lost=lambda c: lost.append(c.name), clock=fake_time,
    )  # fmt: skip
    plain = Claim(
        client,
        "plain",
        ttl=6,
        refresh_every=1.999,
        on_lost=lambda c: lost.append(c.name),
        clock=fake_time,
    )
    assert waiting.acquire() and plain.acquire()
    replica.pause()
    try:
        # One and a half ttls; each round's WAIT waits its real 0.25 s (half the socket
        # timeout) for the paused replica.
        fake_time.run(9, every=0.1)
        assert plain.held, lost
        assert client.pttl(plain.key) > 0
        assert lost == ["waits"]  # the claim that asked for the replica is lost
    finally:
        replica.resume()
        plain.release()
        waiting.release()


def test_a_skip_for_a_cooldown_or_a_rate_is_not_read_as_a_duplicate_delivery(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    """ACQUIRE's "ran recently" and "rate limited" answers carry no done marker: the
    replicas' count that follows them must not be read as one (a Celery task would be
    ignored as already completed instead of skipped, or put back for its booked start)."""
    master, _ = pair
    client = master.client()
    common: dict[str, Any] = {"ttl": 5, "replicas": 1, "heartbeat": False}
    common["redelivery_window"] = 60
    with Claim(client, "cooled", cooldown=60, task_id="a", **common):
        pass
    later = Claim(client, "cooled", cooldown=60, task_id="b", **common)
    assert not later.acquire()
    assert later.ran_recently and not later.completed_before
    first = Claim(client, "rated", rate="1/m", task_id="c", **common)
    assert first.acquire()
    first.release()
    over = Claim(client, "rated", rate="1/m", task_id="d", **common)
    assert not over.acquire()
    assert over.throttled and not over.completed_before


def test_a_claimed_task_inside_its_cooldown_with_replicas_returns_its_skip(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    """Not ignored as a duplicate delivery (no stored result: a caller would wait for
    ever): the Skipped result, as without replicas."""
    from celery import Celery

    import fenced
    from fenced.celery import ClaimedTask

    master, _ = pair
    app = Celery("fenced_replicas_cooldown", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = master.url
    app.conf.fenced_claim_replicas = 1
    app.finalize()

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="cooled-task", claim_cooldown=60)
    def task(self: Any) -> str:
        return "ran"

    assert task.apply(task_id="first").get() == "ran"
    second = task.apply(task_id="second")
    assert second.state == "SUCCESS" and fenced.is_skipped(second.get()), second.state
    assert "ran recently" in second.get()["reason"]

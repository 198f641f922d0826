"""The heartbeat: one thread per process renews every claim; loss is declared on time."""

from __future__ import annotations

import os
import threading
from typing import Any, cast

import pytest
import redis

from _clock import ManualClock
from _wait import WAIT, wait_for
from fenced import Claim, ClaimLost
from fenced._heartbeat import heartbeat
from fenced._scripts import RELEASE
from fenced.testing import RedisServer


def test_claim_survives_five_ttls_in_one_long_step(r: Any, fake_time: ManualClock) -> None:
    # Redis expires the lease in real time: a ttl of real seconds leaves the renewals
    # (every 20 steps of this clock) room on a loaded machine.
    c = Claim(r, "long-step", ttl=3.0, clock=fake_time)
    assert c.acquire()
    fake_time.run(15.0)  # one step, five times the ttl, no check() in between
    assert c.held
    c.check()
    raw = r.get(c.key)
    assert (raw.decode() if isinstance(raw, bytes) else raw) == c.token
    assert 0 < r.pttl(c.key) <= 3000
    assert c.release()


def test_two_hundred_claims_add_one_scheduler_and_one_lane(
    server: RedisServer, fake_time: ManualClock
) -> None:
    client = server.client()
    before = {t.ident for t in threading.enumerate()}
    # Renewed only as the test moves the clock, while Redis counts real seconds: a lease
    # long enough to outlast taking all 200 on a loaded machine.
    claims = [Claim(client, f"many:{i}", ttl=6.0, clock=fake_time) for i in range(200)]
    for c in claims:
        assert c.acquire()
    fake_time.run(15.0, every=0.25)  # two and a half ttls
    added = {t.ident for t in threading.enumerate()} - before
    assert len(added) <= 2  # the scheduler, and the lane of this one server
    assert all(c.held for c in claims)
    assert all(client.pttl(c.key) > 0 for c in claims)
    for c in claims:
        c.release()


def test_a_short_claim_taken_while_the_scheduler_rests_after_a_round_is_renewed(
    server: RedisServer, fake_time: ManualClock
) -> None:
    """After a round the scheduler sleeps till the sent claims' retry time; a claim with a
    shorter interval taken in that rest must wake it, or it would expire unrenewed."""
    client = server.client()
    hb = heartbeat()
    # Renewed every 20 s; the fast claim every 2 s, with socket timeouts (half its
    # interval) that a loaded machine still meets.
    slow = [Claim(client, f"slow:{i}", ttl=60.0, clock=fake_time) for i in range(50)]
    for c in slow:
        assert c.acquire()
    rounds = hb.rounds
    fake_time.run_until("a round of the slow claims", lambda: hb.rounds > rounds, 25, 0.5)
    # Taken the moment the round was sent, while the scheduler rests (7 s).
    fast = Claim(client, "fast", ttl=6.0, clock=fake_time)
    assert fast.acquire()
    fake_time.run(20.0, every=0.25)  # three times the rest, and several fast ttls
    assert fast.held, fast.lost_reason
    assert 0 < client.pttl(fast.key) <= 6000
    fast.release()
    for c in slow:
        c.release()


def test_a_claim_added_while_a_round_is_sent_wakes_the_rest_after_it(
    server: RedisServer, fake_time: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim added while the scheduler sends a round (no lock held, nobody waiting for
    the wake add() gives) must still cut the rest after that round short: held open
    here, the round's sending is where that wake used to be lost."""
    client = server.client()
    hb = heartbeat()
    slow = Claim(client, "slow", ttl=60.0, clock=fake_time)  # renewed every 20 s
    assert slow.acquire()
    fake_time.settle()
    sending, go = threading.Event(), threading.Event()
    send = hb._dispatch

    def held_open(due: Any) -> None:
        sending.set()
        go.wait(WAIT)
        send(due)

    monkeypatch.setattr(hb, "_dispatch", held_open)
    fake_time.advance(20.0)  # the slow claim falls due: its round is sent, and held
    assert sending.wait(WAIT)
    fast = Claim(client, "fast", ttl=6.0, clock=fake_time)  # renewed every 2 s
    assert fast.acquire()
    monkeypatch.setattr(hb, "_dispatch", send)
    go.set()
    fake_time.run(20.0, every=0.25)  # the rest after a round (7 s) outlasts the fast lease
    assert fast.held, fast.lost_reason
    fast.release()
    slow.release()


def test_renewals_are_pipelined(server: RedisServer, fake_time: ManualClock) -> None:
    client = server.client()
    hb = heartbeat()
    # A lease that outlasts taking all 500 in real time on a loaded machine (renewals
    # wait for the test to move the clock).
    claims = [Claim(client, f"pipe:{i}", ttl=9.0, clock=fake_time) for i in range(500)]
    for c in claims:
        c.acquire()
    rounds, trips = hb.rounds, hb.round_trips
    fake_time.run(20.0, every=0.25)  # about six refresh intervals
    done_rounds = hb.rounds - rounds
    done_trips = hb.round_trips - trips
    assert all(c.held for c in claims)
    # 500 claims over ~6 intervals: a handful of batched round trips, not 3,000.
    assert 0 < done_trips <= 40, (done_rounds, done_trips)
    for c in claims:
        c.release()


def test_forked_child_holds_none_of_the_parents_claims(server: RedisServer) -> None:
    client = server.client()
    c = Claim(client, "fork", ttl=0.6)
    assert c.acquire()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            report = [
                str(len(heartbeat())),
                str(c.held),
                str(c.release()),
                str(threading.active_count()),
            ]
            # Nobody renews the lease once the parent stops: it expires, by its ttl
            # (0.6 s) after the parent's last renewal, while the child still runs.
            expired = wait_for("the lease to expire", lambda: client.get(c.key) is None, 10)
            report.append(str(len(heartbeat())))
            report.append(str(expired))
            os.write(write_fd, ",".join(report).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    # The parent stops renewing; if the child renewed the lease, it would survive.
    heartbeat().discard(c)
    _, _status = os.waitpid(pid, 0)
    report = os.read(read_fd, 1000).decode().split(",")
    os.close(read_fd)
    assert report[0] == "0"  # empty registry in the child
    assert report[1] == "False"  # not held in the child
    assert report[2] == "False"  # and not released by the child
    assert report[4] == "0"
    assert report[5] == "True"  # the child saw it expire: it renewed nothing
    assert client.get(c.key) is None  # nobody renewed it: it expired
    c._state = "released"


def test_overwritten_key_is_lost_within_one_refresh_interval(
    r: Any, fake_time: ManualClock
) -> None:
    lost = threading.Event()
    c = Claim(r, "stolen", ttl=1.5, on_lost=lambda claim: lost.set(), clock=fake_time)
    assert c.acquire()
    r.set(c.key, "thief", px=10_000)
    took = fake_time.run_until("on_lost", lost.is_set, c.refresh_every + 0.5)
    assert took <= c.refresh_every + 0.5
    assert c.lost
    with pytest.raises(ClaimLost):
        c.check()
    assert c.release() is False
    assert r.get(c.key) in (b"thief", "thief")


def test_paused_redis_loss_declared_by_local_deadline(
    own_server: RedisServer, fake_time: ManualClock
) -> None:
    client = own_server.client()
    fired: list[float] = []
    c = Claim(
        client,
        "redis-paused",
        ttl=1.0,
        on_lost=lambda claim: fired.append(fake_time()),
        clock=fake_time,
    )
    assert c.acquire()
    acquired = fake_time()
    own_server.pause()
    try:
        # Each round waits out its socket timeout in real time; the deadline is the clock's.
        fake_time.run_until("on_lost to fire", lambda: bool(fired), 3.0)
        # Declared by the local deadline (ttl less drift), not after some reply.
        assert fired[0] - acquired <= 1.0 + 0.3
        with pytest.raises(ClaimLost):
            c.check()
    finally:
        own_server.resume()
    assert c.lost  # a lost claim never comes back, even though Redis is back


def test_redis_restart_while_held_is_loss(own_server: RedisServer, fake_time: ManualClock) -> None:
    client = own_server.client()
    lost = threading.Event()
    c = Claim(client, "restart-held", ttl=1.0, on_lost=lambda claim: lost.set(), clock=fake_time)
    assert c.acquire()
    own_server.restart()  # the lease is gone with the memory
    fake_time.run_until("on_lost", lost.is_set, 3.0)
    assert c.lost


def test_expiry_found_by_the_heartbeat_spares_a_lease_taken_again_meanwhile(
    r: Any, fake_time: ManualClock
) -> None:
    # The heartbeat finds expired claims under its lock and declares them lost after it
    # lets go (on_lost callbacks run there). A claim released and acquired again in
    # between holds a new lease, which the old expiry must not declare lost.
    again: list[bool] = []

    def take_b_again(_claim: Claim) -> None:
        b.release()
        again.append(b.acquire())

    a = Claim(r, "expired-a", ttl=30, on_lost=take_b_again, clock=fake_time)
    b = Claim(r, "expired-b", ttl=30, clock=fake_time)
    assert a.acquire() and b.acquire()
    hb = heartbeat()
    with hb._cond:
        # Both local deadlines pass at once, as after a long pause of this process.
        a._deadline = b._deadline = 0.0
        hb._cond.notify()
    # (Only the heartbeat looks at the deadlines here: no .lost or .held until done.)
    assert wait_for("b to be taken again", lambda: bool(again), timeout=5.0)
    fake_time.settle()  # the heartbeat is done with what it found, and sleeps again
    assert a.lost
    assert again == [True]
    assert b.held and not b.lost
    b.check()
    assert b.release()


class HookedRedis(redis.Redis):
    """A real client whose pipelines and RELEASE calls can pause at chosen points."""

    before_pipeline: Any = None
    after_release: Any = None

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        pipe = super().pipeline(*args, **kwargs)
        hook, execute = self.before_pipeline, pipe.execute
        if hook is not None:

            def hooked(*a: Any, **kw: Any) -> Any:
                hook()
                return execute(*a, **kw)

            pipe.execute = hooked  # type: ignore[method-assign]  # this one pipeline pauses
        return pipe

    def evalsha(self, sha: str, numkeys: int, *args: Any) -> Any:
        res = super().evalsha(sha, numkeys, *args)
        if sha == RELEASE.sha and self.after_release is not None:
            self.after_release()
        return res


def test_refresh_that_lands_after_release_does_not_declare_the_claim_lost(
    server: RedisServer,
) -> None:
    # A renewal in flight while the claim is released reaches Redis after the lease was
    # deleted and finds no lease. That is our own release, not a loss: no on_lost.
    # from_url builds the class it is called on; redis annotates it as returning Redis.
    client = cast(HookedRedis, HookedRedis.from_url(server.url))
    warm = Claim(client, "warm", ttl=3, heartbeat=False)  # the server has the scripts
    assert warm.acquire() and warm.release()
    fired: list[str | None] = []
    c = Claim(client, "release-vs-refresh", ttl=3, on_lost=lambda cl: fired.append(cl.lost_reason))
    assert c.acquire()
    in_round, released, round_done = threading.Event(), threading.Event(), threading.Event()

    def hold_round() -> None:
        client.before_pipeline = None
        in_round.set()
        released.wait(5)
        threading.Timer(0.3, round_done.set).start()  # time to judge the reply

    def after_release() -> None:
        released.set()
        round_done.wait(5)

    client.before_pipeline = hold_round
    client.after_release = after_release
    hb = heartbeat()
    with hb._cond:
        c._next_refresh = 0.0  # due now
        hb._cond.notify()
    assert in_round.wait(5)
    assert c.release()
    assert fired == []
    assert not c.lost


def test_forked_child_never_declares_the_parents_claim_lost(r: Any) -> None:
    # The child holds none of its parent's claims, so it cannot lose one either: no
    # on_lost in the child (it would act on the parent's work) and no ClaimLost.
    now = [100.0]
    fired: list[int] = []
    c = Claim(
        r,
        "fork-lost",
        ttl=5,
        heartbeat=False,
        clock=lambda: now[0],
        on_lost=lambda claim: fired.append(os.getpid()),
    )
    assert c.acquire()
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            now[0] += 60  # far past the parent's deadline
            try:
                c.check()
                checked = "ok"
            except Exception as exc:
                checked = type(exc).__name__
            report = [str(c.lost), str(len(fired)), checked]
            os.write(write_fd, ",".join(report).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    report = os.read(read_fd, 1000).decode().split(",")
    os.close(read_fd)
    assert report == ["False", "0", "NotOwner"]
    assert c.held and not fired
    assert c.release()


def test_renewals_never_go_through_a_pool_cloned_from_a_dead_client(
    server: RedisServer, own_server: RedisServer
) -> None:
    # The private pools are cached by the server they reach, never by the id of the
    # claim's pool: once that pool is gone, a new pool (which may get its id) on another
    # server gets a clone of its own, in every timeout bucket.
    from fenced._heartbeat import Heartbeat

    hb = Heartbeat()  # only its pool cache is used here
    first = own_server.client()
    hb._client_for(first, 1.0 / 3)
    del first
    second = server.client()
    hb._client_for(second, 30.0 / 3)  # another bucket first
    routed = hb._client_for(second, 1.0 / 3)
    assert routed.connection_pool.connection_kwargs.get("path") == server.socket_path

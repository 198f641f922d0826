"""Failover that stays fenced, and a heartbeat that renews a whole cluster.

The worst case of a failover is a write the master acknowledged and never replicated:
here the replica is paused (SIGSTOP) while fences are minted and a holder takes its
lease, then the master is killed and the replica resumed and promoted. The new master
never saw those fences; the ``TIME`` floor of ACQUIRE must still mint above them, the
holder must learn its lease is gone, and its fenced writes must be refused.

Clients are built from the ``redis+sentinel://`` and ``redis+cluster://`` URLs, as
Celery and the command line build them. Most claims here are renewed on a clock the
test moves (``fake_time``): a failover takes real seconds, the leases' deadlines count
only the steps the test makes; a test about delays in real time keeps real time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from _clock import ManualClock
from _wait import wait_for
from fenced import Claim, ClaimUnavailable, StaleFence
from fenced._client import connect
from fenced._heartbeat import heartbeat
from fenced.store import RedisPointer
from fenced.testing import RedisCluster, RedisServer, SentinelGroup

TTL = 3.0
EVERY = 0.5

T = TypeVar("T")


def _acquire_when_served(claim: Claim) -> bool:
    try:
        return claim.acquire()
    except ClaimUnavailable:
        return False


def _writes(client: Any, key: str) -> bool:
    try:
        client.set(key + ":probe", 1, px=100)
        return True
    except Exception:
        return False


class Holder:
    """A claim held with the heartbeat, noting when (on its clock) it is declared lost."""

    def __init__(self, client: Any, name: str, clock: ManualClock) -> None:
        self.lost_at: float | None = None
        self.lost = threading.Event()
        self.clock = clock
        self.claim = Claim(
            client, name, ttl=TTL, refresh_every=EVERY, on_lost=self._on_lost, clock=clock
        )

    def _on_lost(self, _claim: Claim) -> None:
        self.lost_at = self.clock()
        self.lost.set()


def _meanwhile(clock: ManualClock, what: str, work: Callable[[], T]) -> T:
    """``work()``, which takes real seconds (a failover), in a thread; the heartbeat's
    clock keeps pace with real time till it is done, as the leases in Redis do."""
    done: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            done.append(work())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    clock.keep_pace(what, lambda: not thread.is_alive())
    if errors:
        raise errors[0]
    return done[0]


def _unreplicated_fences(client: Any, name: str, count: int) -> int:
    """Mint ``count`` fences on the master; the highest."""
    top = 0
    for _ in range(count):
        claim = Claim(client, name, ttl=TTL, heartbeat=False)
        assert claim.acquire()
        top = max(top, claim.fence or 0)
        claim.release()
    return top


def _check_failover(
    client: Any,
    name: str,
    replica: RedisServer,
    kill: Any,
    wait_promoted: Any,
    clock: ManualClock,
) -> dict[str, float]:
    """The scenario on any topology; returns the timings it saw."""
    keys = Claim(client, name, heartbeat=False).keys
    pointer = RedisPointer(client, name)
    replicated = _unreplicated_fences(client, name, 1)
    on_replica = replica.client(single_connection_client=True)
    try:
        on_replica.execute_command("READONLY")  # a cluster replica serves reads only so
    except Exception:
        pass
    wait_for("the replica to have the first fence", lambda: on_replica.get(keys.fence), 5)
    on_replica.close()
    replica.pause()
    try:
        top = _unreplicated_fences(client, name, 20)
        holder = Holder(client, name, clock)
        assert holder.claim.acquire()
        old_fence = holder.claim.fence
        assert old_fence is not None and old_fence > top > replicated
        pointer.swap("old-output", fence=old_fence)
        clock.run(2 * EVERY)  # renewed meanwhile, on the master only
        assert holder.claim.held
        killed_at = time.monotonic()
        killed_on_clock = clock()
        kill()
    finally:
        replica.resume()
    wait_promoted()
    promoted_after = time.monotonic() - killed_at
    # A paused replica still has the stream in its socket buffer and may apply it on
    # resume; a replica cut off from its master does not. Leave the promoted server as
    # such a replica would: the fence it last replicated, no lease, no pointer.
    wait_for("the client to reach the new master", lambda: _writes(client, keys.fence), 30)
    client.set(keys.fence, replicated)
    client.delete(keys.lock)
    client.delete(pointer.key)
    # A new holder on the new master, through the same client, as soon as it is seen.
    fresh = Claim(client, name, ttl=TTL, heartbeat=False)
    wait_for("a claim on the promoted replica", lambda: _acquire_when_served(fresh), 30)
    acquired_after = time.monotonic() - killed_at
    assert fresh.fence is not None
    assert fresh.fence > old_fence > top  # above every fence minted before
    pointer.swap("new-output", fence=fresh.fence)
    # The old holder learns its lease is gone by its deadline plus one interval at most
    # (on its clock, which the failover's real seconds did not move).
    clock.run_until("the old holder's loss", holder.lost.is_set, TTL + 2 * EVERY + 5)
    assert holder.lost_at is not None
    lost_after = holder.lost_at - killed_on_clock
    assert lost_after <= TTL + EVERY + 0.5, lost_after
    # And what it would still write under its old fence is refused.
    with pytest.raises(StaleFence):
        pointer.swap("stale-output", fence=old_fence)
    published = pointer.read()
    assert published is not None and published.target == "new-output"
    fresh.release()
    return {"promoted": promoted_after, "acquired": acquired_after, "lost": lost_after}


def test_sentinel_failover_after_unreplicated_writes_stays_fenced(
    sentinel_group: SentinelGroup, fake_time: ManualClock
) -> None:
    client = connect(sentinel_group.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    replica = next(s for s in sentinel_group.servers if s is not sentinel_group.master())
    times = _check_failover(
        client,
        "rebuild:roads",
        replica,
        sentinel_group.kill_master,
        sentinel_group.wait_promoted,
        fake_time,
    )
    print(f"sentinel failover: {times}")


def test_cluster_failover_after_unreplicated_writes_stays_fenced(
    own_ha_cluster: RedisCluster, fake_time: ManualClock
) -> None:
    client = connect(own_ha_cluster.startup_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    name = "rebuild:roads"
    key = Claim(client, name, heartbeat=False).key
    master = own_ha_cluster.master_for_key(key)
    (replica,) = own_ha_cluster.replicas_of(master)
    times = _check_failover(
        client,
        name,
        replica,
        lambda: own_ha_cluster.kill_master_for(key),
        own_ha_cluster.wait_failover,
        fake_time,
    )
    print(f"cluster failover: {times}")


# -- a rate through a failover -------------------------------------------------------------


def _cut_off(group: SentinelGroup) -> None:
    """Stop the replica and drop its link: what the master writes now never reaches it
    (a paused replica would still read what its socket holds)."""
    master = group.master()
    next(s for s in group.servers if s is not master).pause()
    master.client().client_kill_filter(_type="replica")


def _starts_after_failover(group: SentinelGroup, client: Any, name: str, calls: int) -> int:
    """Kill the master, resume its (cut off) replica, wait for its promotion; then
    ``calls`` acquires of the rated name: how many started."""
    replica = next(s for s in group.servers if s is not group.master())
    group.kill_master()
    replica.resume()
    group.wait_promoted()
    first = Claim(client, name, rate="1/h", heartbeat=False)

    def answered() -> bool:
        return _acquire_when_served(first) or first.throttled is not None

    wait_for("an answer from the new master", answered, 30)
    claims = [first, *(Claim(client, name, rate="1/h", heartbeat=False) for _ in range(calls - 1))]
    started = 0
    for claim in claims:
        if claim.held or (claim is not first and claim.acquire()):
            started += 1
            claim.release()
        else:
            assert claim.throttled is not None  # refused by the rate, not busy
    return started


def test_a_rate_with_replicas_holds_through_a_sentinel_failover(
    sentinel_group: SentinelGroup,
) -> None:
    """With ``replicas=1`` a start is granted once the replica has it: a failover that
    promotes the replica keeps the rate, and a start it could forget is not granted."""
    client = connect(sentinel_group.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    name = "sync:acme"
    rated = Claim(client, name, rate="1/h", replicas=1, heartbeat=False)
    assert rated.acquire()  # one start this hour, on the replica too
    rated.release()
    _cut_off(sentinel_group)
    again = Claim(client, name, rate="1/h", replicas=1, replica_timeout=0.2, heartbeat=False)
    assert not again.acquire() and again.throttled is not None
    # No start more in the hour: the promoted replica counts the one it acknowledged.
    assert _starts_after_failover(sentinel_group, client, name, 5) == 0


def test_a_start_a_failover_forgets_is_unrefused_without_replicas(
    sentinel_group: SentinelGroup,
) -> None:
    """Without replicas, a start the replica did not have yet is forgotten: the promoted
    replica allows one start at once, and the rate holds again from it. The bound: one
    start more than the rate allows in the period of the failover."""
    client = connect(sentinel_group.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    name = "sync:acme"
    _cut_off(sentinel_group)
    rated = Claim(client, name, rate="1/h", heartbeat=False)
    assert rated.acquire()  # on the master alone
    rated.release()
    assert _starts_after_failover(sentinel_group, client, name, 5) == 1


def test_a_start_the_replica_does_not_have_is_refused_with_replicas(
    sentinel_group: SentinelGroup,
) -> None:
    """With ``replicas=1``, a start the replica cannot acknowledge is not granted: the
    only start of the hour is the one after the failover."""
    client = connect(sentinel_group.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    name = "sync:acme"
    _cut_off(sentinel_group)
    refused = Claim(client, name, rate="1/h", replicas=1, replica_timeout=0.2, heartbeat=False)
    with pytest.raises(ClaimUnavailable, match="replica"):
        refused.acquire()
    assert not refused.held
    # The one start of the hour comes after the failover, and no other.
    assert _starts_after_failover(sentinel_group, client, name, 5) == 1


def test_claims_live_through_a_sentinel_failover_of_a_paused_master(
    sentinel_group: SentinelGroup,
) -> None:
    """A master that stops answering (SIGSTOP), not one that dies: the heartbeat's own
    Sentinel connections time out instead of hanging, find the promoted replica, and go
    on renewing the leases it has (they reached it before the pause)."""
    client = connect(sentinel_group.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    lost: list[str] = []
    claims = [
        Claim(client, f"job:{i}", ttl=8.0, refresh_every=1.0, on_lost=lambda c: lost.append(c.name))
        for i in range(50)
    ]
    for claim in claims:
        assert claim.acquire()
    old = sentinel_group.master()
    replica = next(s for s in sentinel_group.servers if s is not old)
    wait_for("the leases on the replica", lambda: replica.client().dbsize() >= 50, 5)
    old.pause()
    try:
        _, port = sentinel_group.wait_promoted()
        assert port == replica.port
        # Past every deadline the paused master granted, in real time: the rounds sent
        # to it must time out and the promoted replica be found meanwhile.
        time.sleep(10.0)
        assert not lost
        assert all(c.held for c in claims)
        assert all(replica.client().pttl(c.key) > 0 for c in claims)  # renewed there
    finally:
        old.resume()
        for claim in claims:
            try:
                claim.release()
            except ClaimUnavailable:
                pass


# -- the heartbeat on a cluster -----------------------------------------------------------


def test_replicated_acquires_find_the_new_master_after_a_failover(
    own_ha_cluster: RedisCluster,
) -> None:
    client = connect(own_ha_cluster.startup_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    first = Claim(client, "job", ttl=10, replicas=1, heartbeat=False)
    assert first.acquire()
    first.release()
    own_ha_cluster.kill_master_for(first.key)
    own_ha_cluster.wait_failover()
    # The promoted replica has no replica of its own, so a replicated acquire reaching
    # it fails for want of acknowledgement; one still sent to the dead node fails to
    # connect. The first must come soon after the failover, through the same client.
    reasons: list[str] = []

    def reached_the_new_master() -> bool:
        try:
            Claim(client, "job", ttl=10, replicas=1, replica_timeout=0.2).acquire()
        except ClaimUnavailable as exc:
            reasons.append(str(exc))
            return "replica(s) asked for" in str(exc)
        return True

    wait_for("a replicated acquire on the new master", reached_the_new_master, 10)


def _spread(
    client: Any, count: int, ttl: float, every: float, clock: Callable[[], float] = time.monotonic
) -> list[Claim]:
    claims = [
        Claim(client, f"feed:{i}", ttl=ttl, refresh_every=every, records=False, clock=clock)
        for i in range(count)
    ]
    for claim in claims:
        assert claim.acquire()
    return claims


def test_a_thousand_claims_over_every_slot_are_renewed_per_node(
    ha_cluster: RedisCluster, fake_time: ManualClock
) -> None:
    client = connect(ha_cluster.startup_url)
    # On the clock the test moves, with a lease long enough that a node's round may take
    # its whole socket timeout (2 s of real time) on a loaded machine.
    claims = _spread(client, 1200, ttl=20.0, every=5.0, clock=fake_time)
    try:
        nodes = {client.get_node_from_key(c.key).name for c in claims}
        assert len(nodes) == 3  # every master holds some
        beat = heartbeat()
        trips = beat.round_trips
        fake_time.run(3 * 20.0, every=0.5)  # three ttls: nothing survives without renewals
        assert all(c.held for c in claims)
        assert not [c.name for c in claims if c.lost]
        # Pipelined per node: a few round trips per node and interval, not one per claim.
        per_interval = (beat.round_trips - trips) / (60.0 / 5.0)
        assert per_interval <= 3 * 3, per_interval
        direct = ha_cluster.client()
        remaining = sum(1 for c in claims if 0 < direct.pttl(c.key) <= 20_000)
        direct.close()
        assert remaining == len(claims)
    finally:
        for claim in claims:
            claim.release()


def test_a_node_that_is_down_delays_only_its_own_claims(
    slow_failover_cluster: RedisCluster,
) -> None:
    # Its nodes take 20 s to fail the paused master over: with the tests' usual 1 s, a
    # loaded machine could promote its replica inside the 2.5 s looked at here.
    own_ha_cluster = slow_failover_cluster
    client = connect(own_ha_cluster.startup_url, socket_timeout=1.0, socket_connect_timeout=1.0)
    claims = _spread(client, 300, ttl=6.0, every=1.0)
    try:
        victim = own_ha_cluster.master_for_key(claims[0].key)
        on_victim = [c for c in claims if own_ha_cluster.master_for_key(c.key) is victim]
        elsewhere = [c for c in claims if c not in on_victim]
        assert on_victim and elsewhere
        victim.pause()  # answers nothing, holds its sockets: the worst kind of down
        time.sleep(2.5)
        # The others were renewed meanwhile: their leases run a full ttl from now.
        assert all(c.held for c in elsewhere)
        assert min(c.expires_in or 0 for c in elsewhere) > 6.0 - 1.0 - 0.5
        # The paused node's claims were not (they keep their deadlines, not yet lost).
        assert max(c.expires_in or 0 for c in on_victim) < 6.0 - 2.0
        victim.resume()
        wait_for(
            "the paused node's claims renewed again",
            lambda: min(c.expires_in or 0 for c in on_victim) > 6.0 - 1.5,
            5,
        )
        assert all(c.held for c in claims)
    finally:
        for claim in claims:
            claim.release()


def test_claims_live_through_a_failover_of_their_node(
    own_ha_cluster: RedisCluster, fake_time: ManualClock
) -> None:
    """Leases that reached the replica are renewed on it once promoted: none is lost."""
    client = connect(own_ha_cluster.startup_url, socket_timeout=0.5, socket_connect_timeout=0.5)
    claims = _spread(client, 300, ttl=10.0, every=1.0, clock=fake_time)
    try:
        victim = own_ha_cluster.master_for_key(claims[0].key)
        (replica,) = own_ha_cluster.replicas_of(victim)
        wait_for(
            "the leases to reach the replica",
            lambda: (
                replica.client().dbsize()
                >= sum(1 for c in claims if own_ha_cluster.master_for_key(c.key) is victim)
            ),
            10,
        )
        own_ha_cluster.kill_master_for(claims[0].key)
        _meanwhile(fake_time, "the failover", own_ha_cluster.wait_failover)
        # The heartbeat finds the promoted replica once it reads the slot map again (at
        # most twice a second, in real time): until every lease is renewed, real pace.
        fake_time.keep_pace(
            "every lease renewed after the failover",
            lambda: min(c.expires_in or 0 for c in claims) > 10.0 - 1.5,
        )
        fake_time.run(12.0, every=0.25)  # past every deadline the old node could have granted
        assert not [c.name for c in claims if not c.held]
    finally:
        for claim in claims:
            try:
                claim.release()
            except ClaimUnavailable:
                pass


def _migrate_slot(
    cluster: RedisCluster, slot: int, client: Any, between: Callable[[], object]
) -> RedisServer:
    """Move one slot, and its keys, to another master, calling ``between`` after each
    batch of keys moved; the master it is on now."""
    source = cluster.node_for_slot(slot)
    target = next(m for m in cluster.masters() if m is not source)
    src, dst = source.client(), target.client()
    src_id = src.execute_command("CLUSTER", "MYID")
    dst_id = dst.execute_command("CLUSTER", "MYID")
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        between()  # renewals meet the slot half moved (ASK) in between
    for node in cluster.masters():
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    return target


def test_claims_follow_a_slot_that_moves(ha_cluster: RedisCluster, fake_time: ManualClock) -> None:
    client = connect(ha_cluster.startup_url)
    claim = Claim(client, "moving", ttl=2.0, refresh_every=0.5, clock=fake_time)
    slot = client.keyslot(claim.key)
    assert claim.acquire()
    try:
        target = _migrate_slot(ha_cluster, slot, client, lambda: fake_time.run(1.2))
        fake_time.run(3.0)  # more than a ttl after the move: renewed through MOVED
        assert claim.held
        assert target.client().pttl(claim.key) > 0
    finally:
        claim.release()

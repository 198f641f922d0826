"""A RedisPointer under failover: a swap the replicas never got, and ``replicas=N``.

The worst case is a publish the master accepted and never replicated: a failover
forgets it, and a stale holder's lower fence is then accepted over it. To lose a write
for real, the replica stops reading (SIGSTOP) and 64 MB written before the publish
fill the socket buffers between the two, so the publish waits in the master's own
memory and dies with it (a paused replica would otherwise read it from its socket when
resumed). Releases and hand-overs of a claim with ``replicas`` wait for them too.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from _wait import wait_for
from fenced import Claim, ClaimUnavailable, ConfigError, StaleFence, StoreError
from fenced._client import connect
from fenced.store import RedisPointer
from fenced.testing import RedisCluster, RedisServer, SentinelGroup

FILLER = 64 << 20  # above the largest socket buffers a loopback pair grows (32 + 4 MB)


def _cut_off(master: RedisServer, replica: RedisServer) -> None:
    """Stop ``replica`` and fill the link to it: what the master writes next is lost
    with the master."""
    m = master.client()
    m.config_set("client-output-buffer-limit", "replica 0 0 0")  # keep the link
    replica.pause()
    blob = b"x" * (4 << 20)
    for _ in range(FILLER // len(blob)):
        m.set("fenced-test:filler", blob)
    m.delete("fenced-test:filler")


def _writes(client: Any) -> bool:
    try:
        client.set("fenced-test:probe", 1, px=100)
        return True
    except Exception:
        return False


# -- swap with replicas=N --------------------------------------------------------------


def test_a_replicated_swap_is_on_the_replica_when_it_returns(
    pair: tuple[RedisServer, RedisServer],
) -> None:
    master, replica = pair
    pointer = RedisPointer(master.client(), "site", replicas=1)
    published = pointer.swap("build-1", fence=7)
    assert published.target == "build-1"
    assert replica.client().hget(pointer.key, "fence") == b"7"  # no wait: WAIT did it


def test_an_unacknowledged_swap_fails_closed(pair: tuple[RedisServer, RedisServer]) -> None:
    master, replica = pair
    pointer = RedisPointer(master.client(), "site", replicas=1, replica_timeout=0.3)
    pointer.swap("build-1", fence=7)
    replica.pause()
    try:
        with pytest.raises(StoreError, match=r"fence 8, but only 0 of the 1 replica") as err:
            pointer.swap("build-2", fence=8)
        assert err.value.name == "site" and err.value.fence == 8
        assert "not durable" in str(err.value) and "swap again" in str(err.value)
        # The master has it (readers there see it); the replica may not.
        assert pointer.read() is not None and pointer.read().target == "build-2"  # type: ignore[union-attr]
        # The same publish again, on a connection that never wrote: still not confirmed
        # (the script writes again, so the WAIT covers the first write too).
        again = RedisPointer(master.client(), "site", replicas=1, replica_timeout=0.3)
        with pytest.raises(StoreError, match="0 of the 1 replica"):
            again.swap("build-2", fence=8)
        # A stale fence is refused as ever, with or without the replicas.
        with pytest.raises(StaleFence):
            pointer.swap("old", fence=6)
    finally:
        replica.resume()
    assert pointer.swap("build-2", fence=8).fence == 8  # acknowledged now
    assert replica.client().hget(pointer.key, "target") == b"build-2"
    # More replicas than there are: never acknowledged.
    two = RedisPointer(master.client(), "site", replicas=2, replica_timeout=0.2)
    with pytest.raises(StoreError, match="1 of the 2 replica"):
        two.swap("build-3", fence=9)


def test_a_replicated_swap_on_a_cluster_waits_on_the_node_of_its_slot(
    ha_cluster: RedisCluster,
) -> None:
    client = connect(ha_cluster.startup_url)
    pointer = RedisPointer(client, "site", replicas=1, replica_timeout=5)
    pointer.swap("build-1", fence=7)
    (replica,) = ha_cluster.replicas_of(ha_cluster.master_for_key(pointer.key))
    on_replica = replica.client(single_connection_client=True)
    on_replica.execute_command("READONLY")  # a cluster replica serves reads only so
    assert on_replica.hget(pointer.key, "target") == b"build-1"
    on_replica.close()


@pytest.mark.parametrize(
    ("replicas", "timeout", "match"),
    [(-1, 1.0, "replicas=-1"), (True, 1.0, "replicas=True"), (1, 0, "replica_timeout=0")],
)
def test_bad_pointer_replica_settings_name_the_fix(
    server: RedisServer, replicas: Any, timeout: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        RedisPointer(server.client(), "x", replicas=replicas, replica_timeout=timeout)


# -- release and hand-over with replicas=N ----------------------------------------------


def test_release_and_hand_over_wait_for_the_replicas(
    pair: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    master, replica = pair
    client, on_replica = master.client(), replica.client()
    opts: dict[str, Any] = {"ttl": 10, "replicas": 1, "replica_timeout": 0.3, "heartbeat": False}
    cool = Claim(client, "cool", cooldown=60, **opts)
    assert cool.acquire()
    assert cool.release()
    assert on_replica.exists(cool.keys.cooldown)  # the window is there when release returns
    kept = Claim(client, "kept", task_id="t-1", **opts)
    assert kept.acquire()
    assert kept.hand_over(30) == "retried"
    assert on_replica.get(kept.key) is not None
    assert "replica" not in caplog.text

    # Not acknowledged: done on the master, and said so in the log.
    cool2 = Claim(client, "cool2", cooldown=60, **opts)
    kept2 = Claim(client, "kept2", task_id="t-2", **opts)
    assert cool2.acquire() and kept2.acquire()
    replica.pause()
    try:
        with caplog.at_level(logging.WARNING, logger="fenced"):
            assert cool2.release()
            assert kept2.hand_over(30) == "retried"
    finally:
        replica.resume()
    assert client.exists(cool2.keys.cooldown) and client.get(kept2.key) is not None
    assert "release of 'cool2' was acknowledged by 0 of the 1 replica" in caplog.text
    assert "forget its cooldown window" in caplog.text
    assert "hand-over of 'kept2' was acknowledged by 0 of the 1 replica" in caplog.text


def test_a_grant_given_back_does_not_wait_for_the_replicas_again(
    pair: tuple[RedisServer, RedisServer], caplog: pytest.LogCaptureFixture
) -> None:
    master, replica = pair
    claim = Claim(master.client(), "back", ttl=10, replicas=1, replica_timeout=0.3)
    replica.pause()
    try:
        with (
            caplog.at_level(logging.WARNING, logger="fenced"),
            pytest.raises(ClaimUnavailable, match="0 of the 1 replica"),
        ):
            claim.acquire()
    finally:
        replica.resume()
    assert "release of" not in caplog.text
    assert master.client().get(claim.key) is None


# -- under a Sentinel failover ------------------------------------------------------------


def _failover(
    group: SentinelGroup, replicas: int
) -> tuple[RedisPointer, int, int, BaseException | None]:
    """A publishes (replicated), its lease runs out, B publishes while the replica is
    cut off, the master dies and the replica is promoted. Returns the pointer, A's and
    B's fences, and what B's swap raised (None: B was told it published)."""
    client = connect(group.url, socket_timeout=2.0, socket_connect_timeout=1.0)
    name = "publish:site"
    options: dict[str, Any] = {"replicas": replicas, "replica_timeout": 0.3} if replicas else {}
    pointer = RedisPointer(client, name, **options)
    old = group.master()
    replica = next(s for s in group.servers if s is not old)
    a = Claim(client, name, ttl=30, heartbeat=False)
    assert a.acquire() and a.fence is not None
    # A's publish reaches the replica (waited for as long as a loaded machine needs);
    # B's, with the replica cut off, is waited for 0.3 s.
    RedisPointer(client, name, **{**options, "replica_timeout": 10}).swap("a-output", fence=a.fence)
    wait_for(
        "A's publish on the replica",
        lambda: replica.client().hget(pointer.key, "target") == b"a-output",
        10,
    )
    client.delete(a.key)  # A's lease runs out (A was paused): A still holds its fence
    b = Claim(client, name, ttl=30, heartbeat=False)
    assert b.acquire() and b.fence is not None and b.fence > a.fence
    told: BaseException | None = None
    _cut_off(old, replica)
    try:
        try:
            pointer.swap("b-output", fence=b.fence)
        except StoreError as exc:
            told = exc
        group.kill_master()
    finally:
        replica.resume()
    group.wait_promoted()
    wait_for("the client to reach the new master", lambda: _writes(client), 30)
    return pointer, a.fence, b.fence, told


def test_without_replicas_a_failover_forgets_a_publish_and_the_stale_holder_wins(
    sentinel_group: SentinelGroup,
) -> None:
    """The window replicas=0 leaves: B was told its publish succeeded; it is gone."""
    pointer, a_fence, _b_fence, told = _failover(sentinel_group, replicas=0)
    assert told is None  # B believes it published
    assert pointer.swap("a-stale", fence=a_fence).target == "a-stale"  # and A wins
    assert pointer.read().target == "a-stale"  # type: ignore[union-attr]


def test_with_replicas_the_publish_lost_in_a_failover_was_never_confirmed(
    sentinel_group: SentinelGroup,
) -> None:
    pointer, a_fence, b_fence, told = _failover(sentinel_group, replicas=1)
    # B was told before the failover that its publish is not durable.
    assert isinstance(told, StoreError) and "0 of the 1 replica" in str(told)
    assert pointer.read().target == "a-output"  # type: ignore[union-attr]
    # The window left: a swap reported not durable is forgotten, and A's fence (still
    # the highest the new master saw) is accepted. B, told so, publishes again; the
    # new master has no replica of its own, so without waiting.
    plain = RedisPointer(pointer.redis, pointer.name)
    assert plain.swap("a-stale", fence=a_fence).target == "a-stale"
    assert plain.swap("b-output", fence=b_fence).target == "b-output"
    with pytest.raises(StaleFence):
        plain.swap("a-stale", fence=a_fence)


def test_a_replicated_publish_survives_a_failover_and_refuses_the_stale_holder(
    sentinel_group: SentinelGroup,
) -> None:
    client = connect(sentinel_group.url, socket_timeout=2.0, socket_connect_timeout=1.0)
    name = "publish:site"
    pointer = RedisPointer(client, name, replicas=1, replica_timeout=5)
    a = Claim(client, name, ttl=30, heartbeat=False)
    assert a.acquire() and a.fence is not None
    pointer.swap("a-output", fence=a.fence)
    client.delete(a.key)  # A's lease runs out (A was paused): A still holds its fence
    b = Claim(client, name, ttl=30, heartbeat=False)
    assert b.acquire() and b.fence is not None
    pointer.swap("b-output", fence=b.fence)  # acknowledged by the replica
    sentinel_group.kill_master()  # at once: nothing else is sent after the swap
    sentinel_group.wait_promoted()
    wait_for("the client to reach the new master", lambda: _writes(client), 30)
    # The new master has no replica: A writes without waiting, and is refused.
    stale = RedisPointer(client, name)
    with pytest.raises(StaleFence):
        stale.swap("a-stale", fence=a.fence)
    assert stale.read().target == "b-output"  # type: ignore[union-attr]

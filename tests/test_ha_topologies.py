"""Claims on the topologies production runs: a Redis Cluster and a Sentinel group.

The clusters and sentinels are real processes (``fenced.testing.RedisCluster`` and
``SentinelGroup``); a failover is a master killed with SIGKILL and a replica promoted
by the cluster or the sentinels themselves.
"""

from __future__ import annotations

from typing import Any

from _wait import wait_for
from fenced import Claim, ClaimUnavailable
from fenced._lease import short_token
from fenced.testing import RedisCluster, RedisServer, SentinelGroup


def _names_on_every_master(cluster: RedisCluster, client: Any) -> dict[int, str]:
    """A claim name per master (by port), each name's keys served by that master."""
    wanted = {m.port for m in cluster.masters()}
    found: dict[int, str] = {}
    for i in range(1000):
        name = f"rebuild:tenant-{i}"
        port = cluster.master_for_key(Claim(client, name, heartbeat=False).key).port
        found.setdefault(port, name)
        if set(found) == wanted:
            return found
    raise AssertionError(f"no names for every master: {found}")


def _acquire_when_served(claim: Claim) -> bool:
    """Acquire, treating a Redis that cannot be reached yet (mid-failover) as 'not yet'."""
    try:
        return claim.acquire()
    except ClaimUnavailable:
        return False


def test_the_cluster_has_three_masters_each_with_a_replica(ha_cluster: RedisCluster) -> None:
    masters = ha_cluster.masters()
    assert len(masters) == 3
    replicas = {m.port: ha_cluster.replicas_of(m) for m in masters}
    assert all(len(r) == 1 for r in replicas.values()), replicas
    every = {m.port for m in masters} | {r[0].port for r in replicas.values()}
    assert every == {n.port for n in ha_cluster.nodes}
    client = ha_cluster.client()
    try:
        assert client.cluster_info()["cluster_state"] == "ok"
        assert len(client.get_primaries()) == 3
        assert len(client.get_replicas()) == 3
    finally:
        client.close()


def test_claims_on_every_master_acquire_refresh_and_release(ha_cluster: RedisCluster) -> None:
    client = ha_cluster.client(decode_responses=True)
    try:
        names = _names_on_every_master(ha_cluster, client)
        claims = [Claim(client, name, ttl=30, heartbeat=False) for name in names.values()]
        for claim in claims:
            assert claim.acquire(), claim.name
            assert claim.fence is not None
            assert claim.refresh()
        for port, claim in zip(names, claims, strict=True):
            # The lease lives on the master that serves its slot, and nowhere else.
            node = next(m for m in ha_cluster.masters() if m.port == port).client()
            assert node.get(claim.key) is not None
            node.close()
            rival = Claim(client, claim.name, heartbeat=False)
            assert not rival.acquire()
            assert rival.holder is not None and rival.holder.token == short_token(claim.token)
        for claim in claims:
            assert claim.release("ok")
            assert client.get(claim.key) is None
    finally:
        client.close()


def test_a_fence_after_a_cluster_failover_is_above_every_fence_before(
    own_ha_cluster: RedisCluster,
) -> None:
    client = own_ha_cluster.client()
    try:
        before = Claim(client, "rebuild:roads", ttl=2, heartbeat=False)
        assert before.acquire()
        assert before.fence is not None
        killed = own_ha_cluster.kill_master_for(before.key)
        own_ha_cluster.wait_failover()
        now_serving = own_ha_cluster.master_for_key(before.key)
        assert now_serving.port != killed.port
        assert killed.port not in {m.port for m in own_ha_cluster.masters()}
        after = Claim(client, "rebuild:roads", ttl=2, heartbeat=False)
        wait_for("a claim on the promoted replica", lambda: _acquire_when_served(after), 30)
        assert after.fence is not None and after.fence > before.fence
        assert after.release("ok")
    finally:
        client.close()


def test_a_fence_after_a_sentinel_failover_is_above_every_fence_before(
    sentinel_group: SentinelGroup,
) -> None:
    client = sentinel_group.master_client(socket_timeout=2)
    try:
        first = sentinel_group.master()
        before = Claim(client, "rebuild:roads", ttl=2, heartbeat=False)
        assert before.acquire()
        assert before.fence is not None
        assert sentinel_group.kill_master() is first
        _, port = sentinel_group.wait_promoted()
        assert port != first.port
        promoted: RedisServer = sentinel_group.master()
        assert promoted.port == port and promoted is not first
        after = Claim(client, "rebuild:roads", ttl=2, heartbeat=False)
        wait_for("a claim on the promoted replica", lambda: _acquire_when_served(after), 30)
        assert after.fence is not None and after.fence > before.fence
        # The claim was taken on the promoted server, through the same client.
        direct = promoted.client()
        assert direct.get(after.key) is not None
        direct.close()
        assert after.release("ok")
    finally:
        client.close()

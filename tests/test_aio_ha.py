"""fenced.aio on the topologies production runs: a 3-master Redis Cluster and a Sentinel
group, with redis.asyncio clients; a Sentinel failover keeps fences increasing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from _clock import ManualClock
from fenced import ClaimUnavailable
from fenced.aio import Claim
from fenced.testing import RedisCluster, SentinelGroup


def test_claims_over_every_master_are_renewed(
    ha_cluster: RedisCluster, fake_time: ManualClock
) -> None:
    from redis.asyncio.cluster import ClusterNode
    from redis.asyncio.cluster import RedisCluster as AsyncCluster

    async def main() -> tuple[int, int, int]:
        nodes = [ClusterNode("127.0.0.1", n.port) for n in ha_cluster.masters()]
        r: Any = AsyncCluster(startup_nodes=nodes)
        fake_time.renewer_for_this_loop()
        try:
            # Renewed on the clock the test moves: a round may take its whole timeout
            # (half the interval, 2.5 s of real time) on a loaded machine, and the lease
            # outlives a step however slow the machine is.
            claims = [
                Claim(r, f"aio:{i}", ttl=15, refresh_every=5, clock=fake_time) for i in range(300)
            ]
            for c in claims:
                assert await c.acquire()
            masters = {r.get_node_from_key(c.key).name for c in claims}
            await fake_time.run_async(45, every=0.5)  # three ttls
            held = sum(c.held for c in claims)
            released = sum([await c.release() for c in claims])
            return len(masters), held, released
        finally:
            await r.aclose()

    assert asyncio.run(main()) == (3, 300, 300)


def test_a_fence_after_a_sentinel_failover_is_above_every_fence_before(
    sentinel_group: SentinelGroup,
) -> None:
    from redis.asyncio.sentinel import Sentinel

    async def main() -> tuple[int, int]:
        hosts = [("127.0.0.1", s.port) for s in sentinel_group.sentinels]
        # Sentinel() is typed from redis-py 8.2 on, untyped before.
        sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            hosts, sentinel_kwargs={"socket_timeout": 1}, socket_timeout=1
        )
        r: Any = sentinel.master_for(sentinel_group.service)
        # Not renewed: a renewal that reaches the promoted replica would keep the name
        # held there, and the claim after the failover would wait for nothing.
        before = Claim(r, "rebuild:roads", ttl=3, heartbeat=False)
        assert await before.acquire()
        first = before.fence or 0
        await asyncio.to_thread(sentinel_group.kill_master)
        await asyncio.to_thread(sentinel_group.wait_promoted)
        deadline = time.monotonic() + 30
        while True:
            after = Claim(r, "rebuild:roads", ttl=3)
            try:
                if await after.acquire():
                    break
            except ClaimUnavailable:
                pass
            assert time.monotonic() < deadline, "no claim on the promoted replica"
            await asyncio.sleep(0.2)
        second = after.fence or 0
        await after.release()
        await r.aclose()
        return first, second

    first, second = asyncio.run(main())
    assert second > first > 0


def test_exclusive_coroutines_on_cluster_and_sentinel_urls(
    ha_cluster: RedisCluster, sentinel_group: SentinelGroup
) -> None:
    from fenced import exclusive

    ran: list[tuple[str, int]] = []

    def job_on(url: str) -> Any:
        @exclusive(name="job:{n}", redis=url, ttl=2)
        async def job(n: int) -> int:
            await asyncio.sleep(0.2)
            ran.append((url, n))
            return n

        return job

    for url in (ha_cluster.startup_url, sentinel_group.url):
        job = job_on(url)

        async def main(job: Any = job) -> list[Any]:
            return list(await asyncio.gather(job(1), job(1), job(2)))

        results = asyncio.run(main())
        # Of the two calls for 1, one ran and one was skipped; 2 ran.
        assert sorted(n for u, n in ran if u == url) == [1, 2], (url, results)
        assert sum(1 for r in results if r == 1) == 1


def test_exclusive_on_an_unreachable_cluster_url_fails_when_called_not_when_defined() -> None:
    from fenced import exclusive
    from fenced.testing import free_port

    url = f"redis+cluster://127.0.0.1:{free_port()}/?socket_connect_timeout=0.5"

    @exclusive(name="job", redis=url)
    def job() -> None:
        raise AssertionError("ran without a claim")

    try:
        job()
    except ClaimUnavailable:
        pass
    else:
        raise AssertionError("no ClaimUnavailable")

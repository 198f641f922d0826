"""ClaimedTask in a real prefork worker whose claims live on a Redis Cluster or behind
Sentinel, configured the way a deployment configures it: ``FENCED_REDIS_URL`` set to
a ``redis+cluster://`` or ``redis+sentinel://`` URL. The broker and result backend
stay on a plain Redis."""

from __future__ import annotations

import os
from typing import Any

import pytest

from celery_harness import WAIT, Services, Worker, key
from fenced import Claim, records
from fenced._client import connect
from fenced.testing import RedisServer


@pytest.mark.parametrize("topology", ["cluster", "sentinel"])
def test_claimed_tasks_run_once_per_name_with_claims_on(
    topology: str, redis_server: RedisServer, request: pytest.FixtureRequest
) -> None:
    if topology == "cluster":
        lock_url = request.getfixturevalue("ha_cluster").startup_url
    else:
        lock_url = request.getfixturevalue("sentinel_group").url
    redis_server.client().flushall()
    services = Services.on(redis_server, "redis", lock_url=lock_url)
    client = services.client()
    locks = connect(lock_url, decode_responses=True)
    try:
        with Worker(services, name=f"ha-{topology}"):

            def run(tenant: str, **kw: Any) -> dict[str, Any]:
                result = client.send_task(
                    "t.rebuild", args=(tenant, "roads"), kwargs=kw, queue=services.queue
                )
                out: dict[str, Any] = result.get(timeout=WAIT)
                return out

            tenants = [key() for _ in range(6)]  # names spread over the cluster's slots
            for tenant in tenants:
                name = f"rebuild:{tenant}:roads"
                # Held here: the worker, reaching the same store by URL, must see it.
                with Claim(locks, name, ttl=30) as held:
                    skip = run(tenant, steps=1)
                    assert skip["status"] == "skipped" and skip["holder"]["pid"] == os.getpid()
                done = run(tenant, steps=1)
                assert done["status"] == "ok" and done["fence"] > (held.fence or 0)
                outcomes = sorted(run.outcome for run in records.history(locks, name))
                assert outcomes == ["ok", "skipped"]
            # Two deliveries at once: one runs, one skips.
            tenant = key()
            pair = [
                client.send_task(
                    "t.rebuild", args=(tenant, "roads"), kwargs={"steps": 5, "step_time": 0.4},
                    queue=services.queue,
                )
                for _ in range(2)
            ]  # fmt: skip
            statuses = sorted(r.get(timeout=WAIT)["status"] for r in pair)
            assert statuses == ["ok", "skipped"]
            if topology == "cluster":
                # The names really were spread: more than one master holds their keys.
                keys = [Claim(locks, f"rebuild:{t}:roads").key for t in tenants]
                assert len({locks.get_node_from_key(k).name for k in keys}) > 1
    finally:
        client.close()

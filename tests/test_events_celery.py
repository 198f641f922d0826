"""fenced's Celery lifecycle signals, received in a real ``celery worker`` process.

The worker runs tests/celery_app.py, whose receivers note every lifecycle signal in
the observation Redis (``sig:<claim name>``); the claims live on a redis-server of
their own, which a test pauses (renewals fail) or clears a lease on (the claim is lost).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key
from fenced._lease import ClaimKeys
from fenced.testing import RedisServer


@pytest.fixture
def lock_server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def signals_of(obs: redis.Redis, name: str, kind: str) -> list[dict[str, Any]]:
    return [s for s in map(json.loads, obs.lrange(f"sig:{name}", 0, -1)) if s["kind"] == kind]


def wait_signal(obs: redis.Redis, name: str, kind: str) -> dict[str, Any]:
    found: dict[str, Any] = wait_for(
        f"the {kind!r} signal of {name!r}",
        lambda: next(iter(signals_of(obs, name, kind)), None),
        WAIT,
        0.05,
    )
    return found


def test_a_claimed_tasks_lifecycle_reaches_its_signal_receivers(
    redis_server: RedisServer, lock_server: RedisServer
) -> None:
    services = Services.on(redis_server, lock_url=lock_server.url, ttl=3.0)
    obs, app = services.obs(), services.client()
    k1, k2 = key(), key()
    n1, n2 = f"labelled:{k1}", f"labelled:{k2}"
    with Worker(services, concurrency=2):
        first = app.send_task("t.labelled", args=(k1,), queue=services.queue)
        wait_for("the first run to start", lambda: obs.llen(f"runs:{k1}"), WAIT)
        skipped = app.send_task("t.labelled", args=(k1,), queue=services.queue)
        assert skipped.get(timeout=WAIT)["status"] == "skipped"

        # Renewals fail while the claims' server is paused (shorter than the lease).
        lock_server.pause()
        try:
            failed = wait_signal(obs, n1, "renewal_failed")
        finally:
            lock_server.resume()
        obs.set(f"gate:{k1}:0", 1)
        assert first.get(timeout=WAIT) == {"status": "ok", "run": 0}
        released = wait_signal(obs, n1, "released")

        # A lease cleared under a running task: lost, and the run ends lost.
        lost_run = app.send_task("t.labelled", args=(k2,), queue=services.queue)
        wait_for("the second run to start", lambda: obs.llen(f"runs:{k2}"), WAIT)
        lock_server.client().delete(ClaimKeys.of(n2, "fenced").lock)
        lost = wait_signal(obs, n2, "lost")
        with pytest.raises(Exception, match="lost"):
            lost_run.get(timeout=WAIT, propagate=True)
        lost_released = wait_signal(obs, n2, "released")

    acquired = signals_of(obs, n1, "acquired")[0]
    assert acquired["signal"] == "claim_acquired" and acquired["task"] == "t.labelled"
    assert acquired["label"] == "gates" and acquired["fence"] > 0
    busy = signals_of(obs, n1, "skipped")[0]
    assert busy["signal"] == "claim_skipped" and busy["reason"] == "already running"
    assert busy["holder"] == acquired["holder"] and busy["fence"] == acquired["fence"]
    # Renewal failures come from the heartbeat's lane thread, not the task's.
    assert failed["signal"] == "claim_renewal_failed" and "Timeout" in failed["reason"]
    assert failed["thread"] == "fenced-heartbeat-lane" and failed["duration"] > 0
    assert released["outcome"] == "ok" and released["duration"] > 0
    assert released["fence"] == acquired["fence"] and released["thread"] == "MainThread"
    assert lost["signal"] == "claim_lost" and lost["reason"] == "taken"
    assert lost["thread"] == "fenced-heartbeat-lane"
    assert lost_released["outcome"] == "lost"

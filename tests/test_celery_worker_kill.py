"""A whole worker killed mid-run (main process and pool children, SIGKILL): its message
comes back (Redis: after the visibility timeout; RabbitMQ: when the connection drops),
finds the claim still held under its own task id, waits for that lease to end, and
completes the work."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import pytest

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key, notes
from fenced import records
from fenced._inspect import read_holder
from fenced.testing import RedisServer

if TYPE_CHECKING:
    # The channel an amqp:// connection hands out; kombu types it as the base StdChannel.
    from kombu.transport.pyamqp import Channel as AmqpChannel


@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_whole_worker_killed_mid_run_redelivery_completes(
    broker: str, redis_server: RedisServer
) -> None:
    # ttl: the lease outlives the time the message takes to come back.
    services = Services.on(redis_server, broker, ttl=8.0)
    client = services.client()
    obs, locks = services.obs(), services.locks()
    k = key()
    name = f"rebuild:{k}:roads"
    try:
        with Worker(services, concurrency=1, name="victim") as victim:
            result = client.send_task(
                "t.rebuild",
                args=(k, "roads"),
                kwargs={"steps": 6, "step_time": 0.3, "run": k},
                queue=services.queue,
            )
            wait_for("the first step", lambda: notes(obs, f"marks:{k}"))
            victim.kill()
        dead = read_holder(locks, name)
        assert dead is not None and dead.task_id == result.id  # nobody released it
        # Redis brings an unacknowledged message back after the visibility timeout.
        with Worker(services, visibility=4, name="successor"):
            assert result.get(timeout=WAIT)["status"] == "ok"
        # A Redis broker may hand the message out once more while it runs (the short
        # visibility timeout); such a copy ends as a skipped duplicate and is left out.
        runs = [
            run
            for run in records.history(locks, name)
            if run.reason != "duplicate delivery of a completed task"
        ]
        assert [run.outcome for run in runs] == ["ok", "aborted"]  # no skip, no conflict
        ok, aborted = runs
        assert ok.task_id == aborted.task_id == result.id
        assert aborted.fence == dead.fence and aborted.reason and "died" in aborted.reason
        assert ok.fence is not None and dead.fence is not None and ok.fence > dead.fence
        outputs = [obs.get(f"out:{k}:roads:{i}") for i in range(6)]
        assert outputs == [str(ok.fence)] * 6
        retries = [n for n in notes(obs, "signal:retry") if n["task_id"] == result.id]
        assert all("ClaimHeld" in n["reason"] for n in retries)
        assert read_holder(locks, name) is None
    finally:
        if broker == "amqp":
            with client.connection_for_write() as conn:
                cast("AmqpChannel", conn.default_channel).queue_delete(services.queue)
        client.close()

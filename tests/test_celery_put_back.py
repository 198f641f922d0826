"""A call put back by ``claim_rate`` (``delay``): its message is sent again even when the
result backend cannot store the RETRY state meanwhile.

In process, on a real Redis broker: the put-back of a delivery is called as the worker
calls it, and the test reads the broker's queue.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import Ignore

from celery_harness import Services
from fenced import ClaimHeld
from fenced.celery import ClaimedTask
from fenced.testing import RedisServer


@pytest.fixture
def services(redis_server: RedisServer) -> Services:
    return Services.on(redis_server)


def test_a_put_back_is_sent_when_the_retry_state_cannot_be_stored(
    services: Services, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = Celery(
        f"put_back_{uuid.uuid4().hex[:6]}",
        set_as_current=False,
        broker=services.broker_url,
        backend=services.backend_url,
    )
    app.conf.update(fenced_redis_url=services.lock_url, task_default_queue=services.queue)

    @app.task(base=ClaimedTask, bind=True, claim="pb:{k}", claim_rate="1/m", shared=False)
    def limited(self: Any, k: str) -> str:
        return k

    def backend_down(*args: Any, **kwargs: Any) -> None:
        raise redis.ConnectionError("the result backend is down")

    monkeypatch.setattr(app.backend, "mark_as_retry", backend_down)
    task_id = str(uuid.uuid4())
    limited.push_request(
        id=task_id,
        args=("x",),
        kwargs={},
        delivery_info={"exchange": "", "routing_key": services.queue},
        is_eager=False,
        called_directly=False,
    )
    try:
        with pytest.raises(Ignore):
            limited._put_back(30.0, ClaimHeld("rate limited"))
    finally:
        limited.pop_request()
    # The call is not lost: its message waits in the queue, under its task id.
    sent = redis.Redis.from_url(services.broker_url).lrange(services.queue, 0, -1)
    assert [json.loads(raw)["headers"]["id"] for raw in sent] == [task_id]

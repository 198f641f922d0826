"""``claim_on_busy="replace"`` under a Redis broker whose visibility timeout is shorter
than the runs: the broker hands each running call's message out again, and the newest
call still wins once, with no ping-pong.

Each message is delivered again while its run runs (``visibility_timeout`` 1 s, runs of
3.5 s, ``acks_late``). The older call's second copy must not take the name back from
the newer run (its task id was replaced: REPLACE refuses it), nor the newer call's
second copy start again: a copy of the running call waits for its own lease, and ends
as a duplicate once the run has ended ok. Once the newest call has finished, its copies
stop coming: each copy that finds its task id done is a duplicate at once, also while
another copy of the same task id holds the name for that moment (a retry of it, due past
the visibility timeout, would be handed out again by the broker, and again).

The runs happen in a ``celery worker`` running tests/celery_replace_app.py.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key
from celery_replace_app import make_app
from fenced.testing import RedisServer

APP = "tests.celery_replace_app"
#: How long each run's body takes, and the broker's visibility timeout: every message is
#: handed out again at least once while its run runs.
RUN = 3.5
VISIBILITY = 1.0


@pytest.fixture
def services(redis_server: RedisServer) -> Services:
    """The module's server, a fresh queue."""
    return Services.on(redis_server)


def noted(services: Services, what: str, k: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in services.obs().lrange(f"{what}:{k}", 0, -1)]


def test_two_calls_replace_once_under_a_short_visibility_timeout(services: Services) -> None:
    task = services.sender(make_app).tasks["r.timed"]
    k = key()
    with Worker(services, app=APP, concurrency=4, visibility=VISIBILITY) as worker:
        first = task.delay(k, "1", RUN)
        wait_for("the first run to start", lambda: noted(services, "starts", k))
        # Past the visibility timeout and a restore sweep: the first message is out twice.
        time.sleep(VISIBILITY + 1.2)
        second = task.delay(k, "2", RUN)
        assert second.get(timeout=WAIT) == "2"
        stopped = first.get(timeout=WAIT)
        # Long enough for a ping-pong to show: each copy coming back would start again.
        time.sleep(2 * RUN)
        log = worker.log()
    assert stopped["status"] == "replaced" and second.id in stopped["reason"], stopped
    starts = Counter(s["task_id"] for s in noted(services, "starts", k))
    ends = [e["task_id"] for e in noted(services, "ends", k)]
    # The newest call's run finished; the older one never ran to its end.
    assert ends == [second.id], (ends, starts)
    # No ping-pong: each call started once.
    assert starts == {first.id: 1, second.id: 1}, starts
    # The broker did hand the messages out again meanwhile (else this tested nothing).
    assert log.count(f"r.timed[{second.id}] received") >= 2, log[-3000:]
    # The newest call's copies stop once it finished: a copy already handed out may
    # still come (as a duplicate), but none is sent back to circulate (7 s of watching:
    # a copy retried past the visibility timeout would come about once a second).
    after = log.split(f"r.timed[{second.id}] succeeded", 1)
    assert len(after) == 2, log[-3000:]
    late = after[1].count(f"r.timed[{second.id}] received")
    assert late <= 2, (late, after[1][-3000:])

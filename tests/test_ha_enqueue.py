"""An until_finished enqueue marker through a Sentinel failover that loses its deletion.

The run's release deletes the name's marker on the master; if the replica never got that
write and is promoted, the new master still holds the marker of a run that ended, and
every call of the name is dropped while it lives. It lives as the run's lease did (the
run's acquire and renewals gave it the lease's ttl), so the name takes a new call within
about one lease ttl of the release, not after ``claim_enqueue_ttl`` (an hour).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from celery import Celery

from _wait import wait_for
from fenced._client import connect
from fenced._lease import ClaimKeys
from fenced.celery import ClaimedTask
from fenced.testing import SentinelGroup

TTL = 2.0


def _cut_off(group: SentinelGroup) -> None:
    """Stop the replica and drop its link: what the master writes now never reaches it."""
    master = group.master()
    next(s for s in group.servers if s is not master).pause()
    master.client().client_kill_filter(_type="replica")


def test_a_marker_whose_release_a_failover_lost_blocks_its_name_one_ttl_at_most(
    sentinel_group: SentinelGroup,
) -> None:
    app = Celery("fenced_enqueue_failover", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = sentinel_group.url
    started, go = threading.Event(), threading.Event()

    @app.task(
        shared=False,
        base=ClaimedTask,
        bind=True,
        claim="build:{x}",
        claim_enqueue="until_finished",
        claim_ttl=TTL,
    )
    def build(self: ClaimedTask, x: str) -> str:
        started.set()
        go.wait(30)
        return "built"

    key = ClaimKeys("fenced", "build:roads").queued
    first = build.delay("roads")  # marked on the master (an hour), replicated
    outcome: list[Any] = []
    run = threading.Thread(
        target=lambda: outcome.append(build.apply(("roads",), task_id=first.id).get())
    )
    run.start()
    assert started.wait(30)
    time.sleep(TTL)  # renewed meanwhile
    master = sentinel_group.master()
    assert master.client().execute_command("WAIT", 1, 5000) == 1  # the replica has it all
    _cut_off(sentinel_group)
    go.set()
    run.join(30)
    assert outcome == ["built"]
    assert not master.client().exists(key)  # deleted, on the master only
    replica = next(s for s in sentinel_group.servers if s is not master)
    sentinel_group.kill_master()
    replica.resume()
    sentinel_group.wait_promoted()
    promoted = time.monotonic()
    left = replica.client().pttl(key)  # what the promoted replica kept of the marker
    assert left <= TTL * 1000, f"the marker of a finished run lives {left} ms more"

    client = connect(sentinel_group.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    fresh: list[str] = []

    def accepted() -> bool:
        if client.exists(key):
            return False  # still marked for the finished run: a call publishes nothing
        sent = build.delay("roads")
        fresh.append(sent.id)
        return sent.id != first.id

    wait_for("the name to take a new call", accepted, 30)
    # Taken within a ttl of the promotion (the failover's own seconds took longer than
    # the ttl already here; a second for the client to find the new master)...
    assert time.monotonic() - promoted <= TTL + 1.0
    # ...and marked for it on the new master: a call, not a send that skipped the marker.
    assert client.get(key) == fresh[-1].encode()

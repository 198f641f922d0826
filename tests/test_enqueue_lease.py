"""The until_finished enqueue marker lives as the run's lease does (one Redis server).

While a run holds its claim, its acquire gives the name's marker the lease's ttl and each
renewal extends it (while it holds the run's task id), so a marker whose deletion never
happened (a release a failover lost, a run that died unreleased) frees the name within
one lease ttl, not ``claim_enqueue_ttl``. A marker a retry of the run wrote for its
queued message keeps its own, longer expiry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import redis

from _clock import ManualClock
from _wait import wait_for
from fenced import Claim
from fenced._lease import ClaimKeys
from fenced.testing import RedisServer

HOUR_MS = 3_600_000


def marked(r: Any, name: str, task_id: str, px: int = HOUR_MS) -> str:
    """Mark ``name`` as apply_async does (claim_enqueue); its marker's key."""
    key = ClaimKeys("fenced", name).queued
    r.set(key, task_id, px=px)
    return key


def until_finished(claim: Claim) -> Claim:
    """As ClaimedTask sets a run of claim_enqueue="until_finished" up."""
    claim.handle_enqueue_marker(str(claim.options.ttl_ms), True)
    return claim


def test_the_marker_lives_as_the_lease_while_the_heartbeat_renews_it(
    server: RedisServer, fake_time: ManualClock
) -> None:
    r = server.client()
    key = marked(r, "job", "t1")
    other = marked(r, "other", "t1")
    claim = until_finished(Claim(r, "job", ttl=6.0, task_id="t1", clock=fake_time))
    assert claim.acquire()
    try:
        assert 5_000 < r.pttl(key) <= 6_000  # the lease's ttl, not an hour
        for _ in range(3):
            r.pexpire(key, 1_000)  # time passes for the marker (Redis keeps real time)
            fake_time.run(2.5)  # a renewal or more
            assert 5_000 < r.pttl(key) <= 6_000, "each renewal extends it to one ttl"
            assert 5_000 < r.pttl(claim.keys.lock) <= 6_000
        assert r.pttl(other) > HOUR_MS - 60_000  # another name's marker: untouched
        # A retry of the run marks it for its queued message: a renewal keeps that.
        r.set(key, "t1", px=HOUR_MS)
        fake_time.run(2.5)
        assert r.pttl(key) > HOUR_MS - 60_000
        # A newer message's marker (another task id) is not the run's to extend.
        r.set(key, "t2", px=1_000)
        fake_time.run(2.5)
        assert 0 < r.pttl(key) <= 1_000
        r.set(key, "t1", px=1_000)
    finally:
        claim.release()
    assert not r.exists(key)  # the release deletes it


def test_a_claim_without_a_marker_refreshes_as_before(
    server: RedisServer, fake_time: ManualClock
) -> None:
    r = server.client()
    key = marked(r, "job", "t1", px=2_000)
    claim = Claim(r, "job", ttl=6.0, task_id="t1", clock=fake_time)  # no claim_enqueue
    assert claim.acquire()
    try:
        fake_time.run(2.5)
        assert 0 < r.pttl(key) <= 2_000  # not its marker: left alone
    finally:
        claim.release()
    assert r.get(key) == b"t1"


def test_a_manual_refresh_extends_the_marker_too(server: RedisServer) -> None:
    r = server.client()
    key = marked(r, "job", "t1")
    claim = until_finished(Claim(r, "job", ttl=6.0, task_id="t1", heartbeat=False))
    assert claim.acquire()
    try:
        r.pexpire(key, 1_000)
        assert claim.refresh()
        assert 5_000 < r.pttl(key) <= 6_000
    finally:
        claim.release()


CHILD = """
import os, sys, time
import redis
from fenced import Claim
r = redis.Redis.from_url(sys.argv[1])
claim = Claim(r, "job", ttl=1.0, task_id="t1")
claim.handle_enqueue_marker(str(claim.options.ttl_ms), True)
assert claim.acquire()
time.sleep(2.5)  # renewed by the heartbeat all along
print(r.pttl(claim.keys.queued), flush=True)
os._exit(0)  # dies holding it: no release
"""


def test_a_run_that_dies_unreleased_leaves_a_marker_that_ends_with_its_lease(
    server: RedisServer,
) -> None:
    r = server.client()
    key = marked(r, "job", "t1")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, server.url],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )  # fmt: skip
    assert 0 < int(out.stdout) <= 1_000, out  # renewed, never beyond one ttl
    died = time.monotonic()
    wait_for("the marker to expire", lambda: not r.exists(key), 5)
    assert time.monotonic() - died <= 1.5  # with the lease: not after an hour
    assert not r.exists(ClaimKeys("fenced", "job").lock)


def test_apply_async_marks_alike_on_every_server_and_client(r: Any, server: RedisServer) -> None:
    # A plain SET NX GET marks a free name on Redis 7; an older server refuses NX with
    # GET and its client sends the script; a RESP3 client parses the reply itself.
    from fenced.celery import _enqueue

    resp3 = server.client(protocol=3)
    for client, name in ((r, "feed:mark"), (resp3, "feed:mark3")):
        keys = ClaimKeys("fenced", name)
        assert _enqueue.mark(client, keys, "t1", HOUR_MS, None) is None  # free: marked
        assert _enqueue.mark(client, keys, "t2", HOUR_MS, None) == "t1"  # queued: not
        assert _enqueue.mark(client, keys, "t2", HOUR_MS, "t9") == "t1"  # another run's
        assert _enqueue.mark(client, keys, "t1", HOUR_MS, None) is None  # its own again
        # the run holding the marker hands it over to the message it sends
        assert _enqueue.mark(client, keys, "t3", 5_000, "t1") is None
        assert r.get(keys.queued) in ("t3", b"t3") and 0 < r.pttl(keys.queued) <= 5_000
        r.delete(keys.queued)
        r.sadd(keys.queued, "x")
        with pytest.raises(redis.DataError, match="is not a string holding a task id"):
            _enqueue.mark(client, keys, "t4", HOUR_MS, None)
    resp3.close()

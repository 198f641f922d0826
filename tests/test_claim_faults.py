"""Faults the claim must survive: a lease gone before release, a late grant, a callback
that raises, a refresh interval that cannot work."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from _clock import ManualClock
from _wait import wait_for
from fenced import Claim, ClaimLost, ClaimUnavailable, ConfigError, exclusive, records
from fenced._guard import COOLDOWN_REASON
from fenced._lease import short_token
from fenced.testing import RedisServer, TcpProxy


def test_a_lease_gone_before_release_ends_the_block_as_lost(r: Any) -> None:
    claim = Claim(r, "vanished", ttl=30, records=True)
    with pytest.raises(ClaimLost, match="gone"), claim:
        r.delete(claim.key)  # evicted, failed over, or cleared by an operator
    run = records.last(r, "vanished")
    assert run is not None and run.outcome == "lost"


def test_a_release_that_released_nothing_resets_no_skip_count(r: Any) -> None:
    holder = Claim(r, "vanished-skips", ttl=30, records=True)
    assert holder.acquire()
    assert not Claim(r, "vanished-skips", ttl=30, records=True).acquire()
    assert records.consecutive_skips(r, "vanished-skips") == 1
    r.delete(holder.key)
    assert holder.release(outcome="ok") is False
    assert records.consecutive_skips(r, "vanished-skips") == 1
    (run,) = [
        x for x in records.history(r, "vanished-skips") if x.token == short_token(holder.token)
    ]
    assert run.outcome == "lost" and run.reason == "the lease was gone before release"


def test_an_exclusive_function_whose_lease_vanished_raises_claim_lost(r: Any) -> None:
    @exclusive("vanish:{k}", redis=r, ttl=30)
    def job(k: str) -> str:
        r.delete(f"fenced:{{vanish:{k}}}:lock")
        return "done"

    with pytest.raises(ClaimLost):
        job("a")
    run = records.last(r, "vanish:a")
    assert run is not None and run.outcome == "lost"


def test_a_grant_that_arrives_after_its_deadline_is_given_back(
    own_server: RedisServer,
) -> None:
    client = own_server.client()
    admin = own_server.client()
    claim = Claim(client, "late", ttl=1.0, records=True)
    assert claim.acquire()  # the script is cached: the next acquire is one EVALSHA
    claim.release()
    admin.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    with pytest.raises(ClaimUnavailable, match="after its own deadline"):
        claim.acquire()
    assert not claim.held
    assert client.get(claim.key) is None, "a late grant must not sit in Redis"
    other = Claim(client, "late", ttl=1.0)
    assert other.acquire(), "the name is free for the next holder at once"
    other.release()


def test_an_on_lost_that_raises_system_exit_stops_no_other_renewal(
    r: Any, fake_time: ManualClock
) -> None:
    def bail(_claim: Claim) -> None:
        raise SystemExit("callback gave up")

    doomed = Claim(r, "doomed", ttl=1.0, on_lost=bail, clock=fake_time)
    healthy = Claim(r, "healthy", ttl=1.0, clock=fake_time)
    assert doomed.acquire() and healthy.acquire()
    r.set(doomed.key, "thief")
    fake_time.run_until("doomed to be lost", lambda: doomed.lost, 5)
    assert doomed.lost
    fake_time.run(3.0)  # three ttls: renewals must have gone on
    assert healthy.held
    healthy.check()
    assert threading.active_count() >= 1
    healthy.release()


@pytest.mark.parametrize(("ttl", "refresh_every"), [(2, 1.99), (10, 6), (1, 0.9)])
def test_a_refresh_interval_that_cannot_work_is_refused_with_one_that_does(
    r: Any, ttl: float, refresh_every: float
) -> None:
    with pytest.raises(ConfigError, match=r"at most .*ttl/2") as info:
        Claim(r, "too-late", ttl=ttl, refresh_every=refresh_every)
    assert f"{ttl / 2:g}" in str(info.value)
    Claim(r, "too-late", ttl=ttl, refresh_every=ttl / 2)  # the value it names works


def test_a_hashed_name_is_the_same_claim_everywhere(redis_server: RedisServer) -> None:
    import json
    import subprocess
    import sys

    from fenced import claim_name, read_holder

    r = redis_server.client()
    name = claim_name("feed:{url}", url="https://example.com/feeds/a b?x={1}")
    claim = Claim(r, name, ttl=30, records=True)
    assert claim.acquire()
    assert claim.name == name
    holder = read_holder(r, claim.name)
    assert holder is not None and holder.token == short_token(claim.token)
    env = {"FENCED_REDIS_URL": redis_server.url, "PATH": "/usr/bin:/bin"}
    listed = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "ls", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    (shown,) = [c["name"] for c in json.loads(listed.stdout)]
    assert shown == claim.name
    released = subprocess.run(
        [sys.executable, "-m", "fenced.cli", "release", shown, "--force", "--reason", "test"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert released.returncode == 0, released.stderr
    assert "released" in released.stdout
    assert read_holder(r, claim.name) is None
    assert records.history(r, claim.name)[0].outcome == "released"


def test_an_idle_names_keys_expire_and_its_fence_still_rises(r: Any) -> None:
    week = 7 * 24 * 3600 * 1000
    a = Claim(r, "idle:a", ttl=5, records=True)
    assert a.acquire()
    assert not Claim(r, "idle:a", ttl=5, records=True).acquire(request_rerun=True)
    keys = a.keys
    for key in (keys.fence, keys.records, keys.skips, keys.rerun):
        assert 0 < r.pttl(key) <= week, key
    a.release()  # takes the rerun trigger, resets the skips
    for key in (keys.fence, keys.records):
        assert 0 < r.pttl(key) <= week, key
    first = a.fence
    # What the idle expiry does, sped up: the name's lasting keys are gone.
    r.delete(keys.fence, keys.records, keys.skips, keys.rerun)
    b = Claim(r, "idle:a", ttl=5)
    assert b.acquire()
    assert first is not None and b.fence is not None and b.fence > first
    b.release()
    forever = Claim(r, "idle:b", ttl=5, records=True, idle_ttl=None)
    assert forever.acquire()
    forever.release()
    assert r.pttl(forever.keys.fence) == -1 and r.pttl(forever.keys.records) == -1


def test_an_idle_expiry_shorter_than_twice_the_ttl_is_refused(r: Any) -> None:
    with pytest.raises(ConfigError, match="at least 10 seconds"):
        Claim(r, "idle:c", ttl=5, idle_ttl=9)
    with pytest.raises(ConfigError, match="at least 200 seconds"):
        Claim(r, "idle:c", ttl=100, idle_ttl=150)


def test_a_redis_restarted_empty_before_release_ends_the_block_as_lost(
    own_server: RedisServer,
) -> None:
    client = own_server.client()
    claim = Claim(client, "restarted", ttl=5.0)
    with pytest.raises(ClaimLost, match="gone before release"), claim:
        own_server.kill()
        threading.Timer(0.5, own_server.start).start()  # back, empty, within the lease
    assert claim.vanished


def test_a_release_that_cannot_reach_redis_reports_no_success(own_server: RedisServer) -> None:
    client = own_server.client(socket_timeout=0.5, socket_connect_timeout=0.5)
    claim = Claim(client, "unconfirmed", ttl=2.0)
    started = time.monotonic()
    with pytest.raises(ClaimLost, match="could not be reached to confirm"), claim:
        own_server.kill()
    assert time.monotonic() - started < claim.ttl + 2.0  # it gave up by the deadline
    assert claim.vanished


def test_a_claim_lost_before_its_release_never_ends_ok(r: Any) -> None:
    claim = Claim(r, "lost-first", ttl=5, heartbeat=False, records=True)
    assert claim.acquire()
    r.set(claim.key, "thief")
    claim.refresh()  # the heartbeat finds the lease taken
    # The work had finished ("ok") just before: the release must not say ok.
    assert claim.release(outcome="ok") is False
    assert claim.vanished
    other = Claim(r, "lost-first-2", ttl=5, heartbeat=False)
    assert other.acquire()
    r.delete(other.key)
    with pytest.raises(ClaimLost):
        other.end(None)


def test_a_release_sent_again_gets_the_first_answer(r: Any) -> None:
    claim = Claim(r, "sent-twice", ttl=5, heartbeat=False, records=True)
    assert claim.acquire()
    assert not Claim(r, "sent-twice", ttl=5).acquire(request_rerun="again")
    assert claim.token is not None
    # The first release lands, but its reply is lost on the way back ...
    first = claim._store.release(claim._release_call("ok", ""))
    assert first == (True, "ok", ["again"], None)
    # ... so the client sends it again: same answer, nothing recorded twice.
    assert claim.release() is True
    assert not claim.vanished and claim.rerun_triggers == ["again"]


def test_an_ok_release_sent_again_is_answered_by_its_done_marker(r: Any) -> None:
    claim = Claim(
        r,
        "sent-twice-done",
        ttl=5,
        heartbeat=False,
        records=True,
        task_id="t-1",
        redelivery_window=60,
    )
    assert claim.acquire()
    assert claim.completed_before is False  # no run of t-1 had ended
    assert claim.token is not None
    first = claim._store.release(claim._release_call("ok", "{}"))  # done marker: 60 s
    assert first == (True, "ok", [], None)
    # An ok run's marker is its release's note: no second key per run.
    assert not r.exists(claim.keys.released(claim.token))
    assert claim.finished_ok()
    assert claim.release() is True
    assert not claim.vanished
    assert [run.outcome for run in records.history(r, "sent-twice-done")] == ["ok"]
    # Another token's release is not answered by that marker: its lease was gone.
    stray = Claim(r, "sent-twice-done", ttl=5, heartbeat=False, task_id="t-1", redelivery_window=60)
    assert stray.acquire()
    # Its grant said the task id had run to the end: known without a round trip.
    assert stray.completed_before is True and stray.finished_ok()
    r.delete(stray.key)
    assert stray.release() is False
    assert stray.vanished


def test_an_ok_release_sent_again_after_a_short_done_marker_is_still_ok(r: Any) -> None:
    # A done marker shorter than the release note's minute cannot stand in for it: a
    # retry sent after the marker expired still gets the first answer, recorded once.
    claim = Claim(
        r,
        "sent-twice-short",
        ttl=5,
        heartbeat=False,
        records=True,
        task_id="t-2",
        redelivery_window=0.2,
    )
    assert claim.acquire()
    assert claim.token is not None
    first = claim._store.release(claim._release_call("ok", "{}"))
    assert first == (True, "ok", [], None)
    wait_for("the done marker to expire", lambda: not claim.finished_ok() or None, timeout=10)
    again = claim._store.release(claim._release_call("ok", "{}"))
    assert again == (True, "ok", [], None)
    assert [run.outcome for run in records.history(r, "sent-twice-short")] == ["ok"]


def test_a_script_runs_again_after_the_server_forgot_it(r: Any) -> None:
    claim = Claim(r, "forgotten", ttl=5, heartbeat=False, records=True)
    r.script_flush()
    assert claim.acquire()
    r.script_flush()
    assert claim.release() is True
    assert [run.outcome for run in records.history(r, "forgotten")] == ["ok"]


def test_a_long_run_keeps_its_names_keys_from_expiring(r: Any, fake_time: ManualClock) -> None:
    holder = Claim(r, "long-run", ttl=1.0, idle_ttl=2.0, clock=fake_time)
    assert holder.acquire()
    assert not Claim(r, "long-run", ttl=1.0, idle_ttl=2.0).acquire(request_rerun="later")
    # Redis counts the idle expiry in real seconds: left 1 s of it, the rerun request
    # is kept only if the renewals set it back to 2 s.
    r.pexpire(holder.keys.rerun, 1000)
    fake_time.run(3.5)  # longer than the idle expiry, renewed all along
    assert holder.held
    assert r.pttl(holder.keys.rerun) > 1000
    assert r.smembers(holder.keys.rerun)
    holder.release()
    assert holder.rerun_triggers == ["later"]


def test_a_release_answered_by_a_replica_ends_as_lost(own_server: RedisServer) -> None:
    # A failover demoted the master the claim was taken on: the release reaches a
    # replica (READONLY), which cannot say whether the lease lasted.
    other = RedisServer(own_server.binary).start()
    try:
        client = own_server.client()
        claim = Claim(client, "demoted", ttl=5.0)
        with pytest.raises(ClaimLost, match="could not be reached to confirm"), claim:
            client.execute_command("REPLICAOF", "127.0.0.1", other.port)
        assert claim.vanished
    finally:
        own_server.client().execute_command("REPLICAOF", "NO", "ONE")
        other.stop()


def test_an_address_that_is_not_redis_makes_acquire_raise_claim_unavailable(
    http_url: str,
) -> None:
    claim = Claim(http_url, "job:x", ttl=5, heartbeat=False)
    with pytest.raises(ClaimUnavailable) as info:
        claim.acquire()
    message = str(info.value)
    assert "not in the Redis protocol" in message and "not started" in message
    assert http_url.split("//")[1].split("/")[0] in message
    assert not claim.held


def _script_calls(client: Any) -> int:
    """How many scripts the server has run (EVALSHA and EVAL)."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def test_a_lost_release_reply_retried_sets_the_cooldown_window_once(
    redis_server: RedisServer,
) -> None:
    direct = redis_server.client(decode_responses=True)
    direct.flushall()
    name, window = "cooled-once", 3.0
    with TcpProxy(redis_server.port) as proxy, ThreadPoolExecutor(1) as pool:
        # No retries of redis-py's own: the retry under test is the claim's.
        client = redis.Redis(
            host="127.0.0.1",
            port=proxy.port,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
            decode_responses=True,
        )
        warm = Claim(client, "warm", ttl=10, heartbeat=False, cooldown=window)
        assert warm.acquire() and warm.release()  # the scripts are loaded: EVALSHA runs
        claim = Claim(client, name, ttl=10, heartbeat=False, records=True, cooldown=window)
        assert claim.acquire()
        scripts = _script_calls(direct)
        # The release lands and runs; its reply is held until the client has given up
        # on it and sent the release again.
        proxy.hold_replies()
        released = pool.submit(claim.release)
        first, seen = wait_for(
            "the release to land",
            lambda: (left := direct.pttl(claim.keys.cooldown)) > 0 and (left, time.monotonic()),
            timeout=10,
        )
        wait_for("the release sent again", lambda: _script_calls(direct) - scripts >= 2)
        proxy.heal()
        assert released.result(timeout=30) is True
        left = direct.pttl(claim.keys.cooldown)
        since = time.monotonic() - seen
        client.close()
    assert not claim.vanished
    # The window runs from the first release: a retry that set it again (0.5 s and more
    # later, after the client's timeout) would leave that much more.
    assert 0 < left <= first - since * 1000 + 100, (first, left, since)
    assert direct.get(claim.keys.cooldown) == str(claim.fence)
    assert [(run.outcome, run.fence) for run in records.history(direct, name)] == [
        ("ok", claim.fence)
    ]

    # A trigger within the window is skipped as having run recently ...
    assert not Claim(direct, name, ttl=10, heartbeat=False, records=True, cooldown=window).acquire()
    skip = records.history(direct, name)[0]
    assert skip.outcome == "skipped" and skip.reason == COOLDOWN_REASON
    # ... and one after it runs.
    wait_for("the window to end", lambda: not direct.exists(claim.keys.cooldown), timeout=10)
    later = Claim(direct, name, ttl=10, heartbeat=False, records=True, cooldown=window)
    assert later.acquire()
    assert later.fence is not None and claim.fence is not None and later.fence > claim.fence
    assert later.release() is True
    outcomes = [run.outcome for run in records.history(direct, name)]
    assert outcomes == ["ok", "skipped", "ok"]
    direct.close()

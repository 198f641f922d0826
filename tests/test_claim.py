"""The claim against real Redis servers: atomicity, ownership, fences, loss."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fenced import Claim, ClaimHeld, ClaimLost, ClaimUnavailable, ConfigError, FencedError, NotOwner
from fenced._lease import short_token
from fenced.testing import RedisServer, free_port


class CountingConnection(redis.UnixDomainSocketConnection):
    """Counts what the client puts on the wire: one call here is one round trip."""

    sent: list[Any] = []

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        CountingConnection.sent.append(command)
        # redis-py leaves this method unannotated; this is the signature it has.
        send: Callable[[Any, bool], None] = super().send_packed_command
        send(command, check_health)


def test_acquire_is_one_round_trip_and_exclusive(server: RedisServer, r: Any) -> None:
    assert server.socket_path
    counted = redis.Redis(
        connection_pool=redis.ConnectionPool(
            connection_class=CountingConnection, path=server.socket_path
        )
    )
    a = Claim(counted, "rebuild:incidents", ttl=5, heartbeat=False)
    b = Claim(r, "rebuild:incidents", ttl=5, heartbeat=False)
    a.acquire()  # loads the script into the server cache
    a.release()
    CountingConnection.sent.clear()
    assert a.acquire() is True
    assert len(CountingConnection.sent) == 1
    assert b"EVALSHA" in bytes(CountingConnection.sent[0][0])
    assert b.acquire() is False
    assert a.held and not b.held
    assert b.holder is not None and b.holder.token == short_token(a.token)
    assert b.holder.fence == a.fence
    assert b.holder.pid == os.getpid()
    assert 0 < (b.holder.expires_in or 0) <= 5
    assert a.release() is True
    assert b.acquire() is True
    assert b.fence is not None and a.fence is not None and b.fence > a.fence
    b.release()


def test_fifty_threads_racing_exactly_one_wins(server: RedisServer) -> None:
    client = server.client()
    for round_ in range(5):
        claims = [Claim(client, f"race:{round_}", ttl=10, heartbeat=False) for _ in range(50)]
        barrier = threading.Barrier(50)
        won: list[Claim] = []

        def go(c: Claim, barrier: threading.Barrier, won: list[Claim]) -> None:
            barrier.wait()
            if c.acquire():
                won.append(c)

        threads = [threading.Thread(target=go, args=(c, barrier, won)) for c in claims]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        assert client.get(won[0].key).decode() == won[0].token


def test_token_is_unguessable_and_readable(r: Any) -> None:
    c = Claim(r, "t", ttl=5, heartbeat=False, task_id="task-123")
    c.acquire()
    assert c.token is not None
    rand, host, pid, task = c.token.split(":", 3)
    assert len(rand) == 32 and int(rand, 16) >= 0  # 128 random bits
    assert pid == str(os.getpid()) and task == "task-123" and host
    c.release()


def test_release_and_refresh_never_touch_another_token(r: Any) -> None:
    a = Claim(r, "own", ttl=5, heartbeat=False)
    assert a.acquire()
    r.set(a.key, "someone-else", px=5000)
    assert a.refresh() is False
    assert a.lost
    assert a.release() is False
    value = r.get(a.key)
    assert value in (b"someone-else", "someone-else")
    assert 0 < r.pttl(a.key) <= 5000


def test_release_reports_when_we_no_longer_own_it(r: Any) -> None:
    a = Claim(r, "gone", ttl=5, heartbeat=False)
    assert a.acquire()
    r.delete(a.key)
    assert a.release() is False
    assert a.release() is False  # twice is harmless


def test_fence_strictly_increases_over_1000_acquisitions(r: Any) -> None:
    c = Claim(r, "fence:many", ttl=5, heartbeat=False)
    fences: list[int] = []
    for _ in range(1000):
        assert c.acquire()
        assert c.fence is not None
        fences.append(c.fence)
        c.release()
    assert all(b > a for a, b in itertools.pairwise(fences))


def test_fence_survives_restart_without_persistence(own_server: RedisServer) -> None:
    client = own_server.client()
    c = Claim(client, "fence:restart", ttl=5, heartbeat=False)
    # Push the counter ahead of the clock floor, the case a restart could undo.
    last = 0
    for _ in range(50):
        assert c.acquire()
        assert c.fence is not None and c.fence > last
        last = c.fence
        c.release()
    own_server.restart()
    assert client.get(c.keys.fence) is None  # the counter really is gone
    assert c.acquire()
    assert c.fence is not None and c.fence > last
    c.release()


def test_context_manager(r: Any) -> None:
    with Claim(r, "ctx", ttl=5) as c:
        assert c
        other = Claim(r, "ctx", ttl=5)
        with pytest.raises(ClaimHeld), other:
            pytest.fail("the body of a busy claim ran")
        assert other.holder is not None and other.holder.token == short_token(c.token)
    assert r.get(c.key) is None


def test_context_manager_raises_when_lost_during_block(r: Any) -> None:
    with pytest.raises(ClaimLost), Claim(r, "ctx-lost", ttl=5, heartbeat=False) as c:
        r.set(c.key, "thief")
        c.refresh()
    assert r.get(c.key) in (b"thief", "thief")


def test_blocking_acquire_waits_for_release(r: Any) -> None:
    a = Claim(r, "wait", ttl=5)
    b = Claim(r, "wait", ttl=5)
    assert a.acquire()
    threading.Timer(0.3, a.release).start()
    assert b.acquire(blocking=True, timeout=5)
    assert b.fence is not None and a.fence is not None and b.fence > a.fence
    b.release()


def test_blocking_acquire_times_out(r: Any) -> None:
    a = Claim(r, "wait-out", ttl=5)
    b = Claim(r, "wait-out", ttl=5)
    assert a.acquire()
    start = time.monotonic()
    assert b.acquire(blocking=True, timeout=0.3) is False
    assert time.monotonic() - start >= 0.3
    a.release()


def test_steps_checks_between_steps(r: Any) -> None:
    c = Claim(r, "steps", ttl=5, heartbeat=False)
    c.acquire()
    done = []
    with pytest.raises(ClaimLost):
        for i in c.steps(range(5)):
            done.append(i)
            if i == 2:
                r.set(c.key, "thief")
                c.refresh()
    assert done == [0, 1, 2]


def test_check_without_claim_is_not_owner(r: Any) -> None:
    c = Claim(r, "never", ttl=5)
    with pytest.raises(NotOwner):
        c.check()


def test_local_deadline_without_heartbeat(r: Any) -> None:
    now = [100.0]
    c = Claim(r, "clock", ttl=10, heartbeat=False, clock=lambda: now[0])
    c.acquire()
    c.check()
    now[0] += 9.9  # inside the drift margin: already too late to trust the lease
    with pytest.raises(ClaimLost):
        c.check()


def test_unreachable_redis_fails_closed_with_address() -> None:
    port = free_port()
    # One try: the message is the same after redis-py's retries, seconds later.
    client = redis.Redis(port=port, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    c = Claim(client, "down", ttl=5)
    with pytest.raises(ClaimUnavailable) as info:
        c.acquire()
    assert f"127.0.0.1:{port}" in str(info.value) or f"localhost:{port}" in str(info.value)
    assert info.value.name == "down"
    assert isinstance(info.value, FencedError)
    assert not c.held


@pytest.mark.parametrize(
    ("kwargs", "fix"),
    [
        ({"ttl": 0}, "positive number"),
        ({"ttl": -1}, "positive number"),
        ({"ttl": 10, "refresh_every": 10}, "below ttl"),
        ({"ttl": 10, "refresh_every": 0}, "above 0"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_fix(
    r: Any, kwargs: dict[str, Any], fix: str
) -> None:
    with pytest.raises(ConfigError, match=fix) as info:
        Claim(r, "bad", **kwargs)
    assert isinstance(info.value, ValueError)


def test_empty_name_is_rejected(r: Any) -> None:
    with pytest.raises(ConfigError, match="empty"):
        Claim(r, "", ttl=5)


def test_acquire_twice_is_an_error(r: Any) -> None:
    c = Claim(r, "twice", ttl=5, heartbeat=False)
    c.acquire()
    with pytest.raises(FencedError, match="already held"):
        c.acquire()
    c.release()


HOLDER = textwrap.dedent(
    """
    import sys, time, redis
    from fenced import Claim, ClaimLost
    client = redis.Redis.from_url(sys.argv[1])
    c = Claim(client, "paused", ttl=1.0)
    assert c.acquire()
    print("acquired", c.fence, flush=True)
    try:
        for i in c.steps(range(1000)):
            print("step", i, flush=True)
            time.sleep(0.05)
    except ClaimLost:
        print("lost", flush=True)
        print("released", c.release(), flush=True)
    """
)


def test_paused_holder_declares_loss_and_spares_new_holder(own_server: RedisServer) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, own_server.url], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("acquired")
        assert proc.stdout.readline().startswith("step")
        os.kill(proc.pid, signal.SIGSTOP)
        client = own_server.client()
        thief = Claim(client, "paused", ttl=30)
        deadline = time.monotonic() + 10
        while not thief.acquire():
            assert time.monotonic() < deadline, "lease never expired"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=20)
        assert "lost" in out.splitlines()
        assert "released False" in out
        assert client.get(thief.key).decode() == thief.token
        thief.release()
    finally:
        proc.kill()
        proc.wait()


def test_acquire_retried_by_the_client_after_a_timeout_is_ours(own_server: RedisServer) -> None:
    # redis-py retries a command that timed out (its default retry policy). When the first
    # ACQUIRE did land, the retry finds the lease under our own token: that is our
    # acquisition, not a competitor's, and must neither be skipped nor counted as a skip.
    client = redis.Redis(
        port=own_server.port,
        socket_timeout=0.3,
        retry=redis.retry.Retry(redis.backoff.ConstantBackoff(1.0), 1),
    )
    warm = Claim(client, "warm", ttl=30, heartbeat=False)  # the server has the script
    assert warm.acquire() and warm.release()
    c = Claim(client, "retried", ttl=30, heartbeat=False, records=True)
    own_server.pause()
    resume = threading.Timer(0.6, own_server.resume)
    resume.start()
    try:
        assert c.acquire()
    finally:
        resume.join()
    # A client without decode_responses: what it reads back is bytes.
    assert cast(bytes, client.get(c.key)).decode() == c.token
    assert c.fence is not None and c.fence == int(cast(bytes, client.get(c.keys.fence)))
    assert c.skips == 0 and client.get(c.keys.skips) is None
    assert c.release()


def test_refresh_confirmed_after_the_local_deadline_does_not_revive_the_claim(r: Any) -> None:
    # A refresh sent before the local deadline whose reply arrives after it: no refresh
    # was confirmed before the deadline, so the claim is lost; it must not be held again.
    times = iter([100.0, 109.8, 110.5])  # acquire sent, refresh sent, reply read
    now = [100.0]

    def clock() -> float:
        now[0] = next(times, now[0])
        return now[0]

    c = Claim(r, "late-reply", ttl=10, heartbeat=False, clock=clock)
    assert c.acquire()
    assert c.refresh() is False
    assert c.lost and not c.held
    with pytest.raises(ClaimLost):
        c.check()
    assert c.release()  # the lease itself was still ours: release deletes it


def test_run_cleared_by_an_operator_is_one_released_run(r: Any) -> None:
    # The holder died; an operator cleared its claim. That is one run, ended by the
    # release (who and why kept), not the release and a second copy of it.
    from fenced import records
    from fenced._inspect import force_release

    dead = Claim(r, "cleared", ttl=5, heartbeat=False, records=True, task_id="t-1")
    assert dead.acquire()
    assert force_release(r, "cleared", reason="holder died", by="ops@host") is not None
    runs = records.history(r, "cleared")
    assert [run.outcome for run in runs] == ["released"]
    assert runs[0].token == short_token(dead.token) and runs[0].fence == dead.fence
    assert runs[0].task_id == "t-1" and runs[0].reason == "holder died"
    assert runs[0].extra["by"] == "ops@host"


def test_a_replica_refuses_and_the_claim_fails_closed(own_server: RedisServer) -> None:
    replica = RedisServer(
        own_server.binary, extra=["--replicaof", "127.0.0.1", str(own_server.port)]
    ).start()
    try:
        c = Claim(replica.client(), "on-replica", ttl=5)
        with pytest.raises(ClaimUnavailable, match=r"(?i)read.?only") as info:
            c.acquire()
        assert "master" in str(info.value)
        assert not c.held
        assert own_server.client().get(c.key) is None
    finally:
        replica.stop()


def test_for_call_copies_a_claim_for_another_name_task_and_record(r: Any) -> None:
    """A claim copied with for_call (a Celery task's runs) holds its own lease, under its
    own name and task id, and its run records carry its own fields; the claim it was
    copied from is never touched, and copies held at once are independent."""
    from fenced import records
    from fenced._heartbeat import heartbeat

    lost: list[Any] = []
    template = Claim(r, "copy:0", ttl=5, namespace="copied", records=True, max_records=7)
    a = template.for_call("copy:a", "task-a", {"task": "t", "args": {"n": "a"}}, lost.append)
    b = template.for_call("copy:b", "task-b", {"task": "t", "args": {"n": "b"}})
    assert a.acquire() and b.acquire()
    assert (a.name, a.task_id, a.namespace, a.options.max_records) == (
        "copy:a",
        "task-a",
        "copied",
        7,
    )
    assert a.key == "copied:{copy:a}:lock" and b.key == "copied:{copy:b}:lock"
    assert a.fence is not None and b.fence is not None
    assert not template.held and template.token is None
    assert a in heartbeat().claims() and b in heartbeat().claims()
    assert a.release() is True
    assert b.held and a not in heartbeat().claims() and b in heartbeat().claims()
    # The other copy's loss is its own: it is refused, and told, while ``a`` is gone.
    r.delete(b.key)
    assert b.refresh() is False and b.lost and not lost
    (run,) = records.history(r, "copy:a", namespace="copied")
    assert (run.task_id, run.outcome, run.extra.get("args")) == ("task-a", "ok", {"n": "a"})
    assert records.history(r, "copy:0", namespace="copied") == []


def test_fields_encoded_once_are_read_back_with_each_run(r: Any) -> None:
    """Fields every call of a front end shares (a Celery task's name, template and
    worker) are encoded once (records.encode_fields) and written into each run's record
    beside the call's own: the readers see them as any other field."""
    from fenced import records

    shared = records.encode_fields({"task": "t.build", "template": "b:{n}", "worker": "w@h"})
    template = Claim(r, "enc:0", ttl=5, namespace="encoded", records=True)
    for n in ("a", "b"):
        claim = template.for_call(f"enc:{n}", f"task-{n}", {"args": {"n": n}}, None, shared)
        assert claim.acquire() and claim.release()
        (run,) = records.history(r, f"enc:{n}", namespace="encoded")
        assert (run.task_id, run.outcome, run.worker) == (f"task-{n}", "ok", "w@h")
        assert run.extra == {"task": "t.build", "template": "b:{n}", "args": {"n": n}}
        assert run.duration is not None and run.started is not None
    with pytest.raises(ValueError, match="task_id"):
        records.encode_fields({"task_id": "x"})

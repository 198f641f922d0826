"""N at a time: ``limit`` lets up to N holders of one name run, each in a slot of its own.

Real processes race for the slots against a Redis the test owns; what they did is
checked from the run records (how many runs overlapped, by their started and finished
entries) and by a live counter each holder bumps. No test asserts on speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from _clock import ManualClock
from _wait import wait_for
from celery_harness import WAIT, key
from fenced import Claim, ClaimLost, ClaimOptions, ConfigError, aio, exclusive, records
from fenced._inspect import read_slots
from fenced._lease import MAX_LIMIT, ClaimKeys, LeaseStore, new_token
from fenced.celery._options import resolve, validate
from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent

RACER = textwrap.dedent(
    """
    import random, sys, time
    import redis
    from fenced import Claim

    url, name, limit, attempts = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    r = redis.Redis.from_url(url, decode_responses=True)
    while not r.exists(f"go:{name}"):
        time.sleep(0.005)
    for _ in range(attempts):
        claim = Claim(r, name, ttl=10, limit=limit, records=True, max_records=100_000)
        if claim.acquire():
            live = r.incr(f"live:{name}")
            r.rpush(f"seen:{name}", live)
            time.sleep(random.uniform(0.002, 0.02))
            r.decr(f"live:{name}")
            claim.release()
        else:
            time.sleep(random.uniform(0.001, 0.01))
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}


def _most_at_once(runs: list[records.RunRecord]) -> int:
    """The most runs whose started..finished intervals overlapped (an end comes first at
    a tie: the stream's times are milliseconds)."""
    events = []
    for run in runs:
        assert run.started is not None and run.finished is not None, run
        events += [(run.started, 1), (run.finished, -1)]
    most = live = 0
    for _at, step in sorted(events, key=lambda e: (e[0], e[1])):
        live += step
        most = max(most, live)
    return most


@pytest.fixture
def rc(server: RedisServer) -> Iterator[redis.Redis]:
    client = server.client(decode_responses=True)
    yield client
    client.close()


@pytest.mark.parametrize("limit", [2, 3])
def test_racing_processes_never_exceed_the_limit(
    server: RedisServer, rc: redis.Redis, limit: int
) -> None:
    name = f"race:{key()}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, server.url, name, str(limit), "40"],
            env=_env(),
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    rc.set(f"go:{name}", 1)
    for proc in procs:
        _out, err = proc.communicate(timeout=WAIT * 3)
        assert proc.returncode == 0, err
    seen = [int(x) for x in rc.lrange(f"seen:{name}", 0, -1)]
    assert seen and max(seen) <= limit, seen
    runs = [r for r in records.history(rc, name, limit=100_000) if r.outcome != "skipped"]
    assert len(runs) == len(seen)
    assert all(r.outcome == "ok" for r in runs)
    assert _most_at_once(runs) <= limit
    # Several ran side by side (six processes, each holding a while): the slots were used.
    assert max(seen) >= 2
    # One fence counter for every slot: distinct, increasing in the order runs started.
    fences = [r.fence or 0 for r in reversed(runs)]
    assert all(fences)
    assert fences == sorted(set(fences)), "fences repeat or go back"
    # And all slots were busy at times: those attempts were recorded as skips.
    assert any(r.outcome == "skipped" for r in records.history(rc, name, limit=100_000))


def test_each_holder_has_its_own_slot_lease_and_fence(server: RedisServer) -> None:
    client = server.client()
    name = f"n:{key()}"
    claims = [Claim(client, name, ttl=5, limit=3) for _ in range(4)]
    assert [c.acquire() for c in claims] == [True, True, True, False]
    assert [c.slot for c in claims[:3]] == [0, 1, 2]
    fences = [c.fence or 0 for c in claims[:3]]
    assert all(fences) and fences == sorted(set(fences))
    keys = ClaimKeys.of(name)
    # Slot 0 is the plain claim's key: fenced ls, release and a limit-1 claim see it.
    assert client.get(keys.lock).decode() == claims[0].token
    assert client.get(keys.slot(1)).decode() == claims[1].token
    busy = claims[3]
    assert busy.holder is not None and busy.holder.fence in fences
    assert not Claim(client, name, ttl=5).acquire()  # limit 1: slot 0 is held
    # A release frees its own slot only, and the next holder takes it.
    assert claims[1].release()
    assert client.get(keys.lock) is not None and client.get(keys.slot(2)) is not None
    assert busy.acquire() and busy.slot == 1
    assert busy.fence is not None and busy.fence > max(fences)
    # Each renews its own lease.
    assert claims[2].refresh()
    assert claims[0].release("failed") and claims[2].release() and busy.release()
    assert read_slots(client, name) == []


def test_a_limit_of_one_is_the_plain_claim(server: RedisServer) -> None:
    # The scripts are sent the keys and arguments a plain claim always sent.
    keys = ClaimKeys.of("plain")
    store = LeaseStore(None, keys, ClaimOptions(ttl=1, max_records=10, idle_ttl=None, limit=1))
    _script, sent_keys, args = store.acquire_call("t", "", "", "", None)
    assert tuple(sent_keys) == (keys.lock, keys.fence, keys.records, keys.skips, keys.rerun)
    assert len(args) == 8
    _script, release_keys, release_args = store.release_call("t", "", "ok", 1)
    # ... and the name's replaced notes, read only by a release that finds its lease gone.
    assert release_keys[0] == keys.lock and len(release_keys) == 7 and len(release_args) == 11
    assert release_keys[-1] == keys.replaced and release_args[-1] == "1"
    client = server.client(decode_responses=True)
    name = f"one:{key()}"
    with Claim(client, name, ttl=5, limit=1) as claim:
        assert claim.slot == 0
        present = set(client.keys(f"*{name}*"))
        assert present == {
            ClaimKeys.of(name).lock,
            ClaimKeys.of(name).fence,
        }


def test_a_redelivered_task_finds_its_own_slot(server: RedisServer) -> None:
    client = server.client()
    name = f"re:{key()}"
    first = Claim(client, name, ttl=5, limit=2, task_id="task-1", records=True)
    assert first.acquire()
    again = Claim(client, name, ttl=5, limit=2, task_id="task-1", records=True)
    # Slot 1 is free, but the earlier attempt of the same task holds slot 0: not a second run.
    assert not again.acquire()
    assert again.holder is not None and again.holder.task_id == "task-1"
    assert again.skips == 0
    other = Claim(client, name, ttl=5, limit=2, task_id="task-2")
    assert other.acquire() and other.slot == 1
    # A retried ACQUIRE (its reply lost) finds its own slot and the fence minted for it.
    opts = ClaimOptions(ttl=5, limit=2, max_records=100, idle_ttl=None)
    store = LeaseStore(client, ClaimKeys.of(name), opts)
    token = new_token("task-3")
    assert other.release()
    granted = store.grant(store.acquire_call(token, "", "", "", "task-3"))
    retried = store.grant(store.acquire_call(token, "", "", "", "task-3"))
    assert [int(x) for x in granted] == [int(x) for x in retried]
    assert int(granted[0]) == 1 and int(granted[2]) == 1


def test_changing_the_limit_never_allows_more_than_the_larger(server: RedisServer) -> None:
    client = server.client()
    name = f"ch:{key()}"
    old = [Claim(client, name, ttl=5, limit=3) for _ in range(3)]
    assert all(c.acquire() for c in old)
    new = [Claim(client, name, ttl=5, limit=2) for _ in range(2)]
    assert not any(c.acquire() for c in new)
    assert old[2].release()  # slot 2: not one the new limit uses
    assert not any(c.acquire() for c in new)
    assert old[0].release()
    assert new[0].acquire() and new[0].slot == 0
    assert not new[1].acquire()
    assert len(read_slots(client, name)) == 2
    # And up again: the old slot 2 is used once more.
    assert Claim(client, name, ttl=5, limit=3).acquire()
    assert len(read_slots(client, name)) == 3


def test_a_killed_holders_slot_frees_after_its_ttl(server: RedisServer) -> None:
    client = server.client()
    name = f"k:{key()}"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, redis; from fenced import Claim; "
            "c = Claim(redis.Redis.from_url(sys.argv[1]), sys.argv[2], ttl=2, limit=2); "
            "assert c.acquire(); print(c.slot, flush=True); time.sleep(600)",
            server.url,
            name,
        ],
        env=_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    dead_slot = int(holder.stdout.readline())
    mine = Claim(client, name, ttl=30, limit=2)
    assert mine.acquire() and mine.slot == 1 - dead_slot
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    later = Claim(client, name, ttl=30, limit=2)
    wait_for("the dead holder's slot to expire", later.acquire, every=0.1)
    assert later.slot == dead_slot and mine.held
    assert mine.release() and later.release()


def test_a_paused_redis_loses_a_slot_lease_like_any_lease(own_server: RedisServer) -> None:
    client = own_server.client(socket_timeout=0.5)
    name = f"p:{key()}"
    first = Claim(client, name, ttl=1.5, limit=2)
    second = Claim(client, name, ttl=1.5, limit=2)
    assert first.acquire() and second.acquire() and second.slot == 1
    own_server.pause()
    try:
        wait_for("the slot's claim to be lost", lambda: second.lost)
    finally:
        own_server.resume()
    assert second.lost_reason is not None and "refresh" in second.lost_reason
    with pytest.raises(ClaimLost):
        second.check()
    # Given back as lost; the slot is taken again once Redis has let it go.
    second.release()
    nxt = Claim(client, name, ttl=5, limit=2, records=True)
    wait_for("a slot to be free again", nxt.acquire, every=0.1)
    assert nxt.fence is not None and second.fence is not None and nxt.fence > second.fence


def test_slots_on_a_cluster(cluster_server: RedisServer) -> None:
    from redis.cluster import RedisCluster

    client = RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        name = f"cl:{key()}"
        claims = [Claim(client, name, ttl=1, limit=3, records=True) for _ in range(4)]
        assert [c.acquire() for c in claims] == [True, True, True, False]
        wait_for("a renewal of each slot", lambda: all(c.refresh() for c in claims[:3]))
        assert len(read_slots(client, name)) == 3
        assert all(c.release() for c in claims[:3])
        assert read_slots(client, name) == []
    finally:
        client.close()


def test_an_asyncio_claim_takes_a_slot(server: RedisServer, fake_time: ManualClock) -> None:
    import redis.asyncio

    name = f"aio:{key()}"

    async def main() -> list[Any]:
        client = redis.asyncio.Redis.from_url(server.url)
        fake_time.renewer_for_this_loop()
        try:
            claims = [aio.Claim(client, name, ttl=1, limit=2, clock=fake_time) for _ in range(3)]
            got = [await c.acquire() for c in claims]
            await fake_time.run_async(1.5)  # past the ttl: each slot renewed by the renewer
            held = [c.held for c in claims[:2]]
            slots = [c.slot for c in claims[:2]]
            released = [await c.release() for c in claims[:2]]
            return [got, held, slots, released]
        finally:
            await client.aclose()

    got, held, slots, released = asyncio.run(main())
    assert got == [True, True, False]
    assert held == [True, True] and slots == [0, 1] and released == [True, True]


def test_a_decorated_function_runs_n_at_a_time(server: RedisServer) -> None:
    name = f"fn:{key()}"
    blocker = Claim(server.client(), name, ttl=5, limit=2)
    assert blocker.acquire()

    @exclusive(name, redis=server.url, ttl=5, limit=2)
    def job() -> str:
        inner = job()  # a second call while this one holds the other slot
        return f"ran; inner {inner if inner else 'skipped'}"

    assert job() == "ran; inner skipped"
    assert blocker.release()


@pytest.mark.parametrize("value", [0, -1, MAX_LIMIT + 1, 2.5, "3", True, None])
def test_a_bad_limit_is_refused_naming_the_bounds(server: RedisServer, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"from 1 .* to {MAX_LIMIT}"):
        Claim(server.client(), "x", limit=value)
    with pytest.raises(ConfigError, match="limit="):
        exclusive("x", redis=server.url, limit=value)


def test_celery_and_run_options_check_the_limit() -> None:
    from fenced._run import RunOptions

    class Conf(dict[str, Any]):
        pass

    assert resolve({}, Conf(), "task t").claim.limit == 1
    assert resolve({}, Conf(fenced_claim_limit=3), "task t").claim.limit == 3
    assert resolve({"claim_limit": 2}, Conf(fenced_claim_limit=3), "task t").claim.limit == 2
    with pytest.raises(ConfigError, match="task t: claim_limit=0"):
        validate({"claim_limit": 0}, "task t")
    with pytest.raises(ConfigError, match="--limit=65"):
        RunOptions("x", ["true"], {"limit": 65}).check()


# -- seen from outside: ls, show, release -----------------------------------------------


def _cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fenced.cli", *args],
        capture_output=True,
        text=True,
        env={**_env(), "FENCED_REDIS_URL": url, "COLUMNS": "200"},
        timeout=WAIT,
    )


def test_ls_show_and_release_see_every_slot(server: RedisServer) -> None:
    import json

    client = server.client()
    name = f"cli:{key()}"
    claims = [Claim(client, name, ttl=30, limit=3, records=True) for _ in range(3)]
    assert all(c.acquire() for c in claims)
    assert claims[0].release()  # slot 0 free: the name is still listed by its slots
    ls = _cli(server.url, "ls", "--json")
    (info,) = [i for i in json.loads(ls.stdout) if i["name"] == name]
    assert info["limit"] == 3 and [s["slot"] for s in info["slots"]] == [1, 2]
    assert [s["fence"] for s in info["slots"]] == [claims[1].fence, claims[2].fence]
    assert info["last_outcome"] == "ok"  # the runs of the other holders are not "unfinished"
    assert "2/3 held" in _cli(server.url, "ls").stdout
    show = _cli(server.url, "show", name)
    assert "2/3 held" in show.stdout and "slot 2" in show.stdout
    # Two holders: release names one (a token prefix) or --all; by itself it refuses.
    refused = _cli(server.url, "release", "--force", "--reason", "test", name)
    assert refused.returncode == 1 and "--all" in refused.stderr
    assert claims[1].held and claims[2].held
    assert claims[2].token is not None
    one = _cli(
        server.url, "release", "--force", "--reason", "test", "--token", claims[2].token[:8], name
    )
    assert one.returncode == 0, one.stderr
    assert [i for i, _h in read_slots(client, name)] == [1]
    claims.append(Claim(client, name, ttl=30, limit=3))
    assert claims[3].acquire()
    every = _cli(server.url, "release", "--force", "--reason", "test", "--all", "--json", name)
    assert every.returncode == 0, every.stderr
    assert len(json.loads(every.stdout)["holders"]) == 2
    assert read_slots(client, name) == []


# -- Celery: claim_limit on a threads pool ----------------------------------------------


def test_a_task_with_a_limit_runs_that_many_at_once(redis_server: RedisServer) -> None:
    from celery_harness import Services, Worker, notes

    services = Services.on(redis_server)
    client = services.client()
    obs = services.obs()
    k = key()
    try:
        with Worker(services, pool="threads", concurrency=3, name="limit"):
            sent = [
                client.send_task("t.limited", args=(k,), queue=services.queue) for _ in range(3)
            ]
            skipped = wait_for(
                "one of three to be skipped",
                lambda: [r for r in sent if r.ready()],
            )
            (result,) = [r.get(timeout=WAIT) for r in skipped]
            assert result["status"] == "skipped" and result["reason"] == "already running"
            runs = wait_for("two runs to start", lambda: len(notes(obs, f"runs:{k}")) == 2)
            assert runs
            started = notes(obs, f"runs:{k}")
            assert sorted(s["slot"] for s in started) == [0, 1]
            assert len({s["fence"] for s in started}) == 2
            for n in range(2):
                obs.set(f"gate:{k}:{n}", 1)
            done = [r.get(timeout=WAIT) for r in sent if r.id != skipped[0].id]
            assert [d["status"] for d in done] == ["ok", "ok"]
    finally:
        client.close()


def test_a_slot_is_never_handed_over_or_taken_over(r: Any) -> None:
    claim = Claim(r, "limit-handover", ttl=5, limit=2, task_id="t-1", heartbeat=False)
    with pytest.raises(ConfigError, match="limit 1 only"):
        claim.take_over()
    assert claim.acquire()
    with pytest.raises(ConfigError, match="limit 1 only"):
        claim.hand_over(5.0)
    assert claim.held
    assert claim.release()


def test_a_redelivered_task_never_runs_beside_its_paused_attempt_in_a_free_slot(
    redis_server: RedisServer,
) -> None:
    from celery_harness import Services, Worker, notes

    # The lease outlives the visibility timeout: the message comes back while the
    # paused attempt still holds slot 0, and slot 1 is free.
    services = Services.on(redis_server, ttl=5.0)
    client = services.client()
    obs, locks = services.obs(), services.locks()
    k = key()
    name = f"limited:{k}"
    paused: int | None = None
    try:
        with Worker(services, concurrency=1, visibility=2, name="paused") as first:
            x = client.send_task("t.limited", args=(k,), queue=services.queue)
            wait_for("the first run", lambda: notes(obs, f"runs:{k}"), proc=first.proc)
            (held,) = read_slots(locks, name)
            slot, attempt = held
            assert slot == 0 and attempt.task_id == x.id and attempt.pid is not None
            paused = attempt.pid
            os.kill(paused, signal.SIGSTOP)  # a pool child frozen mid-run: no renewals
            with Worker(services, pool="threads", concurrency=3, visibility=2, name="again"):
                # Until the redelivered message runs: who holds which slot, by Redis's clock.
                samples: list[tuple[float, list[tuple[int, Any]]]] = []

                def sample() -> bool:
                    secs, micros = locks.time()
                    samples.append((secs + micros / 1e6, read_slots(locks, name, limit=2)))
                    return len(notes(obs, f"runs:{k}")) >= 2

                wait_for("the redelivered message to run", sample, every=0.02)
                retried = [n for n in notes(obs, "signal:retry") if n["task_id"] == x.id]
                assert retried and all("ClaimHeld" in n["reason"] for n in retried)
                second = notes(obs, f"runs:{k}")[1]
                assert second["task_id"] == x.id and second["fence"] > attempt.fence
                # Both slots taken by two tasks: a third is skipped, the paused one is not
                # among them.
                y = client.send_task("t.limited", args=(k,), queue=services.queue)
                wait_for("a second task to run", lambda: len(notes(obs, f"runs:{k}")) >= 3)
                z = client.send_task("t.limited", args=(k,), queue=services.queue)
                assert z.get(timeout=WAIT)["status"] == "skipped"
                # The redelivered run found its earlier attempt's run unfinished ...
                (earlier,) = [r for r in records.history(locks, name) if r.token == attempt.token]
                assert earlier.outcome == "aborted"
                # ... and resumed, that attempt finds its claim lost and takes no slot back.
                os.kill(paused, signal.SIGCONT)
                paused = None
                failed = wait_for(
                    "the first attempt to fail",
                    lambda: [n for n in notes(obs, "signal:failure") if n["task_id"] == x.id],
                )
                assert [n["exc"].split("(")[0] for n in failed] == ["ClaimLost"]
                (earlier,) = [r for r in records.history(locks, name) if r.token == attempt.token]
                assert earlier.outcome == "lost" and earlier.fence == attempt.fence
                holders = read_slots(locks, name)
                assert sorted(h.task_id or "" for _i, h in holders) == sorted([x.id, y.id])
                for n in (1, 2):
                    obs.set(f"gate:{k}:{n}", 1)
                assert y.get(timeout=WAIT)["status"] == "ok"
                wait_for("the redelivered run to end", lambda: len(notes(obs, f"ends:{k}")) >= 2)
    finally:
        if paused is not None:
            with contextlib.suppress(ProcessLookupError):  # killed with its worker
                os.kill(paused, signal.SIGCONT)
        client.close()
    # Never more than two holders, never two of the same task, the paused attempt's
    # lease ends before its redelivered message starts.
    assert all(len(h) <= 2 for _t, h in samples)
    assert all(len([1 for _i, h in hs if h.task_id == x.id]) <= 1 for _t, hs in samples)
    last_paused = max(t for t, hs in samples if any(h.token == attempt.token for _i, h in hs))
    runs = [r for r in records.history(locks, name) if r.outcome != "skipped"]
    mine = [r for r in runs if r.task_id == x.id]
    assert sorted((r.outcome, r.fence == attempt.fence) for r in mine) == [
        ("lost", True),
        ("ok", False),
    ]
    (again,) = [r for r in mine if r.outcome == "ok"]
    assert again.started is not None and again.started >= last_paused - 0.002
    assert [r.fence for r in runs if r.outcome == "ok" and r.fence == attempt.fence] == []
    assert len([r for r in runs if r.outcome == "ok"]) == 2  # the redelivered run and y

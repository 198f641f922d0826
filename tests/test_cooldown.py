"""Once per window: ``cooldown`` skips triggers within a window after a run that ended ok.

Real processes against a Redis the module owns: ``fenced run`` commands racing, a
Celery prefork worker with two children, plain and asyncio claims. The window is timed
by Redis's own expiry; no test asserts on how long anything took.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key, notes
from fenced import Claim, ClaimHeld, ConfigError, Skipped, aio, exclusive, records
from fenced._inspect import force_release, list_claims, show_claim
from fenced._lease import ClaimKeys
from fenced.celery._options import resolve, validate
from fenced.testing import RedisServer

FENCED = [sys.executable, "-m", "fenced.cli"]


@pytest.fixture
def rc(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(decode_responses=True)
    yield client
    client.close()


def _env(url: str) -> dict[str, str]:
    return {**os.environ, "FENCED_REDIS_URL": url}


def _run(url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*FENCED, "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(url),
    )


def _done(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, err = proc.communicate(timeout=WAIT)
    return proc.returncode, out + err


# -- fenced run: two hosts' crontabs firing the same job --------------------------------


def test_two_runners_fired_together_run_once_and_a_later_one_skips_ran_recently(
    redis_server: RedisServer, rc: redis.Redis, tmp_path: Path
) -> None:
    name = f"cron:{key()}"
    ran = tmp_path / "ran"
    # The run goes on until the other runner was skipped ("already running"), however
    # late a loaded machine starts it; a run that starts later finds "ran recently".
    hold = (
        "import sys, time, redis; r = redis.Redis.from_url(sys.argv[1]); "
        "end = time.monotonic() + 30\n"
        "while int(r.get(sys.argv[2]) or 0) < 1 and time.monotonic() < end: time.sleep(0.02)"
    )
    skips = ClaimKeys.of(name).skips
    cmd = ["--", "sh", "-c", f'echo x >> {ran}; "$0" -c "$1" "$2" "$3"']
    cmd += [sys.executable, hold, redis_server.url, skips]
    procs = [_run(redis_server.url, "--cooldown", "5m", name, *cmd) for _ in range(2)]
    ends = [_done(p) for p in procs]
    assert [code for code, _ in ends] == [0, 0], ends
    assert ran.read_text().count("x") == 1
    # The same crontab on a host whose clock is behind fires after the run ended.
    code, out = _done(_run(redis_server.url, "--cooldown", "5m", "--json", name, *cmd))
    assert code == 0, out
    assert "ran recently" in out
    result = json.loads(out.splitlines()[0])
    assert result["ran"] is False and result["outcome"] == "skipped"
    assert result["reason"] == "ran recently"
    assert ran.read_text().count("x") == 1
    # Under --on-busy raise, a window is busy: exit 75, as a busy claim.
    code, out = _done(_run(redis_server.url, "--cooldown", "5m", "--on-busy", "raise", name, *cmd))
    assert code == 75, out
    assert "ran recently" in out
    # A window is never waited out: --on-busy wait skips it too.
    code, out = _done(_run(redis_server.url, "--cooldown", "5m", "--on-busy", "wait", name, *cmd))
    assert code == 0 and "ran recently" in out, out
    runs = records.history(rc, name, limit=20)
    reasons = [run.reason for run in runs if run.outcome == "skipped"]
    assert reasons.count("ran recently") == 3
    assert [run.outcome for run in runs].count("ok") == 1
    assert int(rc.get(ClaimKeys.of(name).skips) or 0) >= 3


def test_a_failed_command_starts_no_window(redis_server: RedisServer, tmp_path: Path) -> None:
    name = f"cron:{key()}"
    ran = tmp_path / "ran"
    code, out = _done(
        _run(
            redis_server.url, "--cooldown", "1h", name, "--", "sh", "-c", f"echo x >> {ran}; exit 3"
        )
    )
    assert code == 3, out
    code, out = _done(
        _run(redis_server.url, "--cooldown", "1h", name, "--", "sh", "-c", f"echo x >> {ran}")
    )
    assert code == 0, out
    assert ran.read_text().count("x") == 2


def test_ls_and_show_give_the_time_left_of_the_window(
    redis_server: RedisServer, rc: redis.Redis
) -> None:
    name = f"cron:{key()}"
    code, out = _done(_run(redis_server.url, "--cooldown", "90", name, "--", "true"))
    assert code == 0, out
    (info,) = [i for i in list_claims(rc) if i.name == name]
    assert info.holder is None
    assert info.cooldown_left is not None and 0 < info.cooldown_left <= 90
    assert info.last_outcome == "ok"
    report = show_claim(rc, name)
    assert report.cooldown_left is not None and 0 < report.cooldown_left <= 90
    ls = subprocess.run(
        [*FENCED, "ls", "--wide"], capture_output=True, text=True, env=_env(redis_server.url)
    )
    assert ls.returncode == 0, ls.stderr
    assert name in ls.stdout and "ran recently: window ends in" in ls.stdout
    assert "in a cooldown window" in ls.stdout
    show = subprocess.run(
        [*FENCED, "show", "--json", name],
        capture_output=True,
        text=True,
        env=_env(redis_server.url),
    )
    assert 0 < json.loads(show.stdout)["cooldown_left"] <= 90


@pytest.mark.parametrize("value", ["2x", "-5", "nan"])
def test_run_refuses_a_cooldown_that_is_not_a_duration(
    redis_server: RedisServer, value: str
) -> None:
    code, out = _done(_run(redis_server.url, f"--cooldown={value}", "x", "--", "true"))
    assert code == 2
    assert "is not a duration" in out and "5m" in out


def test_run_reads_durations_with_units() -> None:
    from fenced.cli import parse_duration

    assert [parse_duration(t) for t in ("90", "1.5", "30s", "5m", "1h", "2d")] == [
        90,
        1.5,
        30,
        300,
        3600,
        172800,
    ]


# -- the library: Skipped, records, counters, the end of the window --------------------


def test_a_decorated_function_skips_ran_recently_until_the_window_ends(
    redis_server: RedisServer, rc: redis.Redis
) -> None:
    k = key()
    calls: list[str] = []

    @exclusive("job:{k}", redis=redis_server.url, ttl=5, cooldown=1)
    def job(k: str) -> str:
        calls.append(k)
        return "done"

    assert job(k) == "done"
    skipped = job(k)
    assert isinstance(skipped, Skipped) and not skipped
    assert skipped.reason == "ran recently" and skipped.holder is None
    assert skipped.expires_in is not None and 0 < skipped.expires_in <= 1
    assert "ran recently" in str(skipped) and "window ends in" in str(skipped)
    assert skipped.skips == 1
    # The window ends by Redis's expiry: a later call runs again.
    wait_for("the window to end", lambda: job(k) == "done", every=0.1)
    assert len(calls) == 2
    outcomes = [(run.outcome, run.reason) for run in records.history(rc, f"job:{k}")]
    assert ("skipped", "ran recently") in outcomes
    assert [o for o, _ in outcomes].count("ok") == 2


def test_a_window_is_timed_by_redis_not_by_the_hosts_clock(server: RedisServer) -> None:
    client = server.client()
    name = f"skew:{key()}"
    with Claim(client, name, ttl=5, cooldown=60):
        pass
    # A host whose clock is an hour ahead still sees the window.
    ahead = Claim(client, name, ttl=5, cooldown=60, clock=lambda: time.monotonic() + 3600)
    assert not ahead.acquire()
    assert ahead.ran_recently is not None and 0 < ahead.ran_recently <= 60
    with pytest.raises(ClaimHeld, match="ran recently"), Claim(client, name, ttl=5, cooldown=60):
        pass
    # A blocking acquire does not wait a window out.
    assert not Claim(client, name, ttl=5, cooldown=60).acquire(blocking=True, timeout=30)


def test_failed_lost_and_released_runs_start_no_window(server: RedisServer) -> None:
    client = server.client()
    name = f"w:{key()}"
    keys = ClaimKeys.of(name)
    with pytest.raises(ValueError), Claim(client, name, ttl=5, cooldown=60):
        raise ValueError("boom")
    assert not client.exists(keys.cooldown)
    # Lost: the lease was gone before the release.
    claim = Claim(client, name, ttl=5, cooldown=60)
    assert claim.acquire()
    client.delete(keys.lock)
    assert not claim.release()
    assert not client.exists(keys.cooldown)
    # Cleared by an operator.
    claim = Claim(client, name, ttl=5, cooldown=60)
    assert claim.acquire()
    assert force_release(client, name, reason="test") is not None
    claim.release()
    assert not client.exists(keys.cooldown)
    # A claim without a cooldown of the same name starts none either.
    with Claim(client, name, ttl=5):
        pass
    assert not client.exists(keys.cooldown)
    with Claim(client, name, ttl=5, cooldown=60):
        pass
    assert 0 < client.pttl(keys.cooldown) <= 60_000


def test_an_asyncio_claim_has_the_same_window(server: RedisServer) -> None:
    import redis.asyncio

    name = f"aio:{key()}"

    async def main() -> tuple[bool, float | None, bool]:
        client = redis.asyncio.Redis.from_url(server.url)
        try:
            async with aio.Claim(client, name, ttl=5, cooldown=60):
                pass
            again = aio.Claim(client, name, ttl=5, cooldown=60)
            got = await again.acquire(blocking=True, timeout=30)
            plain = aio.Claim(client, name, ttl=5)
            return got, again.ran_recently, await plain.acquire()
        finally:
            await client.aclose()

    got, left, plain = asyncio.run(main())
    assert not got and left is not None and 0 < left <= 60
    assert plain  # a claim without a cooldown does not look at the window


def test_a_redelivery_of_the_run_that_started_the_window_is_not_a_skip(
    server: RedisServer,
) -> None:
    client = server.client()
    name = f"again:{key()}"
    opts: dict[str, Any] = {"ttl": 5, "cooldown": 60, "records": True, "redelivery_window": 60}
    with Claim(client, name, task_id="first", **opts):
        pass
    # The same task id comes back inside the window: a redelivery, told by its done
    # marker, not a trigger the window skips (and no skip is counted or recorded).
    again = Claim(client, name, task_id="first", **opts)
    assert again.acquire() and again.ran_recently is None
    assert again.finished_ok()
    again.release(outcome="skipped", reason="duplicate delivery")
    assert records.consecutive_skips(client, name) == 0
    assert "ran recently" not in [run.reason for run in records.history(client, name)]
    # Another task id is still inside the window.
    other = Claim(client, name, task_id="second", **opts)
    assert not other.acquire() and other.ran_recently is not None
    assert other.skips == 1


def test_a_redelivery_holding_a_slot_finds_its_own_lease_not_the_window(
    server: RedisServer,
) -> None:
    client = server.client()
    name = f"slots:{key()}"
    first = Claim(client, name, ttl=5, cooldown=60, limit=2, task_id="a", heartbeat=False)
    assert first.acquire()
    with Claim(client, name, ttl=5, cooldown=60, limit=2, task_id="b"):
        pass  # ends ok while "a" still runs: the window starts
    again = Claim(client, name, ttl=5, cooldown=60, limit=2, task_id="a", records=True)
    assert not again.acquire()
    assert again.ran_recently is None
    assert again.holder is not None and again.holder.task_id == "a"
    assert again.skips == 0 and records.consecutive_skips(client, name) == 0
    first.release()


def test_a_redelivered_celery_task_that_ended_ok_in_the_window_is_ignored(
    server: RedisServer,
) -> None:
    from celery import Celery

    from fenced.celery import ClaimedTask, metrics

    app = Celery("fenced_cooldown_redelivery", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = server.url
    ran: list[str] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="cooled:{x}", claim_cooldown=60)
    def job(self: ClaimedTask, x: str) -> str:
        ran.append(x)
        return "done"

    x = key()
    assert job.apply((x,), task_id=f"t-{x}").get() == "done"
    duplicates = metrics["duplicates"]
    # The same message again, as a redelivery arrives: a duplicate of a completed task.
    again = job.apply((x,), task_id=f"t-{x}", retries=1)
    assert str(again.state) == "IGNORED" and ran == [x]
    assert metrics["duplicates"] == duplicates + 1
    assert records.consecutive_skips(server.client(), f"cooled:{x}") == 0
    # A new call inside the window is skipped.
    skipped = job.apply((x,), task_id=f"u-{x}").get()
    assert skipped["reason"] == "ran recently" and ran == [x]


# -- bad values ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, "5m", True, float("nan"), float("inf"), 0.0001])
def test_a_bad_cooldown_is_refused_naming_the_fix(server: RedisServer, value: Any) -> None:
    with pytest.raises(ConfigError, match=r"cooldown=.*e\.g\. cooldown=300"):
        Claim(server.client(), "x", cooldown=value)
    with pytest.raises(ConfigError, match="cooldown"):
        exclusive("x", redis=server.url, cooldown=value)


def test_zero_and_none_mean_no_window(server: RedisServer) -> None:
    client = server.client()
    name = f"z:{key()}"
    for value in (0, None):
        with Claim(client, name, ttl=5, cooldown=value) as claim:
            assert claim.cooldown is None
        assert not client.exists(ClaimKeys.of(name).cooldown)


def test_a_window_longer_than_the_idle_expiry_is_refused(server: RedisServer) -> None:
    with pytest.raises(ConfigError, match=r"longer than the idle expiry.*idle_ttl"):
        Claim(server.client(), "x", ttl=5, idle_ttl=3600, cooldown=7200)
    Claim(server.client(), "x", ttl=5, idle_ttl=None, cooldown=30 * 86400)
    with pytest.raises(ConfigError, match="longer than the idle expiry"):
        validate({"claim_cooldown": 7200, "claim_idle_ttl": 3600}, "task t")


def test_celery_options_check_the_cooldown() -> None:
    class Conf(dict[str, Any]):
        pass

    assert resolve({}, Conf(), "task t").claim.cooldown_seconds is None
    assert resolve({}, Conf(fenced_claim_cooldown=300), "task t").claim.cooldown_seconds == 300
    given = resolve({"claim_cooldown": 60}, Conf(fenced_claim_cooldown=300), "task t")
    assert given.claim.cooldown_seconds == 60
    with pytest.raises(ConfigError, match="task t: claim_cooldown=-1"):
        validate({"claim_cooldown": -1}, "task t")
    with pytest.raises(ConfigError, match="claim_on_busy='skip' with a cooldown"):
        resolve({"claim_on_busy": "rerun"}, Conf(fenced_claim_cooldown=300), "task t")


# -- Celery: a beat that fires twice --------------------------------------------------


@pytest.fixture(scope="module")
def cel(redis_server: RedisServer) -> Iterator[tuple[Services, Worker, Any]]:
    services = Services.on(redis_server)
    client = services.client()
    try:
        with Worker(services, concurrency=2, name="cooldown") as worker:
            yield services, worker, client
    finally:
        client.close()


def _send(cel: tuple[Services, Worker, Any], *args: Any, **kwargs: Any) -> Any:
    services, _worker, client = cel
    return client.send_task("t.cooled", args=args, kwargs=kwargs, queue=services.queue)


def test_a_beat_firing_twice_runs_the_task_once(cel: tuple[Services, Worker, Any]) -> None:
    services = cel[0]
    k = key()
    # Two deliveries at once, on two pool children: one runs, one skips.
    both = [_send(cel, k, seconds=0.5), _send(cel, k, seconds=0.5)]
    results = [res.get(timeout=WAIT) for res in both]
    assert sorted(r["status"] for r in results) == ["ok", "skipped"], results
    # A third, fired by a beat whose clock is behind, after the run ended: ran recently.
    late = _send(cel, k).get(timeout=WAIT)
    assert late["status"] == "skipped" and late["reason"] == "ran recently"
    assert late["holder"] is None and 0 < late["expires_in"] <= 60
    assert len(notes(services.obs(), f"runs:{k}")) == 1
    runs = records.history(services.locks(), f"cooled:{k}")
    assert [run.outcome for run in runs].count("ok") == 1
    assert "ran recently" in [run.reason for run in runs if run.outcome == "skipped"]


def test_a_failed_task_starts_no_window(cel: tuple[Services, Worker, Any]) -> None:
    services = cel[0]
    k = key()
    failed = _send(cel, k, fail=True)
    with pytest.raises(ValueError):
        failed.get(timeout=WAIT)
    assert _send(cel, k).get(timeout=WAIT)["status"] == "ok"
    assert _send(cel, k).get(timeout=WAIT)["reason"] == "ran recently"
    assert len(notes(services.obs(), f"runs:{k}")) == 2

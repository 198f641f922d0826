"""``@fenced.exclusive`` on plain and coroutine functions, against a real Redis."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from _wait import WAIT
from fenced import Claim, ClaimHeld, ClaimLost, ConfigError, Skipped, events, exclusive
from fenced._lease import ClaimKeys
from fenced.records import history
from fenced.testing import RedisServer


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Any]:
    """Emptied and decoded (these tests compare with str), on the server whose URL they use."""
    client = redis_server.client(decode_responses=True)
    client.flushall()
    yield client
    client.close()


def test_runs_the_function_under_a_claim_named_from_its_arguments(r: Any) -> None:
    seen: list[Any] = []

    @exclusive("report:{tenant}:{day}", redis=r, ttl=10)
    def report(tenant: str, day: str = "today", *, fmt: str = "pdf") -> str:
        seen.append(r.get(ClaimKeys.of(f"report:{tenant}:{day}").lock))
        return f"{tenant}/{day}.{fmt}"

    assert report("acme") == "acme/today.pdf"
    assert report(tenant="beta", day="mon", fmt="csv") == "beta/mon.csv"
    assert all(token and f":{os.getpid()}:" in token for token in seen)
    assert not r.exists(ClaimKeys.of("report:acme:today").lock)  # released
    (run,) = history(r, "report:acme:today")
    assert run.outcome == "ok"
    assert run.extra["function"].endswith("report")
    # Like a Celery task's, the record names the template and the values the name shows.
    assert run.extra["template"] == "report:{tenant}:{day}"
    assert run.extra["args"] == {"tenant": "acme", "day": "today"}
    assert report.__name__ == "report"  # functools.wraps


def test_busy_returns_a_falsy_skipped_result(r: Any) -> None:
    calls: list[str] = []

    @exclusive("sync:{tenant}", redis=r)
    def sync(tenant: str) -> str:
        calls.append(tenant)
        return "done"

    holder = Claim(r, "sync:acme", ttl=20, heartbeat=False, task_id="job-7")
    assert holder.acquire()
    result = sync("acme")
    assert isinstance(result, Skipped) and not result
    assert result.claim == "sync:acme"
    assert result.holder is not None and result.holder.task_id == "job-7"
    assert result.holder.pid == os.getpid()
    assert result.expires_in is not None and 0 < result.expires_in <= 20
    assert result.as_dict()["status"] == "skipped"
    assert "held by" in str(result)
    assert calls == []
    assert sync("beta") == "done"  # another tenant is another claim
    assert history(r, "sync:acme")[0].outcome == "skipped"
    holder.release()


def test_wait_runs_once_the_holder_releases(r: Any) -> None:
    holder = Claim(r, "nightly", ttl=20)
    assert holder.acquire()

    @exclusive("nightly", redis=r, on_busy="wait", wait_timeout=30)
    def nightly() -> int:
        return 42

    timer = threading.Timer(0.3, holder.release)
    timer.start()
    try:
        assert nightly() == 42
    finally:
        timer.join()
    assert not holder.held


def test_wait_timeout_and_raise_policy_raise_claim_held(r: Any) -> None:
    holder = Claim(r, "busy", ttl=20, heartbeat=False)
    assert holder.acquire()

    @exclusive("busy", redis=r, on_busy="wait", wait_timeout=0.2)
    def waits() -> None:
        raise AssertionError("must not run")

    @exclusive("busy", redis=r, on_busy="raise")
    def raises() -> None:
        raise AssertionError("must not run")

    with pytest.raises(ClaimHeld, match=r"after waiting 0\.2s") as info:
        waits()
    assert info.value.name == "busy" and info.value.fence == holder.fence
    with pytest.raises(ClaimHeld) as info:
        raises()
    assert info.value.expires_in is not None and info.value.expires_in > 0
    holder.release()


def test_template_fields_are_checked_when_decorating(r: Any) -> None:
    with pytest.raises(ConfigError, match=r"names tenant.*function .*rebuild.*layer"):

        @exclusive("rebuild:{tenant}", redis=r)
        def rebuild(layer: str) -> None: ...

    with pytest.raises(ConfigError, match="only plain argument names"):

        @exclusive("rebuild:{layer.name}", redis=r)
        def rebuild2(layer: Any) -> None: ...


def test_bad_options_fail_at_decoration(r: Any) -> None:
    with pytest.raises(ConfigError, match="on_busy"):
        exclusive("x", redis=r, on_busy="queue")
    with pytest.raises(ConfigError, match="wait_timeout"):
        exclusive("x", redis=r, wait_timeout=5)
    with pytest.raises(ConfigError, match="ttl"):
        exclusive("x", redis=r, ttl=0)
    with pytest.raises(ConfigError, match="redis"):
        exclusive("x", redis=None)


def test_kwargs_functions_and_callable_names(r: Any, redis_server: RedisServer) -> None:
    @exclusive("job:{tenant}", redis=redis_server.url)  # a URL works as well as a client
    def job(**kwargs: Any) -> bool:
        return r.get(ClaimKeys.of(f"job:{kwargs['tenant']}").lock) is not None

    assert job(tenant="acme") is True
    with pytest.raises(ConfigError, match="needs tenant"):
        job(other=1)

    @exclusive(lambda path: f"file:{path.rsplit('/', 1)[-1]}", redis=r)
    def touch(path: str) -> bool:
        return bool(r.exists(ClaimKeys.of("file:a.txt").lock))

    assert touch("/tmp/a.txt") is True


def test_failure_is_recorded_and_the_claim_released(r: Any) -> None:
    @exclusive("flaky", redis=r)
    def flaky() -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        flaky()
    assert not r.exists(ClaimKeys.of("flaky").lock)
    run = history(r, "flaky")[0]
    assert run.outcome == "failed" and "disk full" in (run.reason or "")


def test_a_run_that_outlives_its_claim_raises_claim_lost(r: Any) -> None:
    declared = threading.Event()

    def on_event(event: events.ClaimEvent) -> None:
        if event.kind == "lost" and event.name == "slow":
            declared.set()

    @exclusive("slow", redis=r, ttl=0.6)
    def slow() -> str:
        r.set(ClaimKeys.of("slow").lock, "someone-else", px=10_000)
        # Past the next heartbeat (every 0.2 s), which finds the other token.
        assert declared.wait(WAIT)
        return "done"

    unsubscribe = events.subscribe(on_event)
    try:
        with pytest.raises(ClaimLost, match="not protected"):
            slow()
    finally:
        unsubscribe()
    assert r.get(ClaimKeys.of("slow").lock) == "someone-else"
    assert history(r, "slow")[0].outcome == "lost"


def test_coroutine_functions(r: Any) -> None:
    @exclusive("async:{n}", redis=r)
    async def work(n: int) -> int:
        await asyncio.sleep(0.01)
        return n * 2

    @exclusive("async:{n}", redis=r, on_busy="wait", wait_timeout=30)
    async def waiting(n: int) -> int:
        return n

    async def scenario() -> tuple[Any, Any, Any]:
        holder = Claim(r, "async:1", ttl=20)
        assert holder.acquire()
        skipped = await work(1)
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, holder.release)  # runs only if the loop is not blocked
        waited = await waiting(1)
        return skipped, await work(2), waited

    skipped, doubled, waited = asyncio.run(scenario())
    assert isinstance(skipped, Skipped) and not skipped
    assert doubled == 4
    assert waited == 1

"""One contract, every front end: what work under a claim does is the core's, not theirs.

Each front end (``with Claim``, ``async with aio.Claim``, ``@exclusive`` on a plain and
on a coroutine function, ``ClaimedTask`` and ``fenced run``) is driven through the
same cases against a real Redis:

- busy, under each busy policy it accepts: skip, wait, raise, retry, rerun, replace;
- a policy it refuses is refused when the work is defined, naming the ones it has;
  ``replace`` with a limit above 1 too;
- the work raises: ``failed``; it returns: ``ok``;
- its lease vanished while it ran and it returned: ``lost``, and ClaimLost;
- its claim was lost mid-run: ClaimLost (or the work interrupted), ``lost``.

The outcome is read back from the run records, as an operator would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio

import fenced
import fenced.aio
from _wait import WAIT
from fenced import Claim, ClaimHeld, ClaimLost, ConfigError, exclusive, is_skipped, records
from fenced._lease import ClaimKeys
from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
#: A short lease: renewed every 0.2 s, so a loss is noticed within that.
TTL = 0.6
#: Longer than a renewal period and its retries: the loss has been seen by then.
PAST_A_RENEWAL = 1.2
#: The names whose loss was declared, as their ``lost`` events say (while subscribed).
DECLARED_LOST: set[str] = set()


def _note_loss(event: fenced.events.ClaimEvent) -> None:
    if event.kind == "lost":
        DECLARED_LOST.add(event.name)


def _until_declared_lost(name: str) -> None:
    """Work on (a thread's kind of work: sleeping a little at a time) until the
    heartbeat has found the lease taken and declared the claim lost."""
    deadline = time.monotonic() + WAIT
    while name not in DECLARED_LOST:
        assert time.monotonic() < deadline, f"the loss of {name} was never declared"
        time.sleep(0.01)


async def _until_declared_lost_async(name: str) -> None:
    """The same on an event loop, never blocking it."""
    deadline = time.monotonic() + WAIT
    while name not in DECLARED_LOST:
        assert time.monotonic() < deadline, f"the loss of {name} was never declared"
        await asyncio.sleep(0.01)


# What the work does, written once per front end below.
OK, FAIL, VANISH, LOSE = "ok", "fail", "vanish", "lose"


class Boom(Exception):
    pass


@dataclass
class Ended:
    """How one call of the work ended, as its caller saw it."""

    result: Any = None
    error: BaseException | None = None
    exit: int | None = None  # fenced run's exit status


@dataclass
class Frontend:
    name: str
    #: The busy policies the front end has ("raise" only: the statement itself raises).
    accepts: tuple[str, ...]
    #: Define the work for claim ``name`` doing ``does``; a call that runs it once.
    define: Callable[[Any, RedisServer, str, str, str], Callable[[], Ended]]
    #: The busy policies it refuses when the work is defined.
    refuses: tuple[str, ...] = field(default=())


def _body(r: Any, name: str, does: str) -> Any:
    """The work, in a thread (a task, a function, a with block)."""
    if does == FAIL:
        raise Boom("disk full")
    if does == VANISH:
        r.delete(ClaimKeys.of(name).lock)
    elif does == LOSE:
        r.set(ClaimKeys.of(name).lock, "someone-else", px=10_000)
        _until_declared_lost(name)
    return "done"


async def _abody(r: Any, name: str, does: str) -> Any:
    """The work, on an event loop: it never blocks the loop."""
    if does == FAIL:
        raise Boom("disk full")
    if does == VANISH:
        r.delete(ClaimKeys.of(name).lock)
    elif does == LOSE:
        r.set(ClaimKeys.of(name).lock, "someone-else", px=10_000)
        await _until_declared_lost_async(name)
    return "done"


def _ended(call: Callable[[], Any]) -> Ended:
    try:
        return Ended(result=call())
    except Exception as exc:
        return Ended(error=exc)


# -- the front ends --------------------------------------------------------------------


def _claim(r: Any, server: RedisServer, name: str, does: str, on_busy: str) -> Any:
    def call() -> Any:
        with Claim(r, name, ttl=TTL, records=True):
            return _body(r, name, does)

    return lambda: _ended(call)


def _aio_claim(r: Any, server: RedisServer, name: str, does: str, on_busy: str) -> Any:
    async def call() -> Any:
        client = redis.asyncio.Redis.from_url(server.url)
        try:
            async with fenced.aio.Claim(client, name, ttl=TTL, records=True):
                return await _abody(r, name, does)
        finally:
            await client.aclose()

    return lambda: _ended(lambda: asyncio.run(call()))


def _exclusive(r: Any, server: RedisServer, name: str, does: str, on_busy: str) -> Any:
    @exclusive(name, redis=r, ttl=TTL, on_busy=on_busy)
    def work() -> Any:
        return _body(r, name, does)

    return lambda: _ended(work)


def _exclusive_async(r: Any, server: RedisServer, name: str, does: str, on_busy: str) -> Any:
    @exclusive(name, redis=r, ttl=TTL, on_busy=on_busy)
    async def work() -> Any:
        return await _abody(r, name, does)

    return lambda: _ended(lambda: asyncio.run(work()))


def _task(r: Any, server: RedisServer, name: str, does: str, on_busy: str) -> Any:
    from celery import Celery

    from fenced.celery import ClaimedTask

    app = Celery(f"contract-{uuid.uuid4().hex[:6]}", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = server.url

    @app.task(
        shared=False,
        base=ClaimedTask,
        bind=True,
        claim=name,
        claim_ttl=TTL,
        claim_on_busy=on_busy,
        max_retries=1,
    )
    def work(self: Any) -> Any:
        return _body(r, name, does)

    app.finalize()  # builds every task, as a worker's start does

    def call() -> Ended:
        # apply(): the task's own __call__ in this process, as a worker runs it.
        result = work.apply(task_id=uuid.uuid4().hex)
        if result.failed():
            return Ended(error=result.result)
        return Ended(result=result.result)

    return call


_RUN_BODY = """
import sys, time, redis
r = redis.Redis.from_url(sys.argv[1]); key = sys.argv[2]; does = sys.argv[3]
if does == "fail": sys.exit(3)
if does == "vanish": r.delete(key)
if does == "lose":
    r.set(key, "someone-else", px=10_000)
    time.sleep(float(sys.argv[4]) * 5)  # stopped long before this ends
"""


def _run(r: Any, server: RedisServer, name: str, does: str, on_busy: str) -> Any:
    argv = [
        *(sys.executable, "-m", "fenced", "run", "--redis", server.url),
        *("--ttl", str(TTL), "--on-busy", on_busy, "--grace", "1", name, "--"),
        *(sys.executable, "-c", _RUN_BODY, server.url, ClaimKeys.of(name).lock, does),
        str(PAST_A_RENEWAL),
    ]
    if on_busy == "wait":
        argv[argv.index("--grace") : argv.index("--grace")] = ["--wait-timeout", "30"]

    def call() -> Ended:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
        return Ended(result=done.stdout + done.stderr, exit=done.returncode)

    return call


FRONTENDS = [
    Frontend("with Claim", ("raise",), _claim),
    Frontend("async with aio.Claim", ("raise",), _aio_claim),
    Frontend("@exclusive", ("skip", "wait", "raise", "replace"), _exclusive, ("retry", "rerun")),
    Frontend(
        "@exclusive async",
        ("skip", "wait", "raise", "replace"),
        _exclusive_async,
        ("retry", "rerun"),
    ),
    Frontend("ClaimedTask", ("skip", "rerun", "retry", "raise", "replace"), _task, ("wait",)),
    Frontend("fenced run", ("skip", "wait", "raise", "replace"), _run, ("retry", "rerun")),
]


def _cases(pick: Callable[[Frontend], tuple[str, ...]]) -> list[Any]:
    return [pytest.param(fe, p, id=f"{fe.name}-{p}") for fe in FRONTENDS for p in pick(fe)]


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Any]:
    client = redis_server.client()
    yield client
    client.close()


def _name(fe: Frontend) -> str:
    return f"contract:{fe.name.replace(' ', '-')}:{uuid.uuid4().hex[:8]}"


def _outcomes(r: Any, name: str) -> list[str]:
    return [run.outcome for run in records.history(r, name)]


# -- busy ------------------------------------------------------------------------------


@pytest.mark.parametrize(("fe", "policy"), _cases(lambda fe: fe.accepts))
def test_busy_under_each_policy_it_accepts(
    fe: Frontend, policy: str, r: Any, redis_server: RedisServer
) -> None:
    name = _name(fe)
    holder = Claim(r, name, ttl=30, heartbeat=False, records=True)
    assert holder.acquire()
    held = r.get(ClaimKeys.of(name).lock)
    work = fe.define(r, redis_server, name, OK, policy)
    retries: list[Any] = []
    if policy == "wait":
        threading.Timer(0.3, holder.release).start()  # the holder lets go while it waits
    elif policy == "retry":
        from celery.signals import task_retry

        def let_go(request: Any = None, reason: Any = None, **_: Any) -> None:
            retries.append(reason)
            holder.release()  # the retry, applied in this process at once, finds it free

        task_retry.connect(let_go, weak=False)
    try:
        ended = work()
    finally:
        if policy == "retry":
            task_retry.disconnect(let_go)
    if policy == "retry":
        assert len(retries) == 1 and "busy" in str(retries[0]), retries
    if policy in ("wait", "retry"):
        assert ended.error is None and ended.exit in (None, 0), ended
        assert _outcomes(r, name)[0] == "ok"  # the work ran, once the holder let go
        return
    if policy == "replace":
        # The work ran at once; the holder's run ended lost, naming it.
        assert ended.error is None and ended.exit in (None, 0), ended
        newest, replaced = records.history(r, name)[:2]
        assert newest.outcome == "ok", newest
        assert replaced.outcome == "lost" and (replaced.reason or "").startswith("replaced by ")
        assert holder.release() is False  # its lease was taken: nothing of it to give back
        assert _outcomes(r, name)[:2] == ["ok", "lost"]
        return
    # The work did not run and the holder's lease is untouched.
    assert r.get(ClaimKeys.of(name).lock) == held
    if policy == "raise":
        if fe.name == "fenced run":
            assert ended.exit == 75, ended  # EX_TEMPFAIL
        else:
            assert isinstance(ended.error, ClaimHeld), ended
            assert name in str(ended.error)
    else:  # skip, rerun: a skipped result, not an error
        assert ended.error is None and ended.exit in (None, 0), ended
        if ended.exit is None:
            assert is_skipped(ended.result)  # a Skipped (falsy), or a task's dict
    holder.release()
    if policy == "rerun":
        assert holder.rerun_triggers, "the holder was asked for one more run"
    assert records.consecutive_skips(r, name) == 0  # the holder ended ok
    assert "skipped" in _outcomes(r, name)


@pytest.mark.parametrize(("fe", "policy"), _cases(lambda fe: fe.refuses))
def test_a_policy_it_refuses_is_refused_when_the_work_is_defined(
    fe: Frontend, policy: str, r: Any, redis_server: RedisServer
) -> None:
    name = _name(fe)
    if fe.name == "fenced run":
        ended = fe.define(r, redis_server, name, OK, policy)()
        assert ended.exit == 2 and "--on-busy" in str(ended.result), ended
        assert not r.exists(ClaimKeys.of(name).lock)
        return
    with pytest.raises(ConfigError, match=rf"on_busy={policy!r} is not one of: .*'skip'"):
        fe.define(r, redis_server, name, OK, policy)


def _define_limited(fe: Frontend, r: Any, redis_server: RedisServer, name: str) -> Any:
    """Define the work with on_busy replace and a limit of 2."""
    if fe.name.startswith("@exclusive"):
        return exclusive(name, redis=r, ttl=TTL, on_busy="replace", limit=2)(lambda: None)
    if fe.name == "ClaimedTask":
        from celery import Celery

        from fenced.celery import ClaimedTask

        app = Celery("contract-limit", set_as_current=False, broker="memory://")
        app.conf.fenced_redis_url = redis_server.url

        @app.task(
            shared=False, base=ClaimedTask, claim=name, claim_on_busy="replace", claim_limit=2
        )
        def job() -> None:
            pass

        app.finalize()
        return job
    argv = [sys.executable, "-m", "fenced", "run", "--redis", redis_server.url]
    argv += ["--on-busy", "replace", "--limit", "2", name, "--", "true"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize(
    "fe", [pytest.param(fe, id=fe.name) for fe in FRONTENDS if "replace" in fe.accepts]
)
def test_replace_with_a_limit_above_one_is_refused_when_the_work_is_defined(
    fe: Frontend, r: Any, redis_server: RedisServer
) -> None:
    name = _name(fe)
    if fe.name == "fenced run":
        done = _define_limited(fe, r, redis_server, name)
        assert done.returncode == 2 and "ambiguous" in done.stderr, done
        assert not r.exists(ClaimKeys.of(name).lock)
        return
    with pytest.raises(ConfigError, match=r"on_busy='replace' needs a limit of 1.*ambiguous"):
        _define_limited(fe, r, redis_server, name)


# -- how the work ended ----------------------------------------------------------------

ALL = [pytest.param(fe, id=fe.name) for fe in FRONTENDS]


def _policy(fe: Frontend) -> str:
    return fe.accepts[0]


@pytest.mark.parametrize("fe", ALL)
def test_work_that_returns_ends_ok(fe: Frontend, r: Any, redis_server: RedisServer) -> None:
    name = _name(fe)
    ended = fe.define(r, redis_server, name, OK, _policy(fe))()
    assert ended.error is None and ended.exit in (None, 0), ended
    if ended.exit is None:
        assert ended.result == "done"
    assert _outcomes(r, name) == ["ok"]
    assert not r.exists(ClaimKeys.of(name).lock)  # released


@pytest.mark.parametrize("fe", ALL)
def test_work_that_raises_ends_failed(fe: Frontend, r: Any, redis_server: RedisServer) -> None:
    name = _name(fe)
    ended = fe.define(r, redis_server, name, FAIL, _policy(fe))()
    if fe.name == "fenced run":
        assert ended.exit == 3, ended  # the command's own status
    else:
        assert isinstance(ended.error, Boom), ended
    (run,) = records.history(r, name)
    assert run.outcome == "failed"
    assert not r.exists(ClaimKeys.of(name).lock)


@pytest.mark.parametrize("fe", ALL)
def test_work_that_returns_after_its_lease_vanished_ends_lost(
    fe: Frontend, r: Any, redis_server: RedisServer
) -> None:
    name = _name(fe)
    ended = fe.define(r, redis_server, name, VANISH, _policy(fe))()
    if fe.name == "fenced run":
        assert ended.exit == 76, ended
    else:
        assert isinstance(ended.error, ClaimLost), ended
        assert "not protected" in str(ended.error)
    assert _outcomes(r, name)[0] == "lost"


@pytest.mark.parametrize("fe", ALL)
def test_work_whose_claim_is_lost_mid_run_ends_lost(
    fe: Frontend, r: Any, redis_server: RedisServer
) -> None:
    name = _name(fe)
    unsubscribe = fenced.events.subscribe(_note_loss)
    try:
        ended = fe.define(r, redis_server, name, LOSE, _policy(fe))()
    finally:
        unsubscribe()
    if fe.name == "fenced run":
        assert ended.exit == 76, ended  # the command was stopped, not left running
    else:
        assert isinstance(ended.error, ClaimLost), ended
    assert _outcomes(r, name)[0] == "lost"
    assert r.get(ClaimKeys.of(name).lock) == b"someone-else"  # the new holder's, untouched


# -- options ---------------------------------------------------------------------------


def test_an_unknown_option_is_refused_by_every_front_end_naming_the_closest(
    r: Any, redis_server: RedisServer
) -> None:
    from celery import Celery

    from fenced.celery import ClaimedTask

    fix = r"unknown option ttll; did you mean ttl\?"
    with pytest.raises(ConfigError, match=fix):
        Claim(r, "x", ttll=5)
    with pytest.raises(ConfigError, match=fix):
        fenced.aio.Claim(redis.asyncio.Redis.from_url(redis_server.url), "x", ttll=5)
    with pytest.raises(ConfigError, match=fix):
        exclusive("x", redis=r, ttll=5)
    app = Celery("contract-options", set_as_current=False, broker="memory://")
    with pytest.raises(ConfigError, match=r"unknown option claim_ttll; did you mean claim_ttl\?"):

        @app.task(shared=False, base=ClaimedTask, claim="x", claim_ttll=5)
        def job() -> None:
            pass

        app.finalize()
    done = subprocess.run(
        [sys.executable, "-m", "fenced", "run", "--ttll", "5", "x", "--", "true"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    assert done.returncode == 2 and "--ttl" in done.stderr, done.stderr


def test_one_options_struct_is_checked_once_and_shared(r: Any) -> None:
    opts = fenced.ClaimOptions(ttl=6, limit=2, records=True)
    assert opts.refresh == 2.0 and opts.ttl_ms == 6000  # worked out once
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.ttl = 1  # type: ignore[misc]
    a, b = Claim(r, "a", options=opts), Claim(r, "b", options=opts, cooldown=60)
    assert a.options is opts and a.ttl == 6 and a.limit == 2 and a.records
    assert b.options.cooldown == 60 and b.options.limit == 2  # keywords change a copy
    # Keyword options are made once per set of values, but a value of another type is
    # checked on its own: True == 1, yet limit=True is not a number of holders.
    assert Claim(r, "c", limit=1).options is Claim(r, "d", limit=1).options
    with pytest.raises(ConfigError, match=r"limit=True is not a number of holders"):
        Claim(r, "e", limit=True)
    with pytest.raises(ConfigError, match=r"claim_refresh_every=5 .* at most claim_ttl/2"):
        fenced.ClaimOptions(ttl=6, refresh_every=5, prefix="claim_")
    with pytest.raises(ConfigError, match=r"--replica-timeout=3 must be below half the ttl"):
        fenced.ClaimOptions(ttl=6, replicas=1, replica_timeout=3, prefix="--")

"""fenced.aio.Claim on real redis-servers: the thread Claim's semantics, on asyncio.

Tests drive their coroutines with ``asyncio.run`` (no event-loop plugin needed).
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aredis
from redis.asyncio.connection import UnixDomainSocketConnection

import fenced
from _clock import ManualClock
from fenced import ClaimHeld, ClaimLost, ConfigError, Skipped, exclusive
from fenced._lease import ClaimKeys
from fenced.aio import Claim, Lock, renewer
from fenced.aio._send import _packable
from fenced.records import history
from fenced.testing import RedisServer

T = TypeVar("T")


async def settled() -> None:
    """Wait until every task but this one and the renewer has ended (work in flight)."""
    me = asyncio.current_task()
    for _ in range(2000):
        others = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if all(t.get_name() == "fenced-renewer" for t in others):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("work in flight never ended")


SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(
    server: RedisServer,
    scenario: Callable[[Any], Awaitable[T]],
    stepping: bool = False,
    **kw: Any,
) -> T:
    """Run ``scenario(client)`` on a fresh loop with a redis.asyncio client on ``server``."""

    async def main() -> T:
        client = Stepping.on(server, **kw) if stepping else aredis.from_url(server.url, **kw)
        try:
            return await scenario(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_acquire_release_with_the_sync_keys_fences_and_records(server: RedisServer) -> None:
    sync = server.client(decode_responses=True)

    async def scenario(r: Any) -> list[int]:
        fences = []
        for _ in range(3):
            claim = Claim(r, "rebuild:acme", ttl=5, records=True)
            assert await claim.acquire()
            assert claim.held and not claim.lost and 4 < claim.expires_in <= 5
            assert claim.key == ClaimKeys.of("rebuild:acme").lock
            assert sync.get(claim.key) == claim.token
            # The thread front end sees the same lease: busy.
            assert not fenced.Claim(sync, "rebuild:acme").acquire()
            assert claim.fence is not None
            fences.append(claim.fence)
            assert await claim.release()
            assert not claim.held and sync.get(claim.key) is None
            assert not await claim.release()  # a second release does nothing
        return fences

    fences = run(server, scenario)
    assert fences == sorted(fences) and len(set(fences)) == 3
    # (the thread claims' tries were recorded as skips)
    runs = [r for r in history(sync, "rebuild:acme") if r.outcome != "skipped"]
    assert [(r.outcome, r.fence) for r in runs] == [("ok", f) for f in reversed(fences)]


def test_async_with_raises_claim_held_when_busy_and_acquire_says_false(
    server: RedisServer,
) -> None:
    async def scenario(r: Any) -> None:
        async with Claim(r, "job", ttl=5) as first:
            other = Claim(r, "job", ttl=5)
            assert not await other.acquire()
            assert other.holder is not None and other.holder.fence == first.fence
            ran = False
            with pytest.raises(ClaimHeld, match="busy"):
                async with other:
                    ran = True
            assert not ran
        assert await other.acquire()  # free again after the block
        await other.release()

    run(server, scenario)


def test_bad_input_is_refused_as_the_sync_claim_does(server: RedisServer) -> None:
    client = aredis.from_url(server.url)
    with pytest.raises(ConfigError, match="ttl"):
        Claim(client, "x", ttl=0)
    with pytest.raises(ConfigError, match="refresh_every"):
        Claim(client, "x", ttl=1, refresh_every=1)
    with pytest.raises(ConfigError, match="namespace"):
        Claim(client, "x", namespace="a{b")
    with pytest.raises(ConfigError):
        Claim(client, "", ttl=1)
    with pytest.raises(ConfigError, match=r"redis\.asyncio"):
        Claim(None, "x")
    with pytest.raises(ConfigError, match=r"redis\.asyncio"):
        Claim(server.client(), "x")  # a synchronous client: fenced.Claim is for it
    with pytest.raises(ConfigError, match="replicas"):
        Claim(client, "x", replicas=1, replica_timeout=0.5)


def test_many_tasks_on_one_loop_never_overlap_and_fences_increase(server: RedisServer) -> None:
    async def scenario(r: Any) -> tuple[int, list[int]]:
        inside = 0
        most = 0
        fences: list[int] = []

        async def worker() -> None:
            nonlocal inside, most
            for _ in range(10):
                claim = Claim(r, "shared", ttl=5)
                try:
                    async with claim:
                        inside += 1
                        most = max(most, inside)
                        assert claim.fence is not None
                        fences.append(claim.fence)
                        await asyncio.sleep(0.001)
                        inside -= 1
                except ClaimHeld:
                    await asyncio.sleep(0.001)

        await asyncio.gather(*(worker() for _ in range(40)))
        return most, fences

    most, fences = run(server, scenario)
    assert most == 1
    assert len(fences) > 5
    assert fences == sorted(fences) and len(set(fences)) == len(fences)


CHILD = """
import asyncio, sys, time
import redis.asyncio as aredis
from redis.asyncio.connection import UnixDomainSocketConnection
from fenced.aio import Claim

async def main(url, rounds):
    r = aredis.from_url(url)
    taken = 0
    while taken < rounds:
        claim = Claim(r, "across", ttl=5)
        if not await claim.acquire(blocking=True, timeout=30):
            raise SystemExit("never acquired")
        start = time.time()
        await r.rpush("log", f"in {claim.fence}")
        await asyncio.sleep(0.005)
        await r.rpush("log", f"out {claim.fence}")
        assert await claim.release()
        taken += 1
    await r.aclose()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


def test_processes_racing_exclude_each_other(server: RedisServer) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    procs = [
        subprocess.Popen([sys.executable, "-c", CHILD, server.url, "15"], env=env) for _ in range(3)
    ]
    for p in procs:
        assert p.wait(timeout=120) == 0
    log = [e.decode() for e in server.client().lrange("log", 0, -1)]
    assert len(log) == 2 * 3 * 15
    # Strictly alternating in/out of the same fence, fences increasing: never two inside.
    fences = []
    for enter, leave in zip(log[::2], log[1::2]):
        assert enter.startswith("in ") and leave == "out " + enter[3:]
        fences.append(int(enter[3:]))
    assert fences == sorted(fences) and len(set(fences)) == len(fences)


def test_loss_by_a_paused_server_cancels_the_block(own_server: RedisServer) -> None:
    reached = []

    async def scenario(r: Any) -> float:
        claim = Claim(r, "paused", ttl=1.0)
        started = time.monotonic()
        with pytest.raises(ClaimLost, match="interrupted") as info:
            async with claim:
                own_server.pause()
                try:
                    await asyncio.sleep(30)
                    reached.append("after the sleep")
                finally:
                    reached.append("cancelled")
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
        assert claim.vanished  # the release could not reach the paused server either
        return time.monotonic() - started

    try:
        took = run(own_server, scenario, socket_timeout=1.0)
    finally:
        own_server.resume()
    assert reached == ["cancelled"]
    # Declared at the local deadline (ttl minus drift), not after the 30 s sleep.
    assert took < 10


def test_loss_by_a_stolen_key_cancels_the_block(server: RedisServer) -> None:
    sync = server.client()
    seen: list[str] = []

    async def scenario(r: Any) -> None:
        claim = Claim(r, "stolen", ttl=0.6, records=True, on_lost=lambda c: seen.append(c.name))
        with pytest.raises(ClaimLost):
            async with claim:
                sync.set(claim.key, "someone-else", px=10_000)
                await asyncio.sleep(10)
        assert seen == ["stolen"]
        assert "another token" in (claim.lost_reason or "")
        assert sync.get(claim.key) == b"someone-else"  # the other holder's lease is kept

    run(server, scenario)
    assert history(sync, "stolen")[0].outcome == "lost"


def test_check_inside_the_block_raises_claim_lost_without_a_cancel(server: RedisServer) -> None:
    sync = server.client()

    async def scenario(r: Any) -> None:
        claim = Claim(r, "checked", ttl=5, heartbeat=False)
        with pytest.raises(ClaimLost, match="another token"):
            async with claim:
                sync.set(claim.key, "someone-else")
                assert not await claim.refresh()
                claim.check()
        await asyncio.sleep(0.01)  # no stray cancellation is pending for this task

    run(server, scenario)


def test_a_cancellation_from_elsewhere_propagates_and_releases(server: RedisServer) -> None:
    sync = server.client()

    async def scenario(r: Any) -> None:
        claim = Claim(r, "cancelled", ttl=5, records=True)
        entered = asyncio.Event()

        async def work() -> None:
            async with claim:
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(work())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sync.exists(claim.key) == 0

    run(server, scenario)
    assert history(sync, "cancelled")[0].outcome == "failed"


class Points:
    """Counts the points of a client's commands; cancels ``target`` at ``cancel_at``."""

    target: asyncio.Task[Any] | None = None
    cancel_at = -1
    points = 0

    def _point(self) -> bool:
        hit = self.points == self.cancel_at and self.target is not None
        if hit:
            self.cancel_at = -1
        self.points += 1
        return hit


class Stepping(Points, aredis.Redis):  # type: ignore[misc]  # redis-py's own bases differ
    """A real client that cancels a chosen task at a chosen point of its commands.

    Every command has three points: before it is sent, once it was sent (as its answer
    is read), and after the answer came. Point ``cancel_at`` (counted over all commands)
    cancels ``target`` there, once.
    """

    #: Called by the connection as it starts reading an answer (the command was sent).
    armed: Callable[[], object] | None = None

    @classmethod
    def on(cls, server: RedisServer, **kw: Any) -> Stepping:
        """A client on ``server``'s unix socket whose connections call ``armed``."""
        client = cls(unix_socket_path=server.socket_path, **kw)
        client.connection_pool.connection_class = _ArmedConnection
        return client

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        if self._point() and self.target is not None:
            self.target.cancel()
        await asyncio.sleep(0)
        if self._point() and self.target is not None:
            Stepping.armed = self.target.cancel
        result = await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]
        if self._point() and self.target is not None:
            self.target.cancel()
        await asyncio.sleep(0)
        return result


class _ArmedConnection(UnixDomainSocketConnection):
    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        armed, Stepping.armed = Stepping.armed, None
        if armed is not None:
            armed()  # the command is on its way: cancel as its answer is awaited
        return await super().read_response(*args, **kwargs)


class Cutter(Points):
    """Cancels a chosen task at a chosen point of the scripts a plain client sends.

    The client stays a ``redis.asyncio.Redis`` over its own pool, so fenced packs its
    script calls and sends them on the pool's connections itself. Every script call has
    two points: before it is sent (as it takes a connection), and once it was sent (as
    its answer is read). Point ``cancel_at`` (counted over all calls) cancels
    ``target`` there, once.
    """

    def client(self, server: RedisServer) -> aredis.Redis:
        cutter = self

        class Cutting(UnixDomainSocketConnection):
            async def connect(self) -> None:  # each call takes a connection of the pool
                if cutter._point() and cutter.target is not None:
                    cutter.target.cancel()
                    await asyncio.sleep(0)  # not sent
                await super().connect()  # type: ignore[no-untyped-call]

            async def read_response(self, *args: Any, **kwargs: Any) -> Any:
                # A script call's answer, awaited by its caller (a task reading it for a
                # cancelled caller keeps redis-py's disconnect on error).
                awaited = kwargs.get("disconnect_on_error") is False
                if awaited and cutter._point() and cutter.target is not None:
                    cutter.target.cancel()  # sent: cancelled as its answer is awaited
                    await asyncio.sleep(0)
                return await super().read_response(*args, **kwargs)

        client = aredis.Redis(unix_socket_path=server.socket_path)
        client.connection_pool.connection_class = Cutting
        return client

    async def everywhere(
        self,
        server: RedisServer,
        cycle: Callable[[Any, list[bool]], Coroutine[Any, Any, None]],
        settle: Callable[[], Awaitable[None]],
    ) -> list[tuple[str, int]]:
        """``cancel_everywhere`` on a client of this cutter's, after a first ``cycle``
        (uncut) cached the scripts and was settled."""
        r = self.client(server)
        assert _packable(r)
        try:
            await cycle(r, [])
            await settle()
            ends = await cancel_everywhere(self, lambda entered: cycle(r, entered), settle)
            # A reply read after its caller was cancelled gives the connection back.
            assert not r.connection_pool._in_use_connections
            return ends
        finally:
            await r.aclose()


async def cancel_everywhere(
    r: Points,
    cycle: Callable[[list[bool]], Coroutine[Any, Any, None]],
    settle: Callable[[], Awaitable[None]],
) -> list[tuple[str, int]]:
    """Run ``cycle`` once per point of its commands, cancelled at that point; how each ended.

    Ends are ("done" | "cancelled in the block or after" | "cancelled before", point).
    ``settle`` is called after each run, once the work left in flight has ended.
    """
    ends = []
    point = 0
    while True:
        entered: list[bool] = []
        r.points, r.cancel_at = 0, point
        task = asyncio.create_task(cycle(entered))
        r.target = task
        try:
            await task
            end = "done"
        except asyncio.CancelledError:
            end = "cancelled in release" if entered else "cancelled in acquire"
        r.target, r.cancel_at = None, -1
        await settled()  # whatever was in flight runs to its end
        await settle()
        ends.append((end, point))
        if end == "done":
            return ends
        point += 1


def test_cancellation_at_every_await_of_acquire_and_release_leaves_no_lease(
    server: RedisServer,
) -> None:
    sync = server.client()
    keys = ClaimKeys.of("cancel")
    grants: list[int] = []

    async def scenario(r: Any) -> list[tuple[str, int]]:
        async def cycle(entered: list[bool]) -> None:
            async with Claim(r, "cancel", ttl=5):
                entered.append(True)

        async def settle() -> None:
            grants.append(int(sync.get(keys.fence) or 0))
            assert sync.exists(keys.lock) == 0, "a lease was left behind"

        return await cancel_everywhere(r, cycle, settle)

    ends = run(server, scenario, stepping=True)
    kinds = [end for end, _point in ends]
    # Two commands (ACQUIRE, RELEASE), three points each, then a run that completes.
    assert kinds == ["cancelled in acquire"] * 3 + ["cancelled in release"] * 3 + ["done"]
    # The acquire runs to its end whatever the point: each cancelled one got a grant (a
    # new fence) and gave it back.
    assert 0 < grants[0] < grants[1] < grants[2]


def test_a_packed_acquire_or_release_cancelled_anywhere_leaves_no_lease(
    server: RedisServer,
) -> None:
    sync = server.client()
    keys = ClaimKeys.of("cut")
    grants: list[int] = []

    async def cycle(r: Any, entered: list[bool]) -> None:
        async with Claim(r, "cut", ttl=5):
            entered.append(True)

    async def settle() -> None:
        grants.append(int(sync.get(keys.fence) or 0))
        assert sync.exists(keys.lock) == 0, "a lease was left behind"

    ends = asyncio.run(Cutter().everywhere(server, cycle, settle))
    kinds = [end for end, _point in ends]
    # Two calls (ACQUIRE, RELEASE), two points each, then a run that completes.
    assert kinds == ["cancelled in acquire"] * 2 + ["cancelled in release"] * 2 + ["done"]
    # Cancelled before it was sent, an acquire is not sent; once sent, it is read by a
    # task of its own, and its grant (a new fence) given back.
    assert grants[0] == grants[1] < grants[2]


def test_a_thousand_claims_are_renewed_by_one_task_in_few_round_trips(
    server: RedisServer, fake_time: ManualClock
) -> None:
    async def scenario(r: Any) -> tuple[int, int, int]:
        fake_time.renewer_for_this_loop()
        # Renewed only as the test moves the clock, while Redis counts real seconds: a
        # lease that outlasts taking all 1000 on a loaded machine.
        claims = [Claim(r, f"many:{i}", ttl=15.0, clock=fake_time) for i in range(1000)]
        for c in claims:
            assert await c.acquire()
        rn = renewer()
        before = rn.round_trips
        await fake_time.run_async(17.5, every=0.25)  # past the ttl: only renewals keep them
        trips = rn.round_trips - before
        held = sum(c.held for c in claims)
        tasks = [t for t in asyncio.all_tasks() if t.get_name() == "fenced-renewer"]
        assert all([await r.pttl(c.key) > 0 for c in claims[::50]])
        for c in claims:
            assert await c.release()
        return trips, held, len(tasks)

    trips, held, tasks = run(server, scenario)
    assert held == 1000 and tasks == 1
    # One pipelined round per interval (5 s) and batch, a retry or two: not 1000s.
    assert 2 <= trips <= 12


BY_HAND = """
import asyncio, sys
import redis.asyncio as aredis
from fenced.aio import Claim

async def main():
    client = aredis.from_url(sys.argv[1])
    claim = Claim(client, "by-hand", ttl=5)
    assert await claim.acquire()
    if sys.argv[2] == "release":
        assert await claim.release()
    await client.aclose()

loop = asyncio.new_event_loop()
loop.run_until_complete(main())
print([t.get_name() for t in asyncio.all_tasks(loop)])
loop.close()
"""


@pytest.mark.parametrize("end", ["release", "hold"])
def test_a_loop_closed_by_hand_logs_a_pending_renewer_only_under_a_held_claim(
    server: RedisServer, end: str
) -> None:
    # The renewer lingers a moment for the next claim: with nothing left to renew, a
    # loop closed under it (no asyncio.run to cancel its tasks) loses nothing and says
    # nothing; under a held claim asyncio still reports the task it drops.
    env = {**os.environ, "PYTHONPATH": SRC}
    done = subprocess.run(
        [sys.executable, "-c", BY_HAND, server.url, end],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['fenced-renewer']"
    assert ("Task was destroyed but it is pending" in done.stderr) == (end == "hold")


def test_a_claim_nobody_references_stops_being_renewed(server: RedisServer) -> None:
    async def scenario(r: Any) -> tuple[int, int]:
        claim = Claim(r, "dropped", ttl=5)
        assert await claim.acquire()
        rn = renewer()
        count = len(rn)
        del claim
        gc.collect()
        return count, len(rn)

    assert run(server, scenario) == (1, 0)


def test_exclusive_with_an_asyncio_client_or_url(server: RedisServer) -> None:
    sync = server.client()

    async def scenario(r: Any) -> None:
        @exclusive("job:{n}", redis=r, ttl=0.6)
        async def job(n: int) -> int:
            await asyncio.sleep(0.01)
            return n

        @exclusive("job:{n}", redis=server.url, ttl=5)
        async def by_url(n: int) -> int:
            return n * 10

        @exclusive("slow", redis=r, ttl=0.6)
        async def slow() -> str:
            sync.set(ClaimKeys.of("slow").lock, "someone-else", px=10_000)
            await asyncio.sleep(10)
            return "not reached"

        assert await job(1) == 1
        assert await by_url(2) == 20
        holder = Claim(r, "job:3", ttl=5)
        assert await holder.acquire()
        skipped = await job(3)
        assert isinstance(skipped, Skipped) and not skipped
        by_url_skipped: Any = await by_url(3)
        assert isinstance(by_url_skipped, Skipped) and by_url_skipped.claim == "job:3"
        await holder.release()

        @exclusive("job:{n}", redis=r, ttl=5, on_busy="wait", wait_timeout=30)
        async def waiting(n: int) -> int:
            return n

        assert await holder.acquire()
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, lambda: asyncio.ensure_future(holder.release()))
        waited_from = time.monotonic()
        assert await waiting(3) == 3  # the loop ran on while it waited: it was released
        assert time.monotonic() - waited_from >= 0.25
        started = time.monotonic()
        with pytest.raises(ClaimLost, match="the function was interrupted"):
            await slow()
        assert time.monotonic() - started < 5

    run(server, scenario)
    with pytest.raises(ConfigError, match="coroutine functions only"):
        exclusive("x", redis=aredis.from_url(server.url))(lambda: None)


def test_claims_and_locks_on_a_cluster_client(
    cluster_server: RedisServer, fake_time: ManualClock
) -> None:
    from redis.asyncio.cluster import RedisCluster

    async def main() -> tuple[int, int]:
        r = RedisCluster(host="127.0.0.1", port=cluster_server.port)
        fake_time.renewer_for_this_loop()
        try:
            claims = [Claim(r, f"cl:{i}", ttl=0.9, clock=fake_time) for i in range(20)]
            for c in claims:
                assert await c.acquire()
            await fake_time.run_async(1.5)  # past the ttl: renewed, side by side on a Cluster
            held = sum(c.held for c in claims)
            async with Lock(r, "cl:lock", timeout=5) as lock:
                assert lock.fence is not None
            released = sum([await c.release() for c in claims])
            return held, released
        finally:
            await r.aclose()

    assert asyncio.run(main()) == (20, 20)

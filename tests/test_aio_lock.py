"""fenced.aio.Lock: a drop-in for redis.asyncio.lock.Lock, with a fence, on real servers."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import redis.asyncio
import redis.asyncio.lock
from redis.exceptions import LockError, LockNotOwnedError

import fenced
from fenced import ConfigError
from fenced.aio import Lock
from fenced.testing import RedisServer
from test_aio import Cutter, Stepping, cancel_everywhere

T = TypeVar("T")


def run(server: RedisServer, scenario: Callable[[Any], Awaitable[T]], **kw: Any) -> T:
    async def main() -> T:
        client = Stepping.on(server, **kw)
        try:
            return await scenario(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
def test_the_redis_py_surface(server: RedisServer, decode: bool) -> None:
    async def scenario(r: Any) -> None:
        lock = Lock(r, "job", timeout=10)
        assert not await lock.locked() and not await lock.owned()
        with pytest.raises(LockError, match="not owned"):
            await lock.release()
        with pytest.raises(LockError, match="unlocked"):
            lock.extend(1)
        with pytest.raises(LockError, match="unlocked"):
            lock.reacquire()
        assert await lock.acquire(blocking=False)
        assert await lock.locked() and await lock.owned()
        assert lock.fence is not None
        assert not await Lock(r, "job").acquire(blocking=False)
        assert not await Lock(r, "job", sleep=0.01).acquire(blocking_timeout=0.05)
        if "sleep" in inspect.signature(redis.asyncio.lock.Lock.acquire).parameters:
            assert not await Lock(r, "job").acquire(blocking_timeout=0.05, sleep=0.01)
        assert await lock.extend(20) is True
        assert 25_000 < await r.pttl("job") <= 30_000
        assert await lock.extend(5, replace_ttl=True)
        assert await r.pttl("job") <= 5_000
        assert await lock.reacquire()
        assert 9_000 < await r.pttl("job") <= 10_000
        await lock.release()
        assert not await lock.locked() and lock.fence is None
        # A lock whose key was taken by someone else: LockNotOwnedError, as redis-py.
        assert await lock.acquire(token="mine")
        assert await r.get("job") in (b"mine", "mine")
        await r.set("job", "theirs")
        assert not await lock.owned()
        with pytest.raises(LockNotOwnedError):
            await lock.extend(1)
        with pytest.raises(LockNotOwnedError):
            await lock.release()
        untimed = Lock(r, "untimed")
        assert await untimed.acquire()
        assert await r.pttl("untimed") == -1  # no timeout: no expiry, as redis-py
        with pytest.raises(LockError, match="no timeout"):
            untimed.extend(1)
        await untimed.release()

    run(server, scenario, decode_responses=decode)


def test_async_with_as_redis_py(server: RedisServer) -> None:
    async def scenario(r: Any) -> None:
        async with Lock(r, "ctx", timeout=5) as lock:
            assert await lock.owned()
            busy = Lock(r, "ctx", blocking=False)
            with pytest.raises(LockError, match="Unable to acquire"):
                async with busy:
                    pass
            await r.delete("ctx")
            lenient = Lock(r, "other", raise_on_release_error=False)
            async with lenient:
                await r.delete("other")  # no error at exit: only a warning
        assert not await r.exists("ctx")

    with pytest.raises(LockNotOwnedError):
        run(server, scenario)


def test_thread_and_asyncio_locks_share_one_fence_and_exclude_each_other(
    server: RedisServer,
) -> None:
    sync = server.client()

    async def scenario(r: Any) -> list[int]:
        fences = []
        for name in ("plain", "with{tag}inside"):
            for _ in range(2):
                lock = Lock(r, name, timeout=5)
                assert await lock.acquire()
                assert lock.fence is not None and await r.exists(lock.fence_key)
                assert not fenced.Lock(sync, name, timeout=5).acquire(blocking=False)
                fences.append(lock.fence)
                await lock.release()
                threaded = fenced.Lock(sync, name, timeout=5)
                assert threaded.acquire(blocking=False)
                assert not await Lock(r, name).acquire(blocking=False)
                assert threaded.fence is not None
                fences.append(threaded.fence)
                threaded.release()
        return fences

    fences = run(server, scenario)
    for part in (fences[:4], fences[4:]):
        assert part == sorted(part) and len(set(part)) == 4
    with pytest.raises(ConfigError, match="str"):
        Lock(None, b"raw")  # type: ignore[arg-type]


def test_mixed_fleets_exclude_each_other(server: RedisServer) -> None:
    async def scenario(r: Any) -> int:
        inside = 0
        most = 0

        async def worker(i: int) -> None:
            nonlocal inside, most
            for _ in range(10):
                lock: Any = Lock(r, "mixed", timeout=5, sleep=0.001)
                if i % 2:
                    lock = r.lock("mixed", timeout=5, sleep=0.001)
                async with lock:
                    inside += 1
                    most = max(most, inside)
                    await asyncio.sleep(0.001)
                    inside -= 1

        await asyncio.gather(*(worker(i) for i in range(10)))
        # Either releases what the other took under the same token.
        ours = Lock(r, "cross", timeout=5)
        assert await ours.acquire(token="shared-token")
        theirs = r.lock("cross", timeout=5)
        theirs.local.token = b"shared-token"
        await theirs.release()
        assert not await r.exists("cross")
        return most

    assert run(server, scenario) == 1


async def until(what: str, check: Callable[[], Awaitable[object]], timeout: float = 10) -> None:
    """Poll ``check`` every 10 ms until it is true; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        await asyncio.sleep(0.01)


def test_auto_renew_keeps_the_lock_past_its_timeout(server: RedisServer) -> None:
    async def scenario(r: Any) -> None:
        lock = Lock(r, "renewed", timeout=0.5, auto_renew=True)
        plain = Lock(r, "expires", timeout=0.5)
        assert await lock.acquire() and await plain.acquire()

        async def plain_expired() -> bool:
            return not await plain.owned()

        async def lock_lost() -> bool:
            return lock.lost

        # Past the timeout of both (the plain one, taken later, expires last): only
        # renewals keep the other.
        await until("the plain lock to expire", plain_expired)
        assert await lock.owned() and not lock.lost
        assert not await plain.owned()
        await r.set("renewed", "stolen")
        await until("the renewal to find the lock taken", lock_lost)
        assert lock.lost
        with pytest.raises(LockNotOwnedError):
            await lock.release()

    run(server, scenario)
    with pytest.raises(ConfigError, match="timeout"):
        Lock(None, "x", auto_renew=True)


def test_a_cancelled_acquire_or_release_leaves_no_lock(server: RedisServer) -> None:
    sync = server.client()

    async def scenario(r: Any) -> list[tuple[str, int]]:
        async def cycle(entered: list[bool]) -> None:
            async with Lock(r, "cancelled", timeout=30):
                entered.append(True)

        async def settle() -> None:
            assert not sync.exists("cancelled"), "a lock was left behind"

        return await cancel_everywhere(r, cycle, settle)

    ends = run(server, scenario)
    kinds = [end for end, _point in ends]
    assert kinds == ["cancelled in acquire"] * 3 + ["cancelled in release"] * 3 + ["done"]


def test_a_packed_acquire_or_release_cancelled_anywhere_leaves_no_lock(
    server: RedisServer,
) -> None:
    sync = server.client()

    async def cycle(r: Any, entered: list[bool]) -> None:
        async with Lock(r, "cut", timeout=30):
            entered.append(True)

    async def settle() -> None:
        assert not sync.exists("cut"), "a lock was left behind"

    ends = asyncio.run(Cutter().everywhere(server, cycle, settle))
    kinds = [end for end, _point in ends]
    assert kinds == ["cancelled in acquire"] * 2 + ["cancelled in release"] * 2 + ["done"]


class FakeLoopTime:
    """Stands in for the asyncio module of redis-py's asyncio lock loop."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def get_running_loop(self) -> FakeLoopTime:
        return self

    def time(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_it_is_redis_pys_asyncio_lock_and_waits_in_its_loop(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeLoopTime()

    async def scenario(r: Any) -> None:
        lock = r.lock("job", sleep=0.05, blocking_timeout=0.2, lock_class=Lock)
        assert isinstance(lock, Lock) and isinstance(lock, redis.asyncio.lock.Lock)
        assert (lock.sleep, lock.blocking, lock.blocking_timeout) == (0.05, True, 0.2)
        holder = Lock(r, "job")
        assert await holder.acquire(blocking=False)
        # redis-py's own test_blocking_timeout: its loop's clock, its sleeps.
        monkeypatch.setattr(redis.asyncio.lock, "asyncio", fake)
        assert not await lock.acquire()
        monkeypatch.undo()
        await holder.release()

    run(server, scenario)
    assert fake.now == pytest.approx(0.2) and fake.sleeps == [0.05] * 4


def test_a_lock_lost_through_expiry_says_so_in_both_front_ends(own_server: RedisServer) -> None:
    told: list[Any] = []
    sync_client = own_server.client(socket_timeout=5)
    threaded = fenced.Lock(sync_client, "thread", timeout=0.6, auto_renew=True, on_lost=told.append)
    expired = "no renewal was confirmed before the local deadline"

    async def scenario() -> Any:
        r = redis.asyncio.Redis(port=own_server.port, socket_timeout=5)
        lock = Lock(r, "asyncio", timeout=0.6, auto_renew=True, on_lost=told.append)
        assert threaded.acquire(blocking=False) and await lock.acquire(blocking=False)
        own_server.pause()
        try:
            # Reading ``lost`` asks nothing of the (paused) server.
            give_up = time.monotonic() + 10
            while not (threaded.lost and lock.lost):
                assert time.monotonic() < give_up, "the local deadlines passed unnoticed"
                await asyncio.sleep(0.02)
            assert threaded.lost_reason == lock.lost_reason == expired
        finally:
            own_server.resume()
        assert not threaded.owned() and not await lock.owned()
        with pytest.raises(LockNotOwnedError, match="lost while held"):
            threaded.release()
        with pytest.raises(LockNotOwnedError, match="lost while held"):
            await lock.release()
        assert threaded.lost and lock.lost, "until the next acquire"
        await r.aclose()
        return lock

    lock = asyncio.run(scenario())
    sync_client.close()
    assert sorted(map(id, told)) == sorted([id(threaded), id(lock)]), "on_lost once each"

"""``fenced.aio.Lock``: ``fenced.Lock`` for ``redis.asyncio``, a drop-in for its ``Lock``.

A subclass of ``redis.asyncio.lock.Lock`` on ``fenced._lock.LockCore``, as the thread
``fenced.Lock`` is a subclass of ``redis.lock.Lock`` on it: the same keys, scripts,
tokens, fence and renewed hold, so the two, and redis-py's own locks (sync and
asyncio), exclude each other on one name, and thread and asyncio holders of one name
share one fence. redis-py's acquire loop, ``locked``, ``extend``, ``reacquire`` and
``async with`` are used as they are; a renewed hold is renewed by the event loop's
renewer (with the claims).

An acquire cancelled once it was sent has its reply read by a task of its own (a grant
in it is given back); a release cut short is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, Literal

import redis
from redis.asyncio.lock import Lock as _RedisLock
from redis.exceptions import LockError, LockNotOwnedError

from .._client import require_async
from .._lock import LockCore
from .._scripts import LOCK_RELEASE
from ._renewer import Renewer, renewer
from ._send import call, keep, run_to_end

__all__ = ["Lock"]

log = logging.getLogger("fenced")


class Lock(LockCore, _RedisLock):
    """``redis.asyncio.lock.Lock`` with a fencing token (``fence``) and optional renewal.

    Same constructor, methods and errors (``LockError``, ``LockNotOwnedError``) as
    redis-py's; the keyword-only parameters are ``fenced.Lock``'s (``auto_renew``,
    ``refresh_every``, ``on_lost``, ``idle_ttl``, ``namespace``).
    """

    _KIND = "fenced.aio.Lock"

    def _connect(self, redis: Any) -> Any:
        return require_async(redis, "fenced.aio.Lock", "fenced.Lock")

    def _renewer(self) -> Renewer:
        return renewer()

    async def __aenter__(self) -> Lock:
        if await self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified", lock_name=self.name)

    async def owned(self) -> bool:
        """True if this lock holds the key now: redis-py's check, and never once lost."""
        return not self.lost and await super().owned()

    async def acquire(
        self,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
        *,
        sleep: float | None = None,
    ) -> bool:
        """Take the lock as redis-py does (blocking by default); mint the fence with it."""
        # ``sleep`` reaches a redis-py that takes it (8.2 on) only when given.
        more: dict[str, Any] = {} if sleep is None else {"sleep": sleep}
        return bool(await super().acquire(blocking, blocking_timeout, self._token(token), **more))

    async def do_acquire(self, token: str | bytes) -> bool:
        """One try: ``SET NX`` and a new fence, in one round trip."""
        raw, request = self._acquire_call(token)
        sent = time.monotonic()
        try:
            reply = await call(self.redis, request, lambda f: self._abandon(f, raw))
            if reply is None:  # a fence Lua could not read as a number: no fence to give
                raise redis.ResponseError("the fence is not a number")
        except redis.ResponseError as exc:
            # The script stops at a fence that is not an integer after it set the lock.
            value = None
            with contextlib.suppress(Exception):
                await call(self.redis, (LOCK_RELEASE, (self.name,), (raw,)))
                value = await self.redis.get(self.fence_key)
            error = self._corrupt(exc, value)
            if error is exc:
                raise
            raise error from exc
        took = self._took(raw, reply, sent)
        if took is None:
            await run_to_end(call(self.redis, (LOCK_RELEASE, (self.name,), (raw,))))
        return bool(took)

    async def _abandon(self, request: asyncio.Future[Any], token: bytes) -> None:
        # The caller was cancelled while its acquire was on its way: give a grant back.
        if not request.cancelled() and request.exception() is None and int(request.result()):
            try:
                await call(self.redis, (LOCK_RELEASE, (self.name,), (token,)))
            except Exception:  # best effort: a lock with a timeout expires anyway
                log.warning("fenced: could not give back an abandoned grant of lock %r", self.name)

    async def release(self) -> None:
        """Release the lock (sent again when the caller is cancelled meanwhile)."""
        expected = self.local.token
        if expected is None:
            raise LockError(
                "Cannot release a lock that's not owned or is already unlocked.",
                lock_name=self.name,
            )
        local = self.local
        try:
            await self.do_release(expected)
        except LockNotOwnedError:
            local.token = None  # gone from Redis: safe to forget
            raise
        except asyncio.CancelledError:
            # Sent or not: compare-and-delete again from a task of its own (a repeat of
            # one that landed finds the key gone and changes nothing).
            keep(asyncio.ensure_future(self._release_again(local, expected)))
            raise
        local.token = None

    async def _release_again(self, local: Any, expected: bytes) -> None:
        try:
            await call(self.redis, (LOCK_RELEASE, (self.name,), (expected,)))
        except Exception:  # a lock with a timeout expires anyway
            log.warning("fenced: could not release lock %r after a cancel", self.name)
        if local.token == expected:
            local.token = None

    async def do_release(self, expected_token: bytes) -> None:
        """Compare-and-delete; LockNotOwnedError when the token no longer held it, or the
        hold was lost before."""
        hold = self._let_go()
        self._released(
            hold, await call(self.redis, (LOCK_RELEASE, (self.name,), (expected_token,)))
        )

    async def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        """redis-py's extend; a renewed hold's deadline moves with it."""
        sent = time.monotonic()
        self._refuse_if_lost("extend")
        await super().do_extend(additional_time, replace_ttl)
        self._extended(sent, float(additional_time), replace_ttl)
        return True

    async def do_reacquire(self) -> Literal[True]:
        """redis-py's reacquire; a renewed hold's deadline moves with it."""
        sent = time.monotonic()
        self._refuse_if_lost("reacquire")
        await super().do_reacquire()
        self._extended(sent, self._ttl, True)
        return True

"""``fenced.aio.Lock``: ``fenced.Lock`` for ``redis.asyncio``, a drop-in for its ``Lock``.

The same keys, scripts, tokens and renewal state as the thread ``fenced.Lock``, so the
two, and redis-py's own locks (sync and asyncio), exclude each other on one name, and
thread and asyncio holders of one name share one fence:

- the lock lives under its name, as redis-py keeps it (the token as value, ``PX`` the
  timeout); release is compare-and-delete, extend and reacquire are redis-py's own;
- the fence is minted in the acquire script (``fenced._scripts.LOCK_ACQUIRE``) and
  kept under ``fenced._lock.fence_key(name)``, in the name's Cluster slot;
- ``auto_renew=True`` keeps a lock with a ``timeout`` alive from the event loop's
  renewer (with the claims) through the thread Lock's hold (``fenced._lock._Hold``):
  a hold found gone, or not renewed in time, is *lost* (``lost``, ``owned()`` False,
  ``on_lost`` called once, ``release()`` raises ``LockNotOwnedError``).

An acquire runs to its end even when its caller is cancelled (a grant that lands after
that is given back); a release cut short is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace, TracebackType
from typing import Any, Literal, cast

import redis
from redis.asyncio.lock import Lock as _RedisLock
from redis.exceptions import LockError, LockNotOwnedError

from .._client import require_async
from .._lease import IDLE_TTL
from .._lock import (
    _Hold,
    check_lock_options,
    check_renewable_token,
    corrupt_fence,
    fence_key,
    new_token,
)
from .._scripts import LOCK_ACQUIRE, LOCK_RELEASE, Script
from ._renewer import renewer
from ._send import call, keep, run_to_end

__all__ = ["Lock"]

log = logging.getLogger("fenced")

# redis-py's own scripts: the same answers as its Lock gives.
LOCK_EXTEND = Script("lock_extend", _RedisLock.LUA_EXTEND_SCRIPT)
LOCK_REACQUIRE = Script("lock_reacquire", _RedisLock.LUA_REACQUIRE_SCRIPT)


class Lock:
    """``redis.asyncio.lock.Lock`` with a fencing token (``fence``) and optional renewal.

    Same constructor, methods and errors (``LockError``, ``LockNotOwnedError``) as
    redis-py's; the keyword-only parameters are ``fenced.Lock``'s (``auto_renew``,
    ``refresh_every``, ``on_lost``, ``idle_ttl``, ``namespace``).
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
        *,
        auto_renew: bool = False,
        refresh_every: float | None = None,
        on_lost: Callable[[Lock], object] | None = None,
        idle_ttl: float | None = IDLE_TTL,
        namespace: str = "fenced",
    ) -> None:
        self._ttl, self._refresh_every, self._idle_ms = check_lock_options(
            redis, name, timeout, auto_renew, refresh_every, idle_ttl, namespace
        )
        redis = require_async(redis, "fenced.aio.Lock", "fenced.Lock")
        self.fence_key = fence_key(name, namespace)
        self.redis = redis
        self.name = name
        self.timeout = timeout
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.thread_local = bool(thread_local)
        self.local: Any = threading.local() if self.thread_local else SimpleNamespace()
        self.raise_on_release_error = raise_on_release_error
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.namespace = namespace
        self.local.token = None
        self.local.fence = None
        self.local.hold = None
        self.local.generated = False

    def __repr__(self) -> str:
        return f"<fenced.aio.Lock {self.name!r} fence={self.fence}>"

    # -- state ------------------------------------------------------------------------

    @property
    def fence(self) -> int | None:
        """The fencing token of the current hold (None when not held)."""
        fence: int | None = getattr(self.local, "fence", None)
        return fence

    @property
    def lost(self) -> bool:
        """True once a renewed hold was lost, until the next acquire (asks nothing of Redis)."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        return hold is not None and hold.lost

    @property
    def lost_reason(self) -> str | None:
        """Why the hold was lost (None while it is not)."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        return hold.lost_reason if hold is not None and hold.lost else None

    # -- what redis-py's Lock has -------------------------------------------------------

    async def __aenter__(self) -> Lock:
        if await self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified", lock_name=self.name)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except LockError:
            if self.raise_on_release_error:
                raise
            logging.getLogger("redis.asyncio.lock").warning(
                "Lock was unlocked or no longer owned when exiting context manager."
            )

    async def acquire(
        self,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Take the lock as redis-py does (blocking by default); mint the fence with it."""
        generated = token is None
        raw: bytes = new_token() if token is None else self._encoder().encode(token)
        if token is not None and self.auto_renew:
            check_renewable_token(self._encoder(), token, self.name)
        self.local.generated = generated
        if blocking is None:
            blocking = self.blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        loop = asyncio.get_running_loop()
        stop_trying_at = None if blocking_timeout is None else loop.time() + blocking_timeout
        while True:
            if await self.do_acquire(raw):
                return True
            if not blocking:
                return False
            next_try_at = loop.time() + self.sleep
            if stop_trying_at is not None and next_try_at > stop_trying_at:
                return False
            await asyncio.sleep(self.sleep)

    async def do_acquire(self, token: str | bytes) -> bool:
        """One try: ``SET NX`` and a new fence, in one round trip."""
        raw: bytes = self._encoder().encode(token)
        ttl_ms = int(self.timeout * 1000) if self.timeout else ""
        generated = 1 if getattr(self.local, "generated", False) else 0
        request = (
            LOCK_ACQUIRE,
            (self.name, self.fence_key),
            (raw, ttl_ms, self._idle_ms, generated),
        )
        sent = time.monotonic()
        try:
            reply = await run_to_end(call(self.redis, request), lambda f: self._abandon(f, raw))
            if reply is None:  # a fence Lua could not read as a number: no fence to give
                raise redis.ResponseError("the fence is not a number")
        except redis.ResponseError as exc:
            # The script stops at a fence that is not an integer after it set the lock.
            value = None
            with contextlib.suppress(Exception):
                await call(self.redis, (LOCK_RELEASE, (self.name,), (raw,)))
                value = await self.redis.get(self.fence_key)
            error = corrupt_fence(self.name, self.fence_key, value, exc)
            if error is exc:
                raise
            raise error from exc
        fence = int(reply)
        if not fence:
            return False
        hold = None
        if self.auto_renew:
            hold = _Hold(cast(Any, self), raw, fence, sent, self._ttl, self._refresh_every)
            if hold.past_deadline():
                # Granted after the lock's own deadline: another holder may take it soon.
                await run_to_end(call(self.redis, (LOCK_RELEASE, (self.name,), (raw,))))
                log.warning("fenced: lock %r granted after its deadline; given back", self.name)
                return False
            renewer().add(hold)
        self.local.token = raw
        self.local.fence = fence
        self.local.hold = hold
        return True

    async def _abandon(self, request: asyncio.Future[Any], token: bytes) -> None:
        # The caller was cancelled while its acquire was on its way: give a grant back.
        if not request.cancelled() and request.exception() is None and int(request.result()):
            try:
                await call(self.redis, (LOCK_RELEASE, (self.name,), (token,)))
            except Exception:  # best effort: a lock with a timeout expires anyway
                log.warning("fenced: could not give back an abandoned grant of lock %r", self.name)

    async def locked(self) -> bool:
        """True if this key is locked by any process."""
        return await self.redis.get(self.name) is not None

    async def owned(self) -> bool:
        """True if this lock holds the key now: redis-py's check, and never once lost."""
        if self.lost:
            return False
        stored = await self.redis.get(self.name)
        if stored and not isinstance(stored, bytes):
            stored = self._encoder().encode(stored)
        return self.local.token is not None and stored == self.local.token

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
        hold was lost before (the work under it was not protected)."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        before = "held"
        if hold is not None:
            before = hold.give_back()
            renewer().discard(hold)
        self.local.fence = None
        released = await call(self.redis, (LOCK_RELEASE, (self.name,), (expected_token,)))
        if before == "lost":
            reason = hold.lost_reason if hold is not None else None
            raise LockNotOwnedError(
                f"Cannot release a lock that was lost while held ({reason})",
                lock_name=self.name,
            )
        if not released:
            raise LockNotOwnedError(
                "Cannot release a lock that's no longer owned", lock_name=self.name
            )

    def extend(self, additional_time: float, replace_ttl: bool = False) -> Awaitable[Literal[True]]:
        """Add ``additional_time`` seconds (or set the ttl to it, with ``replace_ttl``)."""
        if self.local.token is None:
            raise LockError("Cannot extend an unlocked lock")
        if self.timeout is None:
            raise LockError("Cannot extend a lock with no timeout")
        return self.do_extend(additional_time, replace_ttl)

    async def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        """redis-py's extend; a renewed hold's deadline moves with it."""
        sent = time.monotonic()
        self._refuse_if_lost("extend")
        args = [self.local.token, int(additional_time * 1000), "1" if replace_ttl else "0"]
        if not await call(self.redis, (LOCK_EXTEND, [self.name], args)):
            raise LockNotOwnedError("Cannot extend a lock that's no longer owned")
        hold: _Hold | None = getattr(self.local, "hold", None)
        if hold is not None:
            hold.extended(sent, float(additional_time), replace_ttl)
        return True

    def reacquire(self) -> Awaitable[Literal[True]]:
        """Reset the lock's ttl to its timeout."""
        if self.local.token is None:
            raise LockError("Cannot reacquire an unlocked lock")
        if self.timeout is None:
            raise LockError("Cannot reacquire a lock with no timeout")
        return self.do_reacquire()

    async def do_reacquire(self) -> Literal[True]:
        """redis-py's reacquire; a renewed hold's deadline moves with it."""
        assert self.timeout is not None
        sent = time.monotonic()
        self._refuse_if_lost("reacquire")
        args = [self.local.token, int(self.timeout * 1000)]
        if not await call(self.redis, (LOCK_REACQUIRE, [self.name], args)):
            raise LockNotOwnedError("Cannot reacquire a lock that's no longer owned")
        hold: _Hold | None = getattr(self.local, "hold", None)
        if hold is not None:
            hold.extended(sent, self._ttl, True)
        return True

    def _refuse_if_lost(self, what: str) -> None:
        if self.lost:
            raise LockNotOwnedError(
                f"Cannot {what} a lock that was lost while held ({self.lost_reason})",
                lock_name=self.name,
            )

    def _encoder(self) -> Any:
        try:
            return self.redis.connection_pool.get_encoder()
        except AttributeError:  # Cluster
            return self.redis.get_encoder()

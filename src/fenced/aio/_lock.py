"""``fenced.aio.Lock``: a drop-in for ``redis.asyncio.lock.Lock`` that also hands out a fence.

Keys: the lock lives under its name, exactly as redis-py keeps it (the token as value,
``PX`` the timeout), so a fenced Lock and ``r.lock(name)`` on the same name exclude
each other in a mixed fleet, and either may release or extend what the other holds
under its own token. The fence lives under a side key that shares the name's Cluster
slot: ``name + ":fence"`` when the name has a hash tag (``"{a}b"``), else
``"{name}:fence"`` (a name without a tag hashes as a whole, and so does the braced
tag). A name with a ``}`` and no tag cannot be given a key in its slot: on Cluster,
give such a name a hash tag.

Release, extend and reacquire run redis-py's own scripts, so they behave as redis-py's
do. Acquire is one script: ``SET NX`` plus minting the fence by the rule every fence
in fenced follows (``fenced._scripts.MINT_FENCE``). ``auto_renew=True`` keeps a lock
with a timeout alive from the event loop's renewer (with the claims) until release;
``lost`` then says whether a renewal found it gone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Awaitable
from types import SimpleNamespace, TracebackType
from typing import Any, Literal

from redis.asyncio.lock import Lock as _RedisLock
from redis.exceptions import LockError, LockNotOwnedError

from .._errors import ConfigError
from .._heartbeat import Renewal
from .._scripts import MINT_FENCE, Script
from ._renewer import renewer
from ._send import call, keep, run_to_end

__all__ = ["Lock", "fence_key"]

log = logging.getLogger("fenced")

# LOCK_ACQUIRE
# KEYS[1] the lock (the name)   KEYS[2] its fence
# ARGV[1] token   ARGV[2] timeout in ms, or "" for none
# returns the new fence when the lock is ours, else false (nil)
LOCK_ACQUIRE = Script(
    "lock_acquire",
    MINT_FENCE
    + """
local set
if ARGV[2] == '' then
  set = redis.call('SET', KEYS[1], ARGV[1], 'NX')
else
  set = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
end
if not set then return false end
return mint(KEYS[2])
""",
)
# redis-py's own scripts: the same answers as its Lock gives.
LOCK_RELEASE = Script("lock_release", _RedisLock.LUA_RELEASE_SCRIPT)
LOCK_EXTEND = Script("lock_extend", _RedisLock.LUA_EXTEND_SCRIPT)
LOCK_REACQUIRE = Script("lock_reacquire", _RedisLock.LUA_REACQUIRE_SCRIPT)


def _has_tag(name: str) -> bool:
    """Whether Redis Cluster hashes ``name`` by a tag (a non-empty ``{...}``)."""
    start = name.find("{")
    return start >= 0 and name.find("}", start + 1) > start + 1


def fence_key(name: str | bytes | memoryview) -> str | bytes:
    """The key of a lock's fence: in the name's Cluster slot (see the module docstring)."""
    if isinstance(name, str):
        return name + ":fence" if _has_tag(name) or "}" in name else "{" + name + "}:fence"
    raw = bytes(name)
    text = raw.decode("latin-1")  # byte for byte, to find the braces
    if _has_tag(text) or "}" in text:
        return raw + b":fence"
    return b"{" + raw + b"}:fence"


class Lock:
    """A drop-in for ``redis.asyncio.lock.Lock`` with a fencing token (``fence``).

    Same constructor, methods and errors (``LockError``, ``LockNotOwnedError``) as
    redis-py's; ``auto_renew=True`` renews a lock that has a ``timeout`` until release.
    """

    def __init__(
        self,
        redis: Any,
        name: str | bytes | memoryview,
        timeout: float | None = None,
        sleep: float = 0.1,
        blocking: bool = True,
        blocking_timeout: float | None = None,
        thread_local: bool = True,
        raise_on_release_error: bool = True,
        *,
        auto_renew: bool = False,
    ) -> None:
        if auto_renew and not timeout:
            raise ConfigError(
                "auto_renew=True needs a timeout (seconds the lock lasts unrenewed, "
                "e.g. timeout=30): a lock without one never expires"
            )
        self.redis = redis
        # Any: redis-py takes text, bytes or a memoryview, and so do the scripts.
        self.name: Any = name
        self.timeout = timeout
        self.sleep = sleep
        self.blocking = blocking
        self.blocking_timeout = blocking_timeout
        self.thread_local = bool(thread_local)
        self.local: Any = threading.local() if self.thread_local else SimpleNamespace()
        self.raise_on_release_error = raise_on_release_error
        self.auto_renew = auto_renew
        self.local.token = None
        self.local.fence = None
        self._fence_key = fence_key(name)
        # The renewer's view of an auto-renewed lock (one holder at a time).
        self._renewing: bytes | None = None
        self._deadline = 0.0
        self._next_refresh = 0.0
        #: True once a renewal found the lock gone or under another token, or its
        #: deadline passed unrenewed (auto_renew only); reset by the next acquire.
        self.lost = False

    # -- what redis-py's Lock has -------------------------------------------------------

    async def __aenter__(self) -> Lock:
        if await self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified")

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
        """Take the lock (blocking by default, as redis-py); True once it is ours."""
        sleep = self.sleep
        token = uuid.uuid1().hex.encode() if token is None else self._encoder().encode(token)
        if blocking is None:
            blocking = self.blocking
        if blocking_timeout is None:
            blocking_timeout = self.blocking_timeout
        loop = asyncio.get_running_loop()
        stop_trying_at = None if blocking_timeout is None else loop.time() + blocking_timeout
        while True:
            if await self.do_acquire(token):
                return True
            if not blocking:
                return False
            next_try_at = loop.time() + sleep
            if stop_trying_at is not None and next_try_at > stop_trying_at:
                return False
            await asyncio.sleep(sleep)

    async def do_acquire(self, token: str | bytes) -> bool:
        """One try: ``SET NX`` and a new fence, in one round trip."""
        raw: bytes = self._encoder().encode(token)
        timeout = int(self.timeout * 1000) if self.timeout else ""
        request = (LOCK_ACQUIRE, [self.name, self._fence_key], [raw, timeout])
        sent = time.monotonic()
        fence = await run_to_end(call(self.redis, request), lambda f: self._abandon(f, raw))
        if fence is None:
            return False
        self.local.token = raw
        self.local.fence = int(fence)
        self.lost = False
        if self.auto_renew and self.timeout:
            self._renewing = raw
            self._deadline = sent + self.timeout * 0.99 - 0.002
            self._next_refresh = sent + self.timeout / 3
            renewer().add(self)
        return True

    async def _abandon(self, request: asyncio.Future[Any], token: bytes) -> None:
        # The caller was cancelled while its acquire was on its way: give a grant back.
        if not request.cancelled() and request.exception() is None and request.result():
            try:
                await call(self.redis, (LOCK_RELEASE, [self.name], [token]))
            except Exception:  # best effort: a lock with a timeout expires anyway
                log.warning("fenced: could not give back an abandoned grant of lock %r", self.name)

    async def locked(self) -> bool:
        """True if this key is locked by any process."""
        return await self.redis.get(self.name) is not None

    async def owned(self) -> bool:
        """True if this key is locked by this lock's token."""
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
        if self._renewing == expected:
            self._renewing = None
            renewer().discard(self)
        local = self.local
        try:
            await self.do_release(expected)
        except LockNotOwnedError:
            local.token = local.fence = None  # gone from Redis: safe to forget
            raise
        except asyncio.CancelledError:
            # Sent or not: compare-and-delete again from a task of its own (a repeat of
            # one that landed finds the key gone and changes nothing).
            keep(asyncio.ensure_future(self._release_again(local, expected)))
            raise
        local.token = local.fence = None

    async def _release_again(self, local: Any, expected: bytes) -> None:
        try:
            await call(self.redis, (LOCK_RELEASE, [self.name], [expected]))
        except Exception:  # a lock with a timeout expires anyway
            log.warning("fenced: could not release lock %r after a cancel", self.name)
        if local.token == expected:
            local.token = local.fence = None

    async def do_release(self, expected_token: bytes) -> None:
        """Compare-and-delete (redis-py's script)."""
        if not await call(self.redis, (LOCK_RELEASE, [self.name], [expected_token])):
            raise LockNotOwnedError("Cannot release a lock that's no longer owned")

    def extend(self, additional_time: float, replace_ttl: bool = False) -> Awaitable[Literal[True]]:
        """Add ``additional_time`` seconds (or set the ttl to it, with ``replace_ttl``)."""
        if self.local.token is None:
            raise LockError("Cannot extend an unlocked lock")
        if self.timeout is None:
            raise LockError("Cannot extend a lock with no timeout")
        return self.do_extend(additional_time, replace_ttl)

    async def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        """Extend with redis-py's script."""
        ms = int(additional_time * 1000)
        args = [self.local.token, ms, "1" if replace_ttl else "0"]
        if not await call(self.redis, (LOCK_EXTEND, [self.name], args)):
            raise LockNotOwnedError("Cannot extend a lock that's no longer owned")
        return True

    def reacquire(self) -> Awaitable[Literal[True]]:
        """Reset the lock's ttl to its timeout."""
        if self.local.token is None:
            raise LockError("Cannot reacquire an unlocked lock")
        if self.timeout is None:
            raise LockError("Cannot reacquire a lock with no timeout")
        return self.do_reacquire()

    async def do_reacquire(self) -> Literal[True]:
        """Reacquire with redis-py's script."""
        assert self.timeout is not None
        args = [self.local.token, int(self.timeout * 1000)]
        if not await call(self.redis, (LOCK_REACQUIRE, [self.name], args)):
            raise LockNotOwnedError("Cannot reacquire a lock that's no longer owned")
        return True

    # -- what fenced adds -----------------------------------------------------------------

    @property
    def fence(self) -> int | None:
        """The fencing token of the current hold (None when not held): strictly increasing."""
        fence: int | None = self.local.fence
        return fence

    def _encoder(self) -> Any:
        try:
            return self.redis.connection_pool.get_encoder()
        except AttributeError:  # Cluster
            return self.redis.get_encoder()

    # -- what the renewer asks and tells (fenced._heartbeat.Renewable) -----------------

    def renewal(self) -> Renewal | None:
        """The lease to renew now, or None when it is not auto-renewed."""
        token, timeout = self._renewing, self.timeout
        if token is None or not timeout or self.lost:
            return None
        # The name and token are passed to REFRESH as they are (bytes or text).
        return Renewal(
            self.redis,
            self.name,
            token,  # type: ignore[arg-type]
            int(timeout * 1000),
            timeout / 3,
            self._next_refresh,
            self._deadline,
        )

    def renewed(self, sent: float, token: Any) -> None:
        """Redis extended the lock held under ``token`` by a request sent at ``sent``."""
        if token != self._renewing or not self.timeout:
            return
        if time.monotonic() >= self._deadline:
            self.lost = True  # confirmed too late: the lock was free meanwhile
            return
        self._deadline = max(self._deadline, sent + self.timeout * 0.99 - 0.002)
        self._next_refresh = sent + self.timeout / 3

    def retry_soon(self) -> None:
        """No confirmed answer yet: look again soon."""
        if self.timeout:
            self._next_refresh = time.monotonic() + self.timeout / 3 * 0.35

    def renewal_refused(self, token: Any) -> None:
        """The lock is gone or held under another token."""
        if token == self._renewing:
            self.lost = True

    def expired(self, token: Any) -> None:
        """The local deadline passed with no renewal confirmed."""
        if token == self._renewing:
            self.lost = True

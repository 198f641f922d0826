"""Lock: redis-py's ``Lock``, with a fencing token and, when asked, background renewal.

A drop-in for :class:`redis.lock.Lock` (it is a subclass): the same constructor, the
same methods and exceptions, usable as ``r.lock(name, lock_class=fenced.Lock)``. It
keeps the lock where redis-py keeps it, under the key ``name`` with the token as its
value, so redis-py Locks and fenced Locks on one name exclude each other, and it
releases, extends and reacquires with the same compare-first scripts.

What it adds:

- ``fence``: an integer minted in the same script as the acquire, strictly increasing
  per name, ``max(previous + 1, Redis TIME in µs)`` (the claims' rule), so it keeps
  increasing after a Redis restart that kept nothing. It lives in a side key that
  shares the name's Cluster slot (see :func:`fence_key`).
- ``auto_renew=True``: the process's heartbeat (``fenced._heartbeat``) renews the lock
  every ``refresh_every`` (default timeout/3). A renewal that finds the lock gone or
  held under another token, or no renewal confirmed before the local deadline, makes
  the hold *lost*: ``lost`` is True, ``owned()`` is False, ``on_lost`` is called once,
  and ``release()`` raises ``LockNotOwnedError``. A lost hold never comes back.

Why renewal matters, as a timeline (``timeout=10``, no renewal)::

    t0      A acquires "report"                          fence 1001
    t0+10   A is still working; the key expires
    t0+10   B acquires "report"                          fence 1002
    t0+12   A writes its result: only a store that compares fences refuses it
    t0+13   A's release() finds B's token: LockNotOwnedError, B's lock is left alone

With ``auto_renew=True`` A's lock does not expire while A's process runs; if A is
paused past its deadline anyway, ``lock.lost`` says so before A's next step.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

import redis
import redis.lock
from redis.exceptions import LockError, LockNotOwnedError

from ._audit import claim_fields
from ._client import connect
from ._errors import ConfigError
from ._heartbeat import RETRY_SHARE, Renewal
from ._heartbeat import heartbeat as _heartbeat
from ._lease import (
    IDLE_TTL,
    check_idle_ttl,
    check_namespace,
    check_timing,
    corrupt_key_error,
    current_pid,
    int_or_none,
)
from ._printable import readable
from ._scripts import LOCK_ACQUIRE, LOCK_RELEASE

__all__ = ["Lock", "fence_key", "hash_tag", "shares_slot"]

log = logging.getLogger("fenced")

_HELD, _LOST, _RELEASED = "held", "lost", "released"
_DEADLINE_PASSED = "no renewal was confirmed before the local deadline"
_TAKEN = "the lock is gone or held under another token"


#: 100-ns intervals from the start of the Gregorian calendar (uuid1's epoch) to 1970.
_UUID1_EPOCH = 0x01B21DD213814000


class _Uuid1:
    """Version-1 UUIDs as 32 hex bytes, the tokens redis-py's Lock makes, made cheaply.

    ``uuid.uuid1()`` asks libuuid, which keeps its clock sequence in a system-wide file
    under a file lock: about 10 µs per token, as much as a round trip to a local Redis.
    These follow RFC 4122 for a host without a usable MAC (section 4.5): a random node
    with the multicast bit set and a random clock sequence, both drawn anew in each
    process (so a forked child never repeats its parent's), and a timestamp that never
    repeats within the process.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._reset()
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._node = secrets.randbits(48) | 1 << 40
        self._clock_seq = secrets.randbits(14) | 0x8000  # with the RFC 4122 variant bits
        self._last = 0

    def __call__(self) -> bytes:
        ticks = time.time_ns() // 100 + _UUID1_EPOCH
        with self._mutex:
            if ticks <= self._last:
                ticks = self._last + 1
            self._last = ticks
        return b"%08x%04x%04x%04x%012x" % (
            ticks & 0xFFFFFFFF,
            ticks >> 32 & 0xFFFF,
            ticks >> 48 & 0x0FFF | 0x1000,
            self._clock_seq,
            self._node,
        )


new_token = _Uuid1()


def hash_tag(name: str) -> str | None:
    """The Redis Cluster hash tag of a key (the rule of the Cluster spec), or None."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:
        return None  # no closing brace, or "{}": the whole key is hashed
    return name[start + 1 : end]


def corrupt_fence(name: str, key: str, value: Any, exc: BaseException) -> BaseException:
    """CorruptKey when a lock's fence key holds what is not an integer, else ``exc``."""
    if value is None or int_or_none(value) is not None:
        return exc
    problem = f"holds {readable(value)[:40]!r}, not an integer"
    return corrupt_key_error(name, key, problem, exc, doing="acquire lock", is_fence=True)


def fence_key(name: str, namespace: str = "fenced") -> str:
    """Where the fence of lock ``name`` lives: a key in the same Cluster slot as ``name``.

    - a name with a hash tag (``"job:{acme}:report"``) keeps it:
      ``fenced:lock:fence:job:{acme}:report``;
    - a name without one, and without ``}`` (``"report"``), is made the tag:
      ``fenced:lock:{report}:fence`` (Cluster hashes it as it hashes ``report``);
    - any other name (``"a}b"``, ``""``) has no key that shares its slot:
      ``fenced:lock:fence:a}b``, fine on one server, refused on a Cluster client.

    The two forms start differently, so two names never share a fence key.
    """
    if hash_tag(name) is None and name and "}" not in name:
        return f"{namespace}:lock:{{{name}}}:fence"
    return f"{namespace}:lock:fence:{name}"


def shares_slot(name: str) -> bool:
    """Whether :func:`fence_key` of ``name`` lands in the same Cluster slot as ``name``."""
    return hash_tag(name) is not None or (bool(name) and "}" not in name)


class _Hold:
    """One acquire of a Lock while it is renewed: what the heartbeat talks to.

    A Lock keeps its token per thread (``thread_local``), so what is held is the
    acquire, not the Lock object: each acquire gets its own hold, kept in the same
    storage as the token. The heartbeat references holds weakly: a Lock that nobody
    references any more stops being renewed and expires by its timeout.
    """

    def __init__(
        self,
        lock: Lock,
        token: bytes,
        fence: int,
        sent: float,
        ttl: float,
        refresh_every: float,
    ) -> None:
        self.name = lock.name
        self._lock = weakref.ref(lock)
        self._client = lock.redis
        self._key = lock.name
        # The heartbeat's REFRESH sends the token as text; the client's encoder turns it
        # back into exactly these bytes (checked in Lock.acquire).
        self.token = token.decode()
        self.fence = fence
        self.ttl = ttl
        self.refresh_every = refresh_every
        self._ttl_ms = max(1, int(ttl * 1000))
        # Clock drift between this host and Redis, and the time a PEXPIRE takes to apply,
        # eat into the lease: trust it slightly less long (the claims' margin).
        self._drift = ttl * 0.01 + 0.002
        self._mutex = threading.Lock()
        self.state = _HELD
        self.pid = current_pid()
        self.deadline = sent + ttl - self._drift
        self.next_refresh = sent + refresh_every
        self.lost_reason: str | None = None
        # When an extend last shortened the ttl: a renewal sent before it says nothing.
        self._shortened_at = 0.0

    @property
    def lost(self) -> bool:
        """Lost by the heartbeat, or its local deadline passed unrenewed."""
        if self.state == _LOST:
            return True
        return self.state == _HELD and self.pid == current_pid() and self.past_deadline()

    def past_deadline(self) -> bool:
        """Whether the local deadline passed."""
        return time.monotonic() >= self.deadline

    def extended(self, sent: float, ttl: float, replaced: bool) -> None:
        """An extend or reacquire sent at ``sent`` set (or added) ``ttl`` seconds."""
        with self._mutex:
            if self.state != _HELD or time.monotonic() >= self.deadline:
                return
            if not replaced:
                return  # time added: the lock lasts at least as long as before
            if ttl >= self.ttl:
                # As a renewal: the key ends no earlier than sent + ttl.
                self.deadline = max(self.deadline, sent + min(ttl, self.ttl) - self._drift)
                return
            # Shortened: trust it only that long, and renew soon (back to the timeout).
            self.deadline = min(self.deadline, sent + ttl - self._drift)
            self.next_refresh = min(self.next_refresh, sent + ttl / 3)
            self._shortened_at = sent

    def give_back(self) -> str:
        """Stop renewing; the state it was in. A lost hold stays lost (``Lock.lost``)."""
        with self._mutex:
            before = self.state
            if before == _HELD and self.past_deadline():
                before = _LOST
                self.lost_reason = _DEADLINE_PASSED
            self.state = _LOST if before == _LOST else _RELEASED
        _heartbeat().discard(self)
        return before

    # -- fenced._heartbeat.Renewable ---------------------------------------------------

    def renewal(self) -> Renewal | None:
        """The lease to renew now, or None when this process does not hold it."""
        with self._mutex:
            if self.state != _HELD or self.pid != current_pid():
                return None
            return Renewal(
                self._client,
                self._key,
                self.token,
                self._ttl_ms,
                self.refresh_every,
                self.next_refresh,
                self.deadline,
            )

    def renewed(self, sent: float, token: str) -> None:
        """Redis extended the lock by a request sent at ``sent``."""
        with self._mutex:
            if self.state != _HELD or token != self.token:
                return
            if time.monotonic() < self.deadline:
                if sent >= self._shortened_at:
                    self.deadline = max(self.deadline, sent + self.ttl - self._drift)
                    self.next_refresh = sent + self.refresh_every
                return
        # Confirmed only after the deadline: it may have been seen as lost meanwhile.
        self._declare_lost(_DEADLINE_PASSED, token)

    def renewal_event(self, duration: float, error: BaseException | None = None) -> None:
        """A lock sends no claim events."""

    def retry_soon(self) -> None:
        """No confirmed answer yet: look again within the interval."""
        with self._mutex:
            if self.state == _HELD:
                self.next_refresh = time.monotonic() + self.refresh_every * RETRY_SHARE

    def renewal_refused(self, token: str) -> None:
        """The lock is gone or held under another token."""
        self._declare_lost(_TAKEN, token)

    def expired(self, token: str) -> None:
        """The local deadline passed with no renewal confirmed."""
        self._declare_lost(_DEADLINE_PASSED, token)

    def _declare_lost(self, reason: str, token: str) -> None:
        with self._mutex:
            if self.state != _HELD or token != self.token:
                return
            self.state = _LOST
            self.lost_reason = reason
        fields = claim_fields(self.name, self.fence, outcome="lost", event="lost")
        log.warning(
            "fenced: lock %r (fence %s) lost: %s", self.name, self.fence, reason, extra=fields
        )
        lock = self._lock()
        if lock is not None and lock.on_lost is not None:
            try:
                lock.on_lost(lock)
            except Exception:
                log.exception(
                    "fenced: on_lost callback for lock %r failed", self.name, extra=fields
                )


def check_renewable_token(encoder: Any, token: str | bytes, name: str) -> None:
    """Refuse a caller's token that auto_renew could not send back as the same bytes."""
    raw = encoder.encode(token)
    try:
        same = encoder.encode(raw.decode()) == raw
    except UnicodeDecodeError:
        same = False
    if not same:
        raise ConfigError(
            f"token {token!r} is not text the client encodes back to the same bytes; "
            "auto_renew needs one (or leave token=None)",
            name=name,
        )


def check_lock_options(
    redis: Any,
    name: Any,
    timeout: float | None,
    auto_renew: bool,
    refresh_every: float | None,
    idle_ttl: float | None,
    namespace: str,
) -> tuple[float, float, int]:
    """A lock's (ttl, refresh interval, fence idle expiry in ms), or ConfigError.

    The checks of ``fenced.Lock`` and ``fenced.aio.Lock`` alike.
    """
    if not isinstance(name, str):
        raise ConfigError(f"lock name {name!r} must be a str, e.g. 'report:daily'")
    try:
        check_namespace(namespace)
        if auto_renew:
            if not timeout:
                raise ConfigError(
                    "auto_renew=True needs a timeout: a lock without one never expires, "
                    "so there is nothing to renew; pass e.g. timeout=30"
                )
            ttl, every = check_timing(timeout, refresh_every, names=("timeout", "refresh_every"))
        elif refresh_every is not None:
            raise ConfigError(
                "refresh_every is only used with auto_renew=True: pass both, or neither"
            )
        else:
            ttl, every = 0.0, 0.0
        # The fence may expire while the lock is held: the TIME floor keeps it
        # increasing, so no ttl bounds the idle expiry from below.
        idle_ms = check_idle_ttl(idle_ttl, 0.0)
    except ConfigError as exc:
        raise ConfigError(exc.message, name=name) from None
    if _on_cluster(redis) and not shares_slot(name):
        raise ConfigError(
            f"lock name {name!r} has no hash tag and contains '}}' (or is empty): on "
            "Redis Cluster no fence key can share its slot; give it a hash tag, e.g. "
            f"'{{{name.replace('{', '').replace('}', '') or 'lock'}}}'",
            name=name,
        )
    return ttl, every, idle_ms


class Lock(redis.lock.Lock):
    """redis-py's Lock with a fencing token (``fence``) and optional background renewal.

    ::

        lock = r.lock("report", timeout=60, lock_class=fenced.Lock)
        with lock:                              # LockError if it cannot be acquired
            publish(result, fence=lock.fence)   # a store that compares fences

        with fenced.Lock(r, "report", timeout=10, auto_renew=True) as lock:
            for step in plan:
                if lock.lost:                   # renewal found it gone, or came too late
                    break
                step.run(fence=lock.fence)

    ``redis`` is a redis-py client or, as for a Claim, a URL (``"redis://host:6379/0"``,
    one shared client per URL). The positional parameters and their defaults are
    redis-py's, including its unsafe default ``timeout=None`` (the lock never expires:
    a holder that dies keeps it forever). Prefer a ``timeout`` with ``auto_renew=True``:
    the lock then outlives no dead holder by more than ``timeout``, and lives as long as
    the work.

    Parameters beyond redis-py's (keyword-only):
        auto_renew: renew in the background every ``refresh_every`` while held (needs a
            ``timeout``); a lost lock shows as ``lost``, ``owned()`` is then False.
        refresh_every: seconds between renewals (default timeout/3, at most timeout/2).
        on_lost: called once with the lock, from the heartbeat thread, when a renewed
            hold is lost (with ``thread_local=True`` that thread sees no ``fence``).
        idle_ttl: seconds the fence key is kept after the last acquire (default a week;
            None: forever). The fence still increases after its key expired.
        namespace: prefix of the fence key (the lock itself is the key ``name``).
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
        # A URL too, as a Claim takes one: redis-py's Lock then gets the client built.
        redis = connect(redis, what="the lock")
        self._ttl, self._refresh_every, self._idle_ms = check_lock_options(
            redis, name, timeout, auto_renew, refresh_every, idle_ttl, namespace
        )
        self.fence_key = fence_key(name, namespace)
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.namespace = namespace
        super().__init__(
            redis,
            name,
            timeout=timeout,
            sleep=sleep,
            blocking=blocking,
            blocking_timeout=blocking_timeout,
            thread_local=thread_local,
            raise_on_release_error=raise_on_release_error,
        )
        self.local.fence = None
        self.local.hold = None
        self.local.generated = False

    def __enter__(self) -> Lock:
        if self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified", lock_name=self.name)

    def __repr__(self) -> str:
        return f"<fenced.Lock {self.name!r} fence={self.fence}>"

    # -- state ------------------------------------------------------------------------

    @property
    def fence(self) -> int | None:
        """The fencing token of the current hold (None when this thread holds nothing)."""
        fence: int | None = getattr(self.local, "fence", None)
        return fence

    @property
    def lost(self) -> bool:
        """True once a renewed hold was lost (found taken, or not renewed in time), until
        the next acquire; reading it asks nothing of Redis."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        return hold is not None and hold.lost

    @property
    def lost_reason(self) -> str | None:
        """Why the hold was lost (None while it is not)."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        if hold is None or not hold.lost:
            return None
        return hold.lost_reason or _DEADLINE_PASSED

    def owned(self) -> bool:
        """True if this lock holds the key now: redis-py's check, and never once lost."""
        if self.lost:
            return False
        return bool(super().owned())

    # -- acquire ----------------------------------------------------------------------

    def acquire(
        self,
        sleep: float | None = None,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Acquire as redis-py does (same arguments, same waiting); mint the fence with it."""
        generated = token is None
        if token is None:
            # redis-py's kind of token; made here so the acquire script knows it is ours.
            token = new_token()
        elif self.auto_renew:
            check_renewable_token(self.redis.get_encoder(), token, self.name)
        self.local.generated = generated
        # redis-py encodes str and bytes tokens alike (its annotation says str only).
        chosen: Any = token
        return bool(super().acquire(sleep, blocking, blocking_timeout, chosen))

    def do_acquire(self, token: str | bytes) -> bool:
        """One acquire attempt: the lock and its fence in one script."""
        raw = token if isinstance(token, bytes) else self.redis.get_encoder().encode(token)
        ttl_ms = int(self.timeout * 1000) if self.timeout else ""
        sent = time.monotonic()
        try:
            reply = LOCK_ACQUIRE(
                self.redis,
                (self.name, self.fence_key),
                (raw, ttl_ms, self._idle_ms, 1 if getattr(self.local, "generated", False) else 0),
            )
            if reply is None:  # a fence Lua could not read as a number: no fence to give
                raise redis.ResponseError("the fence is not a number")
        except redis.ResponseError as exc:
            # The script stops at a fence that is not an integer after it set the lock.
            with contextlib.suppress(Exception):
                LOCK_RELEASE(self.redis, (self.name,), (raw,))
            value = None
            with contextlib.suppress(Exception):
                value = self.redis.get(self.fence_key)
            error = corrupt_fence(self.name, self.fence_key, value, exc)
            if error is exc:
                raise
            raise error from exc
        fence = int(reply)
        if not fence:
            return False
        hold = None
        if self.auto_renew:
            hold = _Hold(self, raw, fence, sent, self._ttl, self._refresh_every)
            if hold.past_deadline():
                # Granted after the lock's own deadline (a stalled server, a client
                # retrying through an outage): another holder may take it any moment.
                LOCK_RELEASE(self.redis, (self.name,), (raw,))
                log.warning("fenced: lock %r granted after its deadline; given back", self.name)
                return False
        self.local.fence = fence
        self.local.hold = hold
        if hold is not None:
            _heartbeat().add(hold)
        return True

    # -- release ----------------------------------------------------------------------

    def do_release(self, expected_token: str | bytes) -> None:
        """Compare-and-delete; LockNotOwnedError when the token no longer held it, or the
        hold was lost before (the work under it was not protected)."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        before = hold.give_back() if hold is not None else _HELD
        self.local.fence = None
        released = LOCK_RELEASE(self.redis, (self.name,), (expected_token,))
        if before == _LOST:
            reason = hold.lost_reason if hold is not None else None
            raise LockNotOwnedError(
                f"Cannot release a lock that was lost while held ({reason})",
                lock_name=self.name,
            )
        if not released:
            raise LockNotOwnedError(
                "Cannot release a lock that's no longer owned", lock_name=self.name
            )

    # -- extend / reacquire -----------------------------------------------------------

    def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        """redis-py's extend; a renewed hold's deadline moves with it."""
        sent = time.monotonic()
        self._refuse_if_lost("extend")
        super().do_extend(additional_time, replace_ttl)
        hold: _Hold | None = getattr(self.local, "hold", None)
        if hold is not None:
            hold.extended(sent, float(additional_time), replace_ttl)
        return True

    def do_reacquire(self) -> Literal[True]:
        """redis-py's reacquire; a renewed hold's deadline moves with it."""
        sent = time.monotonic()
        self._refuse_if_lost("reacquire")
        super().do_reacquire()
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


def _on_cluster(redis: Any) -> bool:
    """A Redis Cluster client, thread or asyncio (their keys must share a slot)."""
    from redis.asyncio.cluster import RedisCluster as AsyncCluster
    from redis.cluster import RedisCluster

    return isinstance(redis, (RedisCluster, AsyncCluster))

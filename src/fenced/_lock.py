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
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any, Literal

import redis
import redis.lock
from redis.exceptions import LockError, LockNotOwnedError

from ._audit import claim_fields
from ._client import connect, is_cluster
from ._errors import ConfigError
from ._heartbeat import Heartbeat, Renewal
from ._heartbeat import heartbeat as _heartbeat
from ._held import HELD, LeaseState, Snapshot
from ._lease import (
    IDLE_TTL,
    check_idle_ttl,
    check_namespace,
    check_timing,
    corrupt_key_error,
    fence_or_none,
    not_a_fence,
)
from ._scripts import LOCK_ACQUIRE, LOCK_RELEASE, Call

__all__ = ["Lock", "fence_key", "hash_tag", "shares_slot"]

log = logging.getLogger("fenced")


def new_token() -> bytes:
    """A token of the shape redis-py's Lock makes (the 32 hex bytes of a UUID), always from
    ``uuid4``: older redis-py releases use ``uuid1``, through libuuid, about 10 µs a token."""
    return uuid.uuid4().hex.encode()


def hash_tag(name: str) -> str | None:
    """The Redis Cluster hash tag of a key (the rule of the Cluster spec), or None."""
    start = name.find("{")
    if start < 0:
        return None
    end = name.find("}", start + 1)
    if end <= start + 1:
        return None  # no closing brace, or "{}": the whole key is hashed
    return name[start + 1 : end]


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


class _Hold(LeaseState):
    """One acquire of a Lock while it is renewed: what the heartbeat talks to.

    A Lock keeps its token per thread (``thread_local``), so what is held is the
    acquire, not the Lock object: each acquire gets its own hold, kept in the same
    storage as the token. The heartbeat references holds weakly: a Lock that nobody
    references any more stops being renewed and expires by its timeout.
    """

    expired_reason = "no renewal was confirmed before the local deadline"
    taken_reason = "the lock is gone or held under another token"

    def __init__(self, lock: LockCore, token: bytes, fence: int, sent: float) -> None:
        super().__init__(lock._ttl, lock._refresh_every)
        self.name: str = lock.name
        self._lock = weakref.ref(lock)
        self._client = lock.redis
        # The heartbeat's REFRESH sends the token as text; the client's encoder turns it
        # back into exactly these bytes (checked in LockCore._token).
        self._hold(token.decode(), fence, sent)

    def extended(self, sent: float, ttl: float, replaced: bool) -> None:
        """An extend or reacquire sent at ``sent`` set (``replaced``) or added ``ttl`` s."""
        with self._mutex:
            if not replaced or self._state != HELD or self._clock() >= self._deadline:
                return  # time added: the lock lasts at least as long as before
            if ttl >= self.ttl:
                # As a renewal: the key ends no earlier than sent + ttl.
                self._deadline = max(self._deadline, self._deadline_from(sent))
                return
            # Shortened: trust it only that long, and renew soon (back to the timeout).
            self._deadline = min(self._deadline, self._deadline_from(sent, ttl))
            self._next_refresh = min(self._next_refresh, sent + ttl / 3)
            self._shortened_at = sent

    def give_back(self) -> None:
        """Stop holding (lost first, if its deadline passed); a lost hold stays lost."""
        self._expire_if_due()
        self._end_hold(stay_lost=True)

    def renewal(self) -> Renewal | None:
        """The lease to renew now, or None when this process does not hold it."""
        with self._mutex:
            if not self._mine() or self.token is None:
                return None
            return Renewal(
                self._client,
                self.name,
                self.token,
                self._ttl_ms,
                self.refresh_every,
                self._next_refresh,
                self._deadline,
            )

    def renewal_event(self, duration: float, error: BaseException | None = None) -> None:
        """A lock sends no claim events."""

    def _report_lost(self, reason: str, lease: Snapshot) -> None:
        fields = claim_fields(self.name, lease.fence, outcome="lost", event="lost")
        log.warning(
            "fenced: lock %r (fence %s) lost: %s", self.name, lease.fence, reason, extra=fields
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
    name: Any,
    timeout: float | None,
    auto_renew: bool,
    refresh_every: float | None,
    idle_ttl: float | None,
    namespace: str,
) -> tuple[float, float, int]:
    """A lock's (ttl, refresh interval, fence idle expiry in ms), or ConfigError."""
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
    return ttl, every, idle_ms


def check_slot(redis: Any, name: str) -> None:
    """On a Redis Cluster client (thread or asyncio), refuse a name whose fence key
    cannot share its slot."""
    if is_cluster(redis) and not shares_slot(name):
        raise ConfigError(
            f"lock name {name!r} has no hash tag and contains '}}' (or is empty): on "
            "Redis Cluster no fence key can share its slot; give it a hash tag, e.g. "
            f"'{{{name.replace('{', '').replace('}', '') or 'lock'}}}'",
            name=name,
        )


class LockCore:
    """What ``fenced.Lock`` and ``fenced.aio.Lock`` add to redis-py's two Locks, whose
    subclasses they are (this class comes first in their bases): the options, the
    fence, the renewed hold and what a release found. Each front end sends the scripts
    and hands the answers to the methods here.
    """

    # Set by redis-py's Lock (``name`` is a str: checked first).
    redis: Any
    name: Any
    timeout: float | None
    local: Any
    _KIND = "fenced.Lock"

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
        on_lost: Callable[[Any], object] | None = None,
        idle_ttl: float | None = IDLE_TTL,
        namespace: str = "fenced",
    ) -> None:
        self._ttl, self._refresh_every, self._idle_ms = check_lock_options(
            name, timeout, auto_renew, refresh_every, idle_ttl, namespace
        )
        redis = self._connect(redis)
        check_slot(redis, name)
        self.fence_key = fence_key(name, namespace)
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.namespace = namespace
        super().__init__(  # type: ignore[call-arg]  # redis-py's Lock, next in the MRO
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

    def _connect(self, redis: Any) -> Any:
        """The client this front end talks through."""
        raise NotImplementedError

    def _renewer(self) -> Any:
        """What renews a hold: the process's heartbeat, or the event loop's renewer."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self._KIND} {self.name!r} fence={self.fence}>"

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
        return hold.lost_reason if hold is not None and hold.lost else None

    # -- what the front ends send, and what came back ----------------------------------

    def _encoder(self) -> Any:
        try:
            return self.redis.connection_pool.get_encoder()
        except AttributeError:  # Cluster
            return self.redis.get_encoder()

    def _token(self, token: str | bytes | None) -> str | bytes:
        """The token of one acquire: made here, redis-py's kind, unless the caller chose one
        (then the acquire script treats it as redis-py does)."""
        self.local.generated = token is None
        if token is None:
            return new_token()
        if self.auto_renew:
            check_renewable_token(self._encoder(), token, self.name)
        return token

    def _acquire_call(self, token: str | bytes) -> tuple[bytes, Call]:
        """The token as bytes, and the call of one acquire attempt under it."""
        raw = token if isinstance(token, bytes) else self._encoder().encode(token)
        ttl_ms = int(self.timeout * 1000) if self.timeout else ""
        generated = 1 if getattr(self.local, "generated", False) else 0
        return raw, (
            LOCK_ACQUIRE,
            (self.name, self.fence_key),
            (raw, ttl_ms, self._idle_ms, generated),
        )

    def _took(self, raw: bytes, reply: Any, sent: float) -> bool | None:
        """Take in the answer of an acquire sent at ``sent``: True when the lock is ours,
        False when another holder has it, None when it must be given back."""
        fence = int(reply)
        if not fence:
            return False
        hold = _Hold(self, raw, fence, sent) if self.auto_renew else None
        if hold is not None and not hold.held:
            # Granted after the lock's own deadline (a stalled server, a client
            # retrying through an outage): another holder may take it any moment.
            log.warning("fenced: lock %r granted after its deadline; giving it back", self.name)
            return None
        self.local.fence = fence
        self.local.hold = hold
        if hold is not None:
            self._renewer().add(hold)
        return True

    def _corrupt(self, exc: BaseException, value: Any) -> BaseException:
        """The error of an acquire Redis answered with an error (``value``: the fence key's):
        CorruptKey when the fence key holds what is not a fence, else ``exc``."""
        if value is None or fence_or_none(value) is not None:
            return exc
        why = not_a_fence(value)
        return corrupt_key_error(
            self.name, self.fence_key, why, exc, doing="acquire lock", is_fence=True
        )

    def _let_go(self) -> _Hold | None:
        """A release is about to be sent: no fence, no renewal; the hold it ends."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        self.local.fence = None
        if hold is not None:
            hold.give_back()
            self._renewer().discard(hold)
        return hold

    def _released(self, hold: _Hold | None, released: Any) -> None:
        """LockNotOwnedError when the token no longer held the lock, or the hold was lost
        before (the work under it was not protected)."""
        self._refuse_if_lost("release", hold)
        if not released:
            raise LockNotOwnedError(
                "Cannot release a lock that's no longer owned", lock_name=self.name
            )

    def _refuse_if_lost(self, what: str, hold: _Hold | None = None) -> None:
        hold = hold or getattr(self.local, "hold", None)
        if hold is not None and hold.lost:
            raise LockNotOwnedError(
                f"Cannot {what} a lock that was lost while held ({hold.lost_reason})",
                lock_name=self.name,
            )

    def _extended(self, sent: float, ttl: float, replaced: bool) -> None:
        """An extend or reacquire sent at ``sent`` succeeded: a renewed hold's deadline moves."""
        hold: _Hold | None = getattr(self.local, "hold", None)
        if hold is not None:
            hold.extended(sent, ttl, replaced)


class Lock(LockCore, redis.lock.Lock):
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
        on_lost: called once with the lock when a renewed hold is lost: from the
            heartbeat thread, or from ``release()`` when the deadline passed first (with
            ``thread_local=True`` the heartbeat's thread sees no ``fence``).
        idle_ttl: seconds the fence key is kept after the last acquire (default a week;
            None: forever). The fence still increases after its key expired.
        namespace: prefix of the fence key (the lock itself is the key ``name``).
    """

    def _connect(self, redis: Any) -> Any:
        # A URL too, as a Claim takes one: redis-py's Lock then gets the client built.
        return connect(redis, what="the lock")

    def _renewer(self) -> Heartbeat:
        return _heartbeat()

    def __enter__(self) -> Lock:
        if self.acquire():
            return self
        raise LockError("Unable to acquire lock within the time specified", lock_name=self.name)

    def owned(self) -> bool:
        """True if this lock holds the key now: redis-py's check, and never once lost."""
        return not self.lost and bool(super().owned())

    def acquire(
        self,
        sleep: float | None = None,
        blocking: bool | None = None,
        blocking_timeout: float | None = None,
        token: str | bytes | None = None,
    ) -> bool:
        """Acquire as redis-py does (same arguments, same waiting); mint the fence with it."""
        # redis-py encodes str and bytes tokens alike (its annotation says str only).
        chosen: Any = self._token(token)
        return bool(super().acquire(sleep, blocking, blocking_timeout, chosen))

    def do_acquire(self, token: str | bytes) -> bool:
        """One acquire attempt: the lock and its fence in one script."""
        raw, (script, keys, args) = self._acquire_call(token)
        sent = time.monotonic()
        try:
            reply = script(self.redis, keys, args)
            if reply is None:  # a fence Lua could not read as a number: no fence to give
                raise redis.ResponseError("the fence is not a number")
        except redis.ResponseError as exc:
            # The script stops at a fence that is not an integer after it set the lock.
            with contextlib.suppress(Exception):
                LOCK_RELEASE(self.redis, (self.name,), (raw,))
            value = None
            with contextlib.suppress(Exception):
                value = self.redis.get(self.fence_key)
            error = self._corrupt(exc, value)
            if error is exc:
                raise
            raise error from exc
        took = self._took(raw, reply, sent)
        if took is None:
            LOCK_RELEASE(self.redis, (self.name,), (raw,))
        return bool(took)

    def do_release(self, expected_token: str | bytes) -> None:
        """Compare-and-delete; LockNotOwnedError when the token no longer held it, or the
        hold was lost before."""
        hold = self._let_go()
        self._released(hold, LOCK_RELEASE(self.redis, (self.name,), (expected_token,)))

    def do_extend(self, additional_time: float, replace_ttl: bool) -> Literal[True]:
        """redis-py's extend; a renewed hold's deadline moves with it."""
        sent = time.monotonic()
        self._refuse_if_lost("extend")
        super().do_extend(additional_time, replace_ttl)
        self._extended(sent, float(additional_time), replace_ttl)
        return True

    def do_reacquire(self) -> Literal[True]:
        """redis-py's reacquire; a renewed hold's deadline moves with it."""
        sent = time.monotonic()
        self._refuse_if_lost("reacquire")
        super().do_reacquire()
        self._extended(sent, self._ttl, True)
        return True

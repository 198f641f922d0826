"""Claim: an exclusive, self-renewing, fenced lease on a named resource in Redis.

A timeline of the race the claim exists for, and what each part does about it::

    t0      worker A acquires "rebuild:incidents"        fence 1001, lease 30 s
    t0+10   heartbeat renews A's lease (one pipelined EVALSHA for every claim of A)
    t0+12   A is paused (swap, a throttled container) ... no renewals
    t0+30   A's local deadline passes: A's claim is *lost* (A cannot know yet)
    t0+30   the lease expires in Redis; worker B acquires  fence 1002
    t0+41   A resumes: check() raises ClaimLost before A's next step; if A was mid-step
            and publishes anyway, the pointer has accepted 1002 and rejects 1001;
            A's release compares tokens and leaves B's lease alone.

Acquire is one atomic script (``SET NX PX`` plus minting the fence): never
check-then-set. Release and refresh compare the owner token first. Deadlines are on
``time.monotonic()``, measured from when a request was *sent*, minus a drift margin.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, TypeVar

import redis

from ._errors import ClaimLost, ClaimUnavailable, ConfigError, FencedError, NotOwner
from ._heartbeat import heartbeat as _heartbeat
from ._keys import ClaimKeys
from ._scripts import ACQUIRE, FORCE_RELEASE, REFRESH, RELEASE, as_text

__all__ = ["Claim", "Holder", "describe_client", "force_release", "new_token", "read_holder"]

log = logging.getLogger("fenced")
T = TypeVar("T")

_IDLE, _HELD, _LOST, _RELEASED = "idle", "held", "lost", "released"
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
#: How often a blocking acquire looks again while the holder's lease runs.
RETRY_INTERVAL = 0.05
#: Run records kept per claim (the stream is trimmed approximately).
MAX_RECORDS = 1000
_HOST = socket.gethostname().replace(":", "_") or "localhost"
_SKIP = "already running"
_SKIP_RERUN = "already running; rerun requested"
# This process's pid, kept current across fork: os.getpid() is a system call, and the
# acquire/release path asked for it several times per cycle.
_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)

# One encoder for every record: json.dumps with options builds a new encoder per call.
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode
_HOST_JSON = _encode(_HOST)
# The fields every run record starts with; record_extra may not shadow them on the
# pre-encoded path (a mapping that does goes through the general one).
_BASE_FIELDS = frozenset(("task_id", "host", "pid", "at"))


def new_token(task_id: str | None = None) -> str:
    """A fresh owner token: 128 random bits, then host, pid and task id for humans."""
    return f"{secrets.token_hex(16)}:{_HOST}:{_pid}:{task_id or ''}"


@dataclass(frozen=True)
class Holder:
    """Who holds a claim: parsed from its token, with its fence and time left."""

    token: str
    host: str
    pid: int | None
    task_id: str | None
    fence: int | None
    expires_in: float | None

    @classmethod
    def parse(cls, token: str, pttl_ms: int | None = None, fence: int | None = None) -> Holder:
        """Parse a token written by :func:`new_token` (foreign values parse as opaque)."""
        parts = token.split(":", 3)
        if len(parts) == 4:
            _rand, host, pid, task_id = parts
            pid_int = int(pid) if pid.isdigit() else None
        else:
            host, pid_int, task_id = "?", None, ""
        expires = None if pttl_ms is None or pttl_ms < 0 else pttl_ms / 1000.0
        return cls(token, host, pid_int, task_id or None, fence, expires)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, without the secret part of the token."""
        data = asdict(self)
        data["token"] = self.token.split(":", 1)[0][:8] + "…"
        return data

    def __str__(self) -> str:
        who = f"{self.host} pid {self.pid}"
        if self.task_id:
            who += f" task {self.task_id}"
        if self.expires_in is not None:
            who += f", {self.expires_in:.1f}s left"
        return who


def describe_client(client: Any) -> str:
    """Human address of a Redis client (for error messages)."""
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {}) or {}
    if "path" in kw:
        where = f"unix://{kw['path']}"
    else:
        where = f"redis://{kw.get('host', '?')}:{kw.get('port', 6379)}"
    return f"{where}/{kw.get('db', 0)}"


def read_holder(client: Any, name: str, namespace: str = "fenced") -> Holder | None:
    """The current holder of a claim, or None when nobody holds it (one round trip)."""
    keys = ClaimKeys.of(name, namespace)
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.lock)
    pipe.pttl(keys.lock)
    pipe.get(keys.fence)
    token, pttl, fence = pipe.execute()
    if token is None:
        return None
    return Holder.parse(as_text(token), int(pttl), int(fence) if fence is not None else None)


def force_release(
    client: Any,
    name: str,
    namespace: str = "fenced",
    *,
    task_id: str | None = None,
    pid: int | None = None,
    host: str | None = None,
    outcome: str | None = None,
    reason: str | None = None,
    max_records: int = MAX_RECORDS,
    **data: Any,
) -> Holder | None:
    """Clear a claim whatever its token; with ``task_id``/``pid``, only such a holder's.

    For a supervisor that knows the holder is gone (a killed process) or an operator.
    ``pid`` matches a holder process on ``host`` (default: this host).
    ``outcome`` (e.g. ``"aborted"``) ends the holder's run record; without it the record
    says ``released``. Returns the holder that was cleared, or None (one round trip).
    """
    keys = ClaimKeys.of(name, namespace)
    payload = {"host": _HOST, "pid": _pid, "at": time.time(), "reason": reason}
    payload.update(data)
    token = FORCE_RELEASE(
        client,
        [keys.lock, keys.runs],
        [
            "",
            json.dumps(payload, separators=(",", ":"), default=str),
            max_records,
            task_id or "",
            outcome or "",
            f"{(host or _HOST).replace(':', '_')}:{pid}" if pid is not None else "",
        ],
    )
    text = as_text(token) if token else ""
    return Holder.parse(text) if text else None


class Claim:
    """An exclusive, self-renewing lease on one named resource, with a fencing token."""

    def __init__(
        self,
        redis: Any,
        name: str,
        ttl: float = 30.0,
        refresh_every: float | None = None,
        namespace: str = "fenced",
        heartbeat: bool = True,
        on_lost: Callable[[Claim], object] | None = None,
        *,
        task_id: str | None = None,
        records: bool = False,
        record_extra: Mapping[str, Any] | None = None,
        max_records: int = MAX_RECORDS,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
            raise ConfigError(
                f"ttl={ttl!r} is not a positive number of seconds: choose one well above a "
                "refresh interval and round-trip time, e.g. ttl=30",
                name=name,
            )
        if refresh_every is None:
            refresh_every = ttl / 3
        if not isinstance(refresh_every, (int, float)) or not 0 < refresh_every < ttl:
            raise ConfigError(
                f"refresh_every={refresh_every!r} must be above 0 and below ttl={ttl}: a lease "
                "renewed no sooner than it expires is lost between renewals; leave it None "
                "for ttl/3",
                name=name,
            )
        if redis is None:
            raise ConfigError("no Redis client given: pass redis.Redis.from_url(...)", name=name)
        self.redis = redis
        self.keys = ClaimKeys.of(name, namespace)
        self.name: str = self.keys.name
        # Built once: every acquire and release sends them.
        self._acquire_keys = lock, _fence, runs, skips, rerun = tuple(self.keys.all())
        self._release_keys = (lock, runs, skips, rerun)
        self.key: str = lock
        self.namespace = namespace
        self.ttl = float(ttl)
        self.refresh_every = float(refresh_every)
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        self.task_id = task_id
        self.records = records
        # Written into every run record of this claim (e.g. the command a run executes).
        self.record_extra = dict(record_extra or {})
        self.max_records = max_records
        self._clock = clock
        self._sleep = sleep
        self._ttl_ms = max(1, int(self.ttl * 1000))
        # Clock drift between this host and Redis, and the time a PEXPIRE takes to
        # apply, eat into the lease: give up slightly before it ends.
        self._drift = self.ttl * 0.01 + 0.002
        self._mutex = threading.Lock()
        self._state = _IDLE
        self._pid = _pid
        self._deadline = 0.0
        self._next_refresh = 0.0
        self._started_at = 0.0
        self.token: str | None = None
        self.fence: int | None = None
        self.holder: Holder | None = None
        self.lost_reason: str | None = None
        self.skips = 0
        self.rerun_requested = 0

    # -- state ------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        """True while this process holds the claim and its local deadline has not passed."""
        return self._state == _HELD and self._pid == _pid and self._clock() < self._deadline

    @property
    def lost(self) -> bool:
        """True once the claim was lost; it never comes back."""
        # A forked child holds none of its parent's claims, so it cannot lose one.
        if self._state == _HELD and self._pid == _pid and self._clock() >= self._deadline:
            self._declare_lost("no refresh was confirmed before the local deadline")
        return self._state == _LOST

    @property
    def expires_in(self) -> float:
        """Seconds until the local deadline (0 when not held)."""
        if self._state != _HELD:
            return 0.0
        return max(0.0, self._deadline - self._clock())

    def __bool__(self) -> bool:
        return self.held

    def __repr__(self) -> str:
        return f"<Claim {self.name!r} {self._state} fence={self.fence}>"

    # -- acquire ----------------------------------------------------------------------

    def acquire(
        self, blocking: bool = False, timeout: float | None = None, *, request_rerun: bool = False
    ) -> bool:
        """Take the claim; non-blocking by default. Raises ClaimUnavailable if Redis is down.

        With ``request_rerun``, losing the race asks the holder for one more run after
        its own (see ``Claim.rerun_requested``); many requests during one run coalesce.
        """
        if self._state == _HELD and self._pid == _pid:
            raise FencedError(
                f"claim {self.name!r} is already held by this object: release it first, "
                "or use a second Claim",
                name=self.name,
                token=self.token,
                fence=self.fence,
            )
        if timeout is not None and timeout < 0:
            raise ConfigError(f"timeout={timeout!r} must be >= 0 or None", name=self.name)
        give_up = None if timeout is None else self._clock() + timeout
        record_skip = not blocking
        while True:
            if self._try_acquire(record_skip, mark_rerun=request_rerun):
                return True
            if not blocking:
                return False
            now = self._clock()
            if give_up is not None and now >= give_up:
                return False
            left = self.holder.expires_in if self.holder and self.holder.expires_in else 0.0
            wait = min(RETRY_INTERVAL, left) if left > 0 else RETRY_INTERVAL
            wait *= random.uniform(0.5, 1.0)  # spread contenders so they do not stampede
            if give_up is not None:
                wait = min(wait, give_up - now)
            self._sleep(max(wait, 0.001))

    def _record(self) -> str:
        if not self.records:
            return ""
        extra = self.record_extra
        if extra and not _BASE_FIELDS.isdisjoint(extra):
            data = {"task_id": self.task_id, "host": _HOST, "pid": _pid, "at": time.time()}
            data.update(extra)
            return _encode(data)
        # The same JSON object, built without a dict per run: this is on every acquire.
        head = (
            f'{{"task_id":{_encode(self.task_id)},"host":{_HOST_JSON},'
            f'"pid":{_pid},"at":{time.time()!r}'
        )
        return f"{head},{_encode(extra)[1:]}" if extra else head + "}"

    def _try_acquire(self, record_skip: bool, mark_rerun: bool = False) -> bool:
        token = new_token(self.task_id)
        sent = self._clock()
        try:
            res = ACQUIRE(
                self.redis,
                self._acquire_keys,
                [
                    token,
                    self._ttl_ms,
                    # One record serves as the "started" or the "skipped" entry.
                    self._record(),
                    (_SKIP_RERUN if mark_rerun else _SKIP) if record_skip else "",
                    self.max_records,
                    "1" if mark_rerun else "0",
                    # A lease held under our own task id is an earlier attempt of this
                    # task (a redelivery), not a competitor: no skip, no rerun request.
                    self.task_id or "",
                ],
            )
        except _UNREACHABLE as exc:
            if isinstance(exc, redis.TimeoutError):
                # Only a request that was sent can have landed; a refused connection
                # sent nothing, and cleaning up after it would only wait out the
                # client's retries a second time.
                self._abandon(token)
            raise ClaimUnavailable(
                f"cannot reach Redis at {describe_client(self.redis)} to acquire claim "
                f"{self.name!r} ({exc}); the work was not started (fail closed)",
                name=self.name,
            ) from exc
        except redis.ResponseError as exc:
            # A replica after a failover (READONLY), a full server (OOM), a busy script:
            # the store cannot grant the claim, which is unavailability, not a bug here.
            raise ClaimUnavailable(
                f"Redis at {describe_client(self.redis)} refused to grant claim "
                f"{self.name!r} ({exc}); the work was not started (fail closed). "
                "Check that the URL names the master and that it has memory to spare "
                "(fenced doctor)",
                name=self.name,
            ) from exc
        if int(res[0]) == 1:
            with self._mutex:
                self.token = token
                self.fence = int(res[1])
                self.holder = None
                self.lost_reason = None
                self._pid = _pid
                self._state = _HELD
                self._started_at = sent
                self._deadline = sent + self.ttl - self._drift
                self._next_refresh = sent + self.refresh_every
            if self.heartbeat:
                _heartbeat().add(self)
            return True
        holder_token = as_text(res[1])
        self.holder = Holder.parse(holder_token, int(res[2]), int(res[3]))
        self.skips = int(res[4])
        self.rerun_requested = int(res[5])
        return False

    def _abandon(self, token: str) -> None:
        """A request that timed out may still have landed: drop that lease if we can."""
        try:
            RELEASE(
                self.redis,
                self._release_keys,
                [token, "", self.max_records, "", 0, "0"],
            )
        except Exception:  # best effort; the lease expires within its ttl anyway
            pass

    # -- refresh / check --------------------------------------------------------------

    def refresh(self) -> bool:
        """Extend the lease now; False (and the claim is lost) if another token holds it."""
        if self._state != _HELD or self._pid != _pid:
            return False
        sent = self._clock()
        try:
            ok = REFRESH(self.redis, [self.key], [self.token, self._ttl_ms])
        except _UNREACHABLE as exc:
            self._refresh_failed(sent)
            raise ClaimUnavailable(
                f"cannot reach Redis at {describe_client(self.redis)} to refresh claim "
                f"{self.name!r} ({exc})",
                name=self.name,
                token=self.token,
                fence=self.fence,
            ) from exc
        if int(ok) == 1:
            self._refresh_confirmed(sent)
            return self.held
        self._declare_lost("the lease is gone or held under another token")
        return False

    def check(self) -> None:
        """Raise ClaimLost once the claim is lost; NotOwner if it is not held at all."""
        if self._state == _HELD and self._pid == _pid:
            if self._clock() < self._deadline:
                return
            self._declare_lost("no refresh was confirmed before the local deadline")
        if self._state == _LOST:
            raise ClaimLost(
                f"claim {self.name!r} was lost ({self.lost_reason}); stop writing: another "
                "holder may be working on the same resource",
                name=self.name,
                token=self.token,
                fence=self.fence,
            )
        raise NotOwner(
            f"claim {self.name!r} is not held here ({self._state}"
            + (", inherited across fork" if self._pid != _pid else "")
            + "): acquire it first",
            name=self.name,
            token=self.token,
            fence=self.fence,
        )

    def steps(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield each item after checking the claim; check once more after the last."""
        for item in iterable:
            self.check()
            yield item
        self.check()

    # Called by the heartbeat thread (and refresh) ------------------------------------

    def _refresh_confirmed(self, sent: float, token: str | None = None) -> None:
        with self._mutex:
            if self._state != _HELD or (token is not None and token != self.token):
                return
            token = self.token
            if self._clock() < self._deadline:
                # The server applied PEXPIRE no earlier than we sent it, so the lease
                # runs at least until sent + ttl.
                self._deadline = max(self._deadline, sent + self.ttl - self._drift)
                self._next_refresh = sent + self.refresh_every
                return
        # Confirmed only after the local deadline: the claim was lost at the deadline
        # (it may have been seen as not held meanwhile) and does not come back.
        self._declare_lost("no refresh was confirmed before the local deadline", token)

    def _refresh_failed(self, sent: float) -> None:
        with self._mutex:
            if self._state == _HELD:
                self._next_refresh = self._clock() + self.refresh_every * 0.35

    def _declare_lost(self, reason: str, token: str | None = None) -> None:
        with self._mutex:
            if self._state != _HELD or (token is not None and token != self.token):
                return
            self._state = _LOST
            self.lost_reason = reason
        if self.heartbeat:
            _heartbeat().discard(self)
        log.warning("fenced: claim %r (fence %s) lost: %s", self.name, self.fence, reason)
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                log.exception("fenced: on_lost callback for %r failed", self.name)

    # -- release ----------------------------------------------------------------------

    def release(self, outcome: str | None = None, reason: str | None = None) -> bool:
        """Give the claim back; True only if our token still held it (then it is deleted)."""
        if self._pid != _pid or self.token is None or self._state in (_IDLE, _RELEASED):
            # A forked child never releases its parent's lease: the token is the parent's.
            return False
        if self.heartbeat:
            _heartbeat().discard(self)
        was_lost = self.lost
        if outcome is None:
            outcome = "lost" if was_lost else "ok"
        record = ""
        if self.records:
            # The "started" entry already says who, where and with what; the finished
            # one pairs with it by token and adds only how it ended.
            # Built as text, not from a dict: this is on every release.
            record = (
                f'{{"task_id":{_encode(self.task_id)},"host":{_HOST_JSON},"pid":{_pid},'
                f'"duration":{round(self._clock() - self._started_at, 6)!r}'
            )
            why = reason or self.lost_reason
            record += f',"reason":{_encode(why)}}}' if why else "}"
        with self._mutex:
            # Given back from here on: a renewal already in flight that reaches Redis
            # after the lease is deleted finds it gone, and that is not a loss.
            before, self._state = self._state, _RELEASED
        try:
            res = RELEASE(
                self.redis,
                self._release_keys,
                [self.token, record, self.max_records, outcome, self.fence or 0, "1"],
            )
        except _UNREACHABLE as exc:
            log.warning(
                "fenced: could not release %r at %s (%s); it expires within %.1fs",
                self.name,
                describe_client(self.redis),
                exc,
                self.ttl,
            )
            return False
        except BaseException:
            with self._mutex:
                self._state = before  # not given back: release() may be called again
            raise
        self.rerun_requested = int(res[1])
        return int(res[0]) == 1

    # -- context manager --------------------------------------------------------------

    def __enter__(self) -> Claim:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.token is None or self._state in (_IDLE, _RELEASED):
            return
        was_lost = self.lost
        if was_lost or isinstance(exc, ClaimLost):
            outcome = "lost"
        elif exc is not None:
            outcome = "failed"
        else:
            outcome = "ok"
        self.release(outcome=outcome, reason=repr(exc) if exc else None)
        if was_lost and exc is None:
            # The block finished, but not under the claim: say so instead of pretending.
            raise ClaimLost(
                f"claim {self.name!r} was lost while the block ran ({self.lost_reason}); "
                "its writes were not protected",
                name=self.name,
                token=self.token,
                fence=self.fence,
            )

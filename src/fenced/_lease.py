"""The lease layer: who we are, what a token is, where a name's keys live, and the store.

Everything that talks to Redis about a lease goes through here:

- **process identity** — the host and the pid, the pid kept current across ``fork``;
- **the token** — ``random:host:pid:task id``, defined once (``TOKEN_PATTERN``, read by
  the scripts and by :meth:`Holder.parse`);
- **the keys** — every key of one name (lease, fence, runs, skips, rerun, pointer),
  under one namespace and one Cluster hash tag;
- **the store** — the scripts run through :class:`LeaseStore`, and the one mapping
  from "Redis could not be reached" to :class:`ClaimUnavailable`;
- **timing** — the one check of a ttl and a refresh interval, for every front end.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import redis

from ._client import describe_client, node_client, refresh_slots
from ._errors import ClaimUnavailable, ConfigError
from ._naming import validate_name
from ._scripts import (
    ACQUIRE,
    FORCE_RELEASE,
    REFRESH,
    RELEASE,
    TOKEN_PATTERN,
    Call,
    Script,
    as_text,
    run_pipeline,
)

__all__ = [
    "HOST",
    "IDLE_TTL",
    "MAX_RECORDS",
    "UNREACHABLE",
    "ClaimKeys",
    "Holder",
    "LeaseCalls",
    "LeaseStore",
    "check_timing",
    "current_pid",
    "describe_client",
    "force_release",
    "new_token",
    "reachable",
    "read_holder",
    "released",
    "why_unreachable",
]

#: Errors that mean "the store could not be reached" (the request may not have landed).
#: An answer that is not in the Redis protocol (another service on that port) is one
#: of them: no Redis heard the request.
UNREACHABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
    redis.exceptions.InvalidResponse,
)
#: Run records kept per claim (the stream is trimmed approximately).
MAX_RECORDS = 1000
#: How long the lasting keys of a name nobody uses (fence, run records, skip count,
#: rerun triggers) are kept: a week. Names built from arguments (per user, per feed)
#: would otherwise fill a Redis that must not evict.
IDLE_TTL = 7 * 24 * 3600.0
#: The shortest idle expiry (and never below twice the ttl): long enough that a name in
#: use keeps its skip count and records between runs.
MIN_IDLE_TTL = 1.0

# -- process identity -----------------------------------------------------------------

#: This host, as tokens carry it (a ':' would break the token's format).
HOST = socket.gethostname().replace(":", "_") or "localhost"
# Kept current across fork: os.getpid() is a system call, and the acquire and release
# path asks for it several times per cycle.
_pid = os.getpid()


def current_pid() -> int:
    """This process's pid, current in a forked child too."""
    return _pid


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)

# -- the token --------------------------------------------------------------------------

_TOKEN = re.compile(TOKEN_PATTERN, re.DOTALL)


def new_token(task_id: str | None = None) -> str:
    """A fresh owner token: 128 random bits, then host, pid and task id for humans."""
    return f"{secrets.token_hex(16)}:{HOST}:{_pid}:{task_id or ''}"


def holder_filter(host: str | None, pid: int | None) -> str:
    """The ``host:pid`` part of a token, as FORCE_RELEASE matches it ("" for any)."""
    return f"{(host or HOST).replace(':', '_')}:{pid}" if pid is not None else ""


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
        match = _TOKEN.fullmatch(token)
        if match:
            _rand, host, pid, task_id = match.groups()
            pid_int = int(pid) if pid.isdigit() else None
        else:
            host, pid_int, task_id = "?", None, ""
        expires = None if pttl_ms is None or pttl_ms < 0 else pttl_ms / 1000.0
        return cls(token, host, pid_int, task_id or None, fence, expires)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, without the secret part of the token."""
        data = asdict(self)
        data["token"] = short_token(self.token)
        return data

    def __str__(self) -> str:
        who = f"{self.host} pid {self.pid}"
        if self.task_id:
            who += f" task {self.task_id}"
        if self.expires_in is not None:
            who += f", {self.expires_in:.1f}s left"
        return who


def short_token(token: str) -> str:
    """A token as shown: the start of its random part only, a prefix of the token.

    Printed as it is (no ellipsis), so that ``fenced release --token`` takes it back.
    """
    return token.split(":", 1)[0][:8]


# -- the keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimKeys:
    """The Redis keys of one name, all under one namespace and one hash tag."""

    namespace: str
    name: str

    @classmethod
    def of(cls, name: str, namespace: str = "fenced") -> ClaimKeys:
        """Keys for a name (checked, a fixed point) under a namespace."""
        check_namespace(namespace)
        return cls(namespace, validate_name(name))

    def _key(self, part: str) -> str:
        return f"{self.namespace}:{{{self.name}}}:{part}"

    @property
    def lock(self) -> str:
        """The lease itself: value = owner token, PX = ttl."""
        return self._key("lock")

    @property
    def fence(self) -> str:
        """The fence counter; never decreases."""
        return self._key("fence")

    @property
    def runs(self) -> str:
        """The run-record stream, newest last, capped."""
        return self._key("runs")

    @property
    def skips(self) -> str:
        """Consecutive skips since the last successful run."""
        return self._key("skips")

    @property
    def rerun(self) -> str:
        """Set when a conflicting trigger asked for one more run."""
        return self._key("rerun")

    def released(self, token: str) -> str:
        """A short-lived note of how a token's release went, so a retry gets that answer."""
        return f"{self._key('released:')}{token.split(':', 1)[0]}"

    def lasting(self) -> tuple[str, ...]:
        """The keys that outlive a lease and expire when the name is idle."""
        return (self.fence, self.runs, self.skips, self.rerun)

    def done(self, task_id: str) -> str:
        """Set while a task id's run that ended ``ok`` may still be redelivered."""
        return self._key(f"done:{task_id}")

    @property
    def pointer(self) -> str:
        """A Redis pointer of the same name (same hash tag: one Cluster slot)."""
        return self._key("ptr")

    @property
    def pointer_log(self) -> str:
        """The log of a Redis pointer's accepted publishes."""
        return self._key("ptr:log")

    def all(self) -> list[str]:
        """The keys the ACQUIRE script receives, in KEYS order."""
        return [self.lock, self.fence, self.runs, self.skips, self.rerun]

    @staticmethod
    def name_from_key(key: str | bytes, namespace: str = "fenced") -> str | None:
        """Recover the claim name from any of its keys (used by ``fenced ls``)."""
        text = as_text(key)
        prefix = namespace + ":{"
        if not text.startswith(prefix):
            return None
        end = text.rfind("}:")
        if end < len(prefix):
            return None
        return text[len(prefix) : end]


def check_namespace(namespace: Any) -> str:
    """A namespace is a non-empty prefix without braces (they would break the hash tag)."""
    if not isinstance(namespace, str) or not namespace or "{" in namespace or "}" in namespace:
        raise ConfigError(
            f"namespace {namespace!r} is invalid: use a non-empty prefix without braces, "
            "e.g. 'fenced'"
        )
    return namespace


# -- timing -----------------------------------------------------------------------------


def check_timing(
    ttl: Any,
    refresh_every: Any = None,
    *,
    names: tuple[str, str] = ("ttl", "refresh_every"),
) -> tuple[float, float]:
    """Check a lease's ttl and refresh interval; return them (refresh default: ttl/3).

    ``names`` are the options as the caller's user spells them (``claim_ttl`` in Celery).
    """
    ttl_name, refresh_name = names
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not ttl > 0:
        raise ConfigError(
            f"{ttl_name}={ttl!r} is not a positive number of seconds: choose one well above "
            f"a refresh interval and round-trip time, e.g. {ttl_name}=30"
        )
    if refresh_every is None:
        return float(ttl), ttl / 3
    if (
        isinstance(refresh_every, bool)
        or not isinstance(refresh_every, (int, float))
        or not refresh_every > 0
    ):
        raise ConfigError(
            f"{refresh_name}={refresh_every!r} must be above 0, a number of seconds below "
            f"{ttl_name}; leave it None for {ttl_name}/3"
        )
    if not refresh_every <= ttl / 2:
        # The lease is trusted until a drift margin before it ends, and a renewal that
        # gets no answer is tried again within the interval: half the ttl is the most
        # that leaves a second chance before the deadline.
        below = "" if refresh_every < ttl else f"must be below {ttl_name}={ttl} and "
        raise ConfigError(
            f"{refresh_name}={refresh_every!r} {below}leaves no time to renew before the "
            f"lease ends: choose at most {ttl_name}/2 = {ttl / 2:g} seconds, or leave it "
            f"None for {ttl_name}/3 = {ttl / 3:g}"
        )
    return float(ttl), float(refresh_every)


def check_idle_ttl(idle_ttl: Any, ttl: float, name: str = "idle_ttl") -> int:
    """Check an idle expiry (seconds, or None: keep forever); return it in ms (0: never)."""
    if idle_ttl is None:
        return 0
    if (
        isinstance(idle_ttl, bool)
        or not isinstance(idle_ttl, (int, float))
        or idle_ttl < max(MIN_IDLE_TTL, 2 * ttl)
    ):
        raise ConfigError(
            f"{name}={idle_ttl!r}: the keys of an idle name must be kept at least "
            f"{max(MIN_IDLE_TTL, 2 * ttl):g} seconds (twice the ttl, and a second); "
            f"the default keeps them a week ({IDLE_TTL:g}); None keeps them forever"
        )
    return int(idle_ttl * 1000)


# -- reaching the store -----------------------------------------------------------------


def why_unreachable(exc: BaseException) -> str:
    """Why a store was not reached, for a message: the error, or what a non-Redis answer means."""
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return (
            f"something answered, but not in the Redis protocol ({exc}); is another "
            "service listening at that address? Check the host and port"
        )
    return str(exc)


@contextmanager
def reachable(client: Any, doing: str, name: str | None = None, **context: Any) -> Iterator[None]:
    """Turn "Redis could not be reached" into ClaimUnavailable, the one place that does."""
    try:
        yield
    except UNREACHABLE as exc:
        raise ClaimUnavailable(
            f"cannot reach Redis at {describe_client(client)} to {doing} ({why_unreachable(exc)})",
            name=name,
            **context,
        ) from exc


class NotReplicated(Exception):
    """The master applied a write, but fewer replicas than asked acknowledged it in time."""

    def __init__(self, acked: int) -> None:
        super().__init__(acked)
        self.acked = acked


def check_replicas(
    replicas: Any,
    timeout: Any,
    ttl: float,
    names: tuple[str, str] = ("replicas", "replica_timeout"),
) -> tuple[int, int]:
    """``replicas`` (an int >= 0) and its timeout in ms (below the ttl), or ConfigError."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ConfigError(
            f"{names[0]}={replicas!r} must be a whole number >= 0: how many replicas must "
            "acknowledge the lease before the work starts (0: do not wait)"
        )
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"{names[1]}={timeout!r} must be seconds > 0, e.g. 1.0")
    if replicas and timeout >= ttl / 2:
        raise ConfigError(
            f"{names[1]}={timeout!r} must be below half the ttl ({ttl / 2:g} s): a "
            "lease must not run out while its acknowledgement is awaited"
        )
    return replicas, max(1, int(timeout * 1000))


class LeaseCalls:
    """The lease scripts of one name as calls to send, and what their answers mean.

    No I/O: :class:`LeaseStore` sends these calls on a ``redis.Redis`` client, and
    ``fenced.aio`` on a ``redis.asyncio`` one.
    """

    __slots__ = ("_acquire_keys", "_no_done", "_note_prefix", "_release_keys", "keys")

    def __init__(self, keys: ClaimKeys) -> None:
        self.keys = keys
        # Built once: every acquire and release sends them.
        self._acquire_keys = lock, _fence, runs, skips, rerun = tuple(keys.all())
        self._release_keys = (lock, runs, skips, rerun)
        self._no_done = keys.done("")
        self._note_prefix = keys.released("")

    def acquire_call(
        self,
        token: str,
        ttl_ms: int,
        record: str,
        skip_reason: str,
        max_records: int,
        rerun: str,
        task_id: str | None,
        idle_ms: int,
    ) -> Call:
        """ACQUIRE (see its contract); the answer is read by ``Claim``."""
        return (
            ACQUIRE,
            self._acquire_keys,
            [token, ttl_ms, record, skip_reason, max_records, rerun, task_id or "", idle_ms],
        )

    def refresh_call(self, token: str, ttl_ms: int, idle_ms: int = 0) -> Call:
        """REFRESH of ``token``'s lease (and the name's lasting keys); 1 when extended."""
        keys = [self.keys.lock, *self.keys.lasting()] if idle_ms else [self.keys.lock]
        return REFRESH, keys, [token, ttl_ms, idle_ms]

    def release_call(
        self,
        token: str,
        record: str,
        max_records: int,
        outcome: str,
        fence: int | None,
        idle_ms: int,
        task_id: str | None = None,
        done_ms: int = 0,
        take_reruns: bool = True,
    ) -> Call:
        """RELEASE of ``token``'s lease; its answer is read by :func:`released`."""
        # Without a task id there is no marker to set; the key still names this slot.
        done = self.keys.done(task_id) if task_id else self._no_done
        return (
            RELEASE,
            # The note's key: the token's random part (new_token's 32 hex digits).
            (*self._release_keys, done, self._note_prefix + token[:32]),
            [
                token,
                record,
                max_records,
                outcome,
                fence or 0,
                "1" if take_reruns else "0",
                idle_ms,
                done_ms if task_id else 0,
            ],
        )

    def abandon_call(self, token: str) -> Call:
        """RELEASE of a lease a timed-out request may have left, recording nothing."""
        return (
            RELEASE,
            (*self._release_keys, self._no_done, self._note_prefix + token[:32]),
            [token, "", MAX_RECORDS, "", 0, "0", 0, 0],
        )


def released(res: Any) -> tuple[bool, str, list[str]]:
    """A RELEASE answer: (our token held the lease, the outcome recorded, reruns taken)."""
    return int(res[0]) == 1, as_text(res[1]), [as_text(t) for t in res[2]] if res[2] else []


class LeaseStore(LeaseCalls):
    """The lease scripts of one name on one client: acquire, refresh, release, abandon."""

    __slots__ = ("client", "replica_timeout_ms", "replicas")

    def __init__(
        self, client: Any, keys: ClaimKeys, replicas: int = 0, replica_timeout_ms: int = 0
    ) -> None:
        super().__init__(keys)
        self.client = client
        self.replicas = replicas
        self.replica_timeout_ms = replica_timeout_ms

    def _run(self, call: Call) -> Any:
        script, keys, args = call
        return script(self.client, keys, args)

    def acquire(
        self,
        token: str,
        ttl_ms: int,
        record: str,
        skip_reason: str,
        max_records: int,
        rerun: str,
        task_id: str | None,
        idle_ms: int,
    ) -> list[Any]:
        """Run ACQUIRE (see its contract); unreachable errors propagate to the caller.

        With replicas to wait for, the answer has one more item: how many acknowledged.
        """
        call = self.acquire_call(
            token, ttl_ms, record, skip_reason, max_records, rerun, task_id, idle_ms
        )
        if self.replicas:
            reply, acked = self.replicated(*call)
            return [*reply, acked]
        return list(self._run(call))

    def replicated(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """Run a script, then WAIT for the replicas on the same connection: (reply, acked).

        One round trip to the server that holds the name (on a cluster, its node).
        """
        wait = (self.replicas, self.replica_timeout_ms)
        for attempt in (1, 2):
            server = node_client(self.client, self.keys.lock)
            try:
                reply, acked = run_pipeline(server, [(script, keys, args)], wait=wait)
            except UNREACHABLE:
                refresh_slots(self.client)  # a cluster node gone: the next try finds its heir
                raise
            if isinstance(reply, redis.exceptions.AskError) and attempt == 1:
                refresh_slots(self.client)  # MOVED: the slot map was out of date
                continue
            if isinstance(reply, Exception):
                raise reply
            return reply, 0 if isinstance(acked, Exception) else int(acked)
        raise AssertionError("unreachable")

    def refresh(self, token: str, ttl_ms: int, idle_ms: int = 0) -> bool:
        """Extend the lease if ``token`` still holds it (and keep the name's lasting keys)."""
        call = self.refresh_call(token, ttl_ms, idle_ms)
        if self.replicas:
            reply, acked = self.replicated(*call)
            if int(reply) == 1 and acked < self.replicas:
                raise NotReplicated(acked)
            return int(reply) == 1
        return int(self._run(call)) == 1

    def release(
        self,
        token: str,
        record: str,
        max_records: int,
        outcome: str,
        fence: int | None,
        idle_ms: int,
        task_id: str | None = None,
        done_ms: int = 0,
        take_reruns: bool = True,
    ) -> tuple[bool, str, list[str]]:
        """Delete the lease if ``token`` holds it: (released, outcome recorded, reruns)."""
        call = self.release_call(
            token, record, max_records, outcome, fence, idle_ms, task_id, done_ms, take_reruns
        )
        return released(self._run(call))

    def finished_ok(self, task_id: str) -> bool:
        """Whether a run of ``task_id`` ended ``ok`` within its redelivery window."""
        return bool(self.client.exists(self.keys.done(task_id)))

    def abandon(self, token: str) -> None:
        """A request that timed out may still have landed: drop that lease if we can."""
        try:
            self._run(self.abandon_call(token))
        except Exception:  # best effort; the lease expires within its ttl anyway
            pass


def read_holder(client: Any, name: str, *, namespace: str = "fenced") -> Holder | None:
    """The current holder of a claim, or None when nobody holds it (one round trip)."""
    keys = ClaimKeys.of(name, namespace)
    pipe = client.pipeline(transaction=False)
    pipe.get(keys.lock)
    pipe.pttl(keys.lock)
    pipe.get(keys.fence)
    with reachable(client, f"read claim {keys.name!r}", keys.name):
        token, pttl, fence = pipe.execute()
    if token is None:
        return None
    return Holder.parse(as_text(token), int(pttl), int(fence) if fence is not None else None)


def force_release(
    client: Any,
    name: str,
    *,
    namespace: str = "fenced",
    task_id: str | None = None,
    pid: int | None = None,
    host: str | None = None,
    token_prefix: str = "",
    outcome: str | None = None,
    reason: str | None = None,
    max_records: int = MAX_RECORDS,
    idle_ttl: float | None = IDLE_TTL,
    **data: Any,
) -> Holder | None:
    """Clear a claim whatever its token; with ``task_id``/``pid``, only such a holder's.

    For a supervisor that knows the holder is gone (a killed process) or an operator
    (``by=`` names them in the record). ``pid`` matches a holder process on ``host``
    (default: this host). ``outcome`` (e.g. ``"aborted"``) ends the holder's run record;
    without it the record says ``released``. Returns the holder that was cleared, or
    None (one round trip).
    """
    # Run records own their encoding, and they build on this module.
    from .records import encode_release

    keys = ClaimKeys.of(name, namespace)
    record = encode_release(reason, **data)
    with reachable(client, f"release claim {keys.name!r}", keys.name):
        token = FORCE_RELEASE(
            client,
            [keys.lock, keys.runs],
            [
                token_prefix,
                record,
                max_records,
                task_id or "",
                outcome or "",
                holder_filter(host, pid),
                int(idle_ttl * 1000) if idle_ttl else 0,
            ],
        )
    text = as_text(token) if token else ""
    return Holder.parse(text) if text else None

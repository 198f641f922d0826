"""The lease layer: who we are, what a token is, where a name's keys live, and the store.

Everything that talks to Redis about a lease goes through here:

- **process identity** — the host and the pid, the pid kept current across ``fork``;
- **the token** — ``random:host:pid:task id``, defined once (``TOKEN_PATTERN``, read by
  the scripts and by :meth:`Holder.parse`);
- **the keys** — every key of one name (lease, fence, records, skips, rerun, queued,
  handover, cooldown, the slots of a name held by several at once, pointer), under one
  namespace and one Cluster hash tag;
- **the store** — the scripts run through :class:`LeaseStore`, and the one mapping
  from "Redis could not be reached" to :class:`ClaimUnavailable`;
- **timing** — the one check of a ttl and a refresh interval (and of a cooldown window
  and a limit of holders), for every front end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import redis

from ._client import describe_client, node_client, refresh_slots
from ._errors import ClaimUnavailable, ConfigError, CorruptKey
from ._naming import validate_name
from ._printable import printable, readable
from ._scripts import (
    ACQUIRE,
    HANDOVER,
    RATE_UNBOOK,
    REFRESH,
    RELEASE,
    REPLACE,
    TAKEOVER,
    TOKEN_PATTERN,
    Call,
    Script,
    as_text,
    run_pipeline,
)

__all__ = [
    "HOST",
    "IDLE_TTL",
    "LAST_MS",
    "MAX_RECORDS",
    "UNREACHABLE",
    "ClaimKeys",
    "Holder",
    "LeaseCalls",
    "LeaseStore",
    "check_timing",
    "current_pid",
    "describe_client",
    "granted_reply",
    "new_token",
    "reachable",
    "refresh_request",
    "released",
    "run_replicated",
    "why_unreachable",
]

log = logging.getLogger("fenced")

#: Errors that mean "the store could not be reached" (the request may not have landed).
#: An answer that is not in the Redis protocol (another service on that port) is one
#: of them: no Redis heard the request.
UNREACHABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
    redis.exceptions.InvalidResponse,
)
#: Run records kept per claim (the oldest beyond them are trimmed).
MAX_RECORDS = 1000
#: How long the lasting keys of a name nobody uses (fence, run records, skip count,
#: rerun triggers) are kept: a week. Names built from arguments (per user, per feed)
#: would otherwise fill a Redis that must not evict.
IDLE_TTL = 7 * 24 * 3600.0
#: The most holders a name may have at once (``limit``): every acquire reads each slot.
MAX_LIMIT = 64
#: How many task ids a name remembers as replaced by a newer call (``on_busy="replace"``):
#: a retry or redelivery of any of them never takes the name again.
REPLACED_CALLS = 64
#: The shortest idle expiry (and never below twice the ttl): long enough that a name in
#: use keeps its skip count and records between runs.
MIN_IDLE_TTL = 1.0

# -- process identity -----------------------------------------------------------------

#: This host, as tokens carry it (a ':' would break the token's format).
HOST = socket.gethostname().replace(":", "_") or "localhost"
# Kept current across fork: os.getpid() is a system call, and the acquire and release
# path asks for it several times per cycle.
_pid = os.getpid()
# What every token and run record writes of it, made once (and again after a fork).
_host_pid = f"{HOST}:{_pid}"
_pid_text = str(_pid)


def current_pid() -> int:
    """This process's pid, current in a forked child too."""
    return _pid


def pid_text() -> str:
    """:func:`current_pid` as decimal text."""
    return _pid_text


def _after_fork_in_child() -> None:
    global _pid, _host_pid, _pid_text
    _pid = os.getpid()
    _host_pid = f"{HOST}:{_pid}"
    _pid_text = str(_pid)


os.register_at_fork(after_in_child=_after_fork_in_child)

# -- the token --------------------------------------------------------------------------

_TOKEN = re.compile(TOKEN_PATTERN, re.DOTALL)
# A pid as new_token writes it (str.isdigit also accepts digits int() refuses, "²").
_PID = re.compile("[0-9]{1,20}")
# An integer as Redis writes one (Python's int() also takes "1_000", " 7", "٣").
_INTEGER = re.compile("-?[0-9]{1,19}")
# A fence as the scripts mint one: no sign, no leading zero (see _scripts._FENCE).
_FENCE = re.compile("0|[1-9][0-9]{0,18}")
#: Largest fence the scripts mint on: its successor, 2**63-1, still fits a signed
#: 64-bit column. A fence key above it (or not an integer) mints nothing.
LAST_FENCE = 2**63 - 2


def new_token(task_id: str | None = None) -> str:
    """A fresh owner token: 128 random bits, then host, pid and task id for humans."""
    # secrets.token_hex(16), without its three Python calls: every acquire makes one.
    return f"{os.urandom(16).hex()}:{_host_pid}:{task_id or ''}"


def holder_filter(host: str | None, pid: int | None) -> str:
    """The ``host:pid`` part of a token, as FORCE_RELEASE matches it ("" for any)."""
    return f"{(host or HOST).replace(':', '_')}:{pid}" if pid is not None else ""


@dataclass(frozen=True)
class Holder:
    """Who holds a claim: parsed from its token, with its fence and time left.

    ``token`` is only the start of the holder's token (:func:`short_token`): enough to
    name the holder to ``fenced release --token``, never enough to release its lease.
    """

    token: str
    host: str
    pid: int | None
    task_id: str | None
    fence: int | None
    expires_in: float | None
    #: Why the stored value could not be read (the claim is held by someone unknown).
    unreadable: str | None = None

    @classmethod
    def parse(
        cls, token: str | bytes, pttl_ms: int | None = None, fence: int | None = None
    ) -> Holder:
        """Parse a token written by :func:`new_token` (foreign values parse as opaque).

        Never fails: a value that is not UTF-8 gives a holder whose ``unreadable`` says
        so (its ``token`` then shows the start of the bytes as escapes).
        """
        expires = None if pttl_ms is None or pttl_ms < 0 else pttl_ms / 1000.0
        if isinstance(token, bytes):
            try:
                token = token.decode()
            except UnicodeDecodeError:
                unreadable = "the lease's value is not UTF-8"
                return cls(
                    short_token(readable(token)), "?", None, None, fence, expires, unreadable
                )
        match = _TOKEN.fullmatch(token)
        if match:
            _rand, host, pid, task_id = match.groups()
            pid_int = int(pid) if _PID.fullmatch(pid) else None
        else:
            host, pid_int, task_id = "?", None, ""
        # The whole token releases the lease: it stays with its holder.
        return cls(short_token(token), host, pid_int, task_id or None, fence, expires)

    @classmethod
    def unknown(cls, why: str) -> Holder:
        """A holder whose lease was seen but could not be read at all."""
        return cls("?", "?", None, None, None, None, why)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)

    @property
    def text(self) -> str:
        """``host:pid`` (``:task_id`` when there is one), escaped: the holder in events
        and structured log fields."""
        if self.unreadable:
            return "?"
        who = f"{printable(self.host)}:{self.pid if self.pid is not None else '?'}"
        return f"{who}:{printable(self.task_id)}" if self.task_id else who

    def __str__(self) -> str:
        # Host and task id are whatever the token says: escaped, so that a message
        # naming the holder never carries terminal controls into a log or a terminal.
        if self.unreadable:
            who = f"someone unknown (unreadable: {self.unreadable})"
        else:
            who = f"{printable(self.host)} pid {self.pid}"
            if self.task_id:
                who += f" task {printable(self.task_id)}"
        if self.expires_in is not None:
            who += f", {self.expires_in:.1f}s left"
        return who


def short_token(token: str | None) -> str:
    """A token as shown: the start of its random part only, a prefix of the token.

    Printed as it is (no ellipsis), so that ``fenced release --token`` takes it back;
    32 random bits, too few to guess the other 96 from. "" for no token.
    """
    return token.split(":", 1)[0][:8] if token else ""


# -- the keys ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimKeys:
    """The Redis keys of one name, all under one namespace and one hash tag."""

    namespace: str
    name: str
    #: What every key of the name starts with: ``{namespace}:{{name}}:`` (made once:
    #: every claim spells its keys from it).
    prefix: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", f"{self.namespace}:{{{self.name}}}:")

    @classmethod
    def of(cls, name: str, namespace: str = "fenced") -> ClaimKeys:
        """Keys for a name (checked, a fixed point) under a namespace."""
        check_namespace(namespace)
        return cls(namespace, validate_name(name))

    def _key(self, part: str) -> str:
        return self.prefix + part

    @property
    def lock(self) -> str:
        """The lease itself: value = owner token, PX = ttl."""
        return self._key("lock")

    @property
    def fence(self) -> str:
        """The fence counter; never decreases."""
        return self._key("fence")

    @property
    def records(self) -> str:
        """The run records: a list, newest first, capped (``max_records``)."""
        return self._key("records")

    @property
    def runs(self) -> str:
        """The run-record stream earlier versions wrote, newest last: read beside
        :attr:`records`, never written (it expires with the name's idle expiry)."""
        return self._key("runs")

    @property
    def skips(self) -> str:
        """Consecutive skips since the last successful run."""
        return self._key("skips")

    @property
    def rerun(self) -> str:
        """Set when a conflicting trigger asked for one more run."""
        return self._key("rerun")

    @property
    def rerun_sending(self) -> str:
        """Rerun triggers a release took and whose reruns are not known to be sent yet."""
        return self._key("rerun:sending")

    @property
    def queued(self) -> str:
        """The task id of the message queued for this name (``claim_enqueue``)."""
        return self._key("queued")

    @property
    def handover(self) -> str:
        """The token a lease is kept for while its task's retried message is due."""
        return self._key("handover")

    def slot(self, index: int) -> str:
        """The lease of one slot of a name held by up to ``limit`` at once; slot 0 is
        :attr:`lock`, so a claim of limit 1 is the plain claim."""
        return self.lock if index == 0 else self._key(f"slot:{index}")

    @property
    def slots(self) -> str:
        """A hash of each slot's fence, and the limit the name was last acquired with."""
        return self._key("slots")

    @property
    def replaced(self) -> str:
        """Why each replaced holder lost its lease (``on_busy="replace"``): a hash from the
        start of its token, read by that holder's next renewal."""
        return self._key("replaced")

    @property
    def replaced_calls(self) -> str:
        """The task ids a newer call took the name over from (``on_busy="replace"``), newest
        first, each with why: none of them takes the name again (a list, at most
        :data:`REPLACED_CALLS` long, with the name's idle expiry)."""
        return self._key("replaced:calls")

    @property
    def cooldown(self) -> str:
        """Lives for the cooldown window after a run that ended ``ok`` (value: its fence)."""
        return self._key("cooldown")

    @property
    def rate(self) -> str:
        """When the name's next start is allowed (``rate``): Redis TIME in µs, expiring
        then."""
        return self._key("rate")

    @property
    def rate_starts(self) -> str:
        """The starts counted by the name's rate (``rate``): a sorted set of each start
        granted (its fence) and booked (``b:<task id>``, fenced.celery's
        ``claim_rate_policy="delay"``), scored by their time (Redis TIME in µs),
        expiring once the latest no longer counts."""
        return self._key("rate:starts")

    @property
    def debounce(self) -> str:
        """The name's open burst (``claim_debounce``): a hash of the burst's task id, the
        times of its first and last call, when it is due, how many calls it has and the
        last call (fenced.celery's debounce)."""
        return self._key("debounce")

    @property
    def beat(self) -> str:
        """A beat leader's claim: each entry's last due time and the leader's last tick
        (fenced.celery.beat)."""
        return self._key("beat")

    def released(self, token: str) -> str:
        """A short-lived note of how a token's release went, so a retry gets that answer."""
        return f"{self._key('released:')}{token.split(':', 1)[0]}"

    def lasting(self, limit: int = 1) -> tuple[str, ...]:
        """The keys that outlive a lease and expire when the name is idle (a name held
        by several at once, ``limit`` > 1, keeps its slots' hash too)."""
        p = self.prefix
        kept = (p + "fence", p + "records", p + "skips", p + "rerun")
        return (*kept, self.slots) if limit > 1 else kept

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
        # As lock, fence, records, skips, rerun and cooldown spell them, from one prefix:
        # every claim object builds these.
        p = self.prefix
        return [p + "lock", p + "fence", p + "records", p + "skips", p + "rerun", p + "cooldown"]

    @staticmethod
    def name_from_key(key: str | bytes, namespace: str = "fenced") -> str | None:
        """Recover the claim name from any of its keys (used by ``fenced ls``)."""
        text = readable(key)
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
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl < math.inf:
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


def check_limit(limit: Any, name: str = "limit") -> int:
    """Check how many holders a name may have at once: a whole number 1..MAX_LIMIT."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise ConfigError(
            f"{name}={limit!r} is not a number of holders: give a whole number from 1 "
            f"(one at a time, the default) to {MAX_LIMIT}, e.g. {name}=3"
        )
    return limit


def check_cooldown(cooldown: Any, idle_ms: int, name: str = "cooldown") -> int:
    """Check a cooldown window (seconds; None or 0: none); return it in ms (0: none).

    ``idle_ms`` is the name's idle expiry (0: never): a window may not outlast it, since
    nothing of an idle name is kept longer than that.
    """
    if cooldown is None or (
        not isinstance(cooldown, bool) and isinstance(cooldown, (int, float)) and cooldown == 0
    ):
        return 0
    if (
        isinstance(cooldown, bool)
        or not isinstance(cooldown, (int, float))
        or not 0.001 <= cooldown < math.inf
    ):
        raise ConfigError(
            f"{name}={cooldown!r} is not a window in seconds: after a run that ended ok, "
            f"triggers within this long are skipped; give at least 0.001, e.g. {name}=300 "
            "(0 or None: no window)"
        )
    ms = int(cooldown * 1000)
    if idle_ms and ms > idle_ms:
        raise ConfigError(
            f"{name}={cooldown!r} is longer than the idle expiry of the name's keys "
            f"({idle_ms / 1000:g} s): shorten the window, or raise the idle expiry "
            "(idle_ttl, claim_idle_ttl) to at least the window"
        )
    return ms


#: A rate's periods, as its text spells them, in seconds.
RATE_PERIODS = {"s": 1, "m": 60, "h": 3600}
_RATE = re.compile(r"\s*([0-9]+)\s*/\s*([smh])\s*")
#: The most starts a rate may allow per second.
MAX_RATE_PER_SECOND = 100_000


#: The most starts a window may count (``rate`` without ``rate_spread``): the starts
#: key keeps one entry for each.
MAX_WINDOW_STARTS = 10_000


def _parse_rate(rate: Any, name: str) -> tuple[int, int]:
    """A rate's starts and period (s), or ConfigError naming the fix."""
    match = _RATE.fullmatch(rate) if isinstance(rate, str) else None
    count = int(match[1]) if match else 0
    period = RATE_PERIODS[match[2]] if match else 1
    if not match or not 1 <= count <= MAX_RATE_PER_SECOND * period:
        raise ConfigError(
            f"{name}={rate!r} is not a rate: give the most starts per second, minute or "
            f"hour as 'N/s', 'N/m' or 'N/h' (N a whole number from 1), e.g. {name}='10/m'; "
            "None: no limit"
        )
    return count, period


def check_rate(rate: Any, name: str = "rate") -> int:
    """Check a rate (``"10/m"``: starts per second, minute or hour; None: no limit);
    return the mean interval between two starts in µs (0: no limit), rounded up so the
    rate is never exceeded."""
    if rate is None:
        return 0
    count, period = _parse_rate(rate, name)
    return -(-period * 1_000_000 // count)


def rate_window(
    rate: Any, spread: Any = False, names: tuple[str, str] = ("rate", "rate_spread")
) -> tuple[int, int]:
    """How a rate is counted: (starts, window in µs); (0, 0) without a rate.

    ``"3/m"`` allows 3 starts in any window of a minute, up to 3 at once; with
    ``spread`` one start in any window of 20 s (the starts spread evenly)."""
    if not isinstance(spread, bool):
        raise ConfigError(
            f"{names[1]}={spread!r} must be True (one start every period/N) or False (up "
            "to N at once, at most N in any window of one period)"
        )
    if rate is None:
        return 0, 0
    count, period = _parse_rate(rate, names[0])
    if spread or count == 1:
        return 1, -(-period * 1_000_000 // count)
    if count > MAX_WINDOW_STARTS:
        raise ConfigError(
            f"{names[0]}={rate!r} counts more starts in one window than a window keeps "
            f"({MAX_WINDOW_STARTS:,}): give {names[1]}=True (one start every period/N, "
            "nothing kept per start)" + (", or the rate per second or minute" if period > 1 else "")
        )
    return count, period * 1_000_000


# -- reaching the store -----------------------------------------------------------------


def why_unreachable(exc: BaseException) -> str:
    """Why a store was not reached, for a message: the error, or what a non-Redis answer means."""
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return (
            f"something answered, but not in the Redis protocol ({exc}); is another "
            "service listening at that address? Check the host and port"
        )
    if "closed by server" in str(exc):  # e.g. PostgreSQL's port, spoken to in RESP
        return f"{exc} Not a Redis server? Check the host and port"
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


def run_replicated(
    client: Any, route_key: str, call: Call, wait: tuple[int, int]
) -> tuple[Any, int]:
    """Run a script, then ``WAIT replicas timeout_ms`` on the same connection, in one
    round trip to the server that holds ``route_key`` (on a cluster, its node):
    (reply, how many replicas acknowledged). An error reply is raised."""
    for attempt in (1, 2):
        server = node_client(client, route_key)
        try:
            reply, acked = run_pipeline(server, [call], wait=wait)
        except UNREACHABLE:
            refresh_slots(client)  # a cluster node gone: the next try finds its heir
            raise
        if isinstance(reply, redis.exceptions.AskError) and attempt == 1:
            refresh_slots(client)  # MOVED: the slot map was out of date
            continue
        if isinstance(reply, Exception):
            raise reply
        return reply, 0 if isinstance(acked, Exception) else int(acked)
    raise AssertionError("unreachable")


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


class LeaseOptions(Protocol):
    """What the lease scripts read of a claim's options (``fenced.ClaimOptions`` has it)."""

    @property
    def limit(self) -> int: ...
    @property
    def max_records(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def idle_ms(self) -> int: ...
    @property
    def cooldown_ms(self) -> int: ...
    @property
    def replica_ms(self) -> int: ...
    @property
    def done_ms(self) -> int: ...
    @property
    def rate_us(self) -> int: ...
    @property
    def rate_per(self) -> int: ...
    @property
    def rate_window_us(self) -> int: ...


class LeaseCalls:
    """The lease scripts of one name as calls to send, and what their answers mean.

    No I/O: :class:`LeaseStore` sends these calls on a ``redis.Redis`` client, and
    ``fenced.aio`` on a ``redis.asyncio`` one.
    """

    __slots__ = (
        "_acquire_keys",
        "_cooldown",
        "_lasting",
        "_no_done",
        "_note_prefix",
        "_plain_keys",
        "_release_keys",
        "keys",
        "limit",
        "opts",
    )

    def __init__(self, keys: ClaimKeys, opts: LeaseOptions) -> None:
        self.keys = keys
        #: The claim's options (fenced.ClaimOptions): what every call sends.
        self.opts = opts
        #: How many holders the name may have at once (slots 0 .. limit-1).
        self.limit = limit = opts.limit
        # Built once: every acquire and release sends them.
        self._acquire_keys = acquire = tuple(keys.all())
        self._plain_keys = acquire[:5]
        # ACQUIRE's fence, records, skips and rerun keys are a single holder's lasting ones.
        self._lasting = acquire[1:5] if limit == 1 else keys.lasting(limit)
        if limit > 1:
            self._acquire_keys += (keys.slots, *(keys.slot(i) for i in range(1, limit)))
        self._release_keys = (acquire[0], *acquire[2:5])
        self._no_done = keys.done("")
        self._note_prefix = keys.released("")
        self._cooldown = acquire[5]

    def acquire_call(
        self,
        token: str,
        record: str,
        skip_reason: str,
        rerun: str,
        task_id: str | None,
        cooldown_reason: str = "",
        queued: str = "",
        booking_ms: int = 0,
    ) -> Call:
        """ACQUIRE (see its contract); the answer is read by ``Claim``.

        ``queued`` is what the run of ``task_id`` does to the name's enqueue marker
        (ACQUIRE's ARGV[12]: "-" deletes it, a number of ms gives it that expiry).
        With a rate, ``booking_ms`` and a ``task_id``, a call over the rate books the
        next free start for the task id, held that long past it (ACQUIRE's ARGV[14]).
        """
        o = self.opts
        cooldown_reason = cooldown_reason if o.cooldown_ms else ""
        queued = queued if task_id else ""
        # A delivery of a task id whose run ended ok: the script says so in its grant
        # (whatever the broker's flags), and the window that run started does not skip it.
        done = self.asks_done(task_id)
        rate = o.rate_window_us
        # ARGV as ACQUIRE takes them: token, ttl, idle, then the record, skip reason,
        # rerun trigger, task id and maximum records, each left off at its default
        # when nothing after it is sent.
        args: list[Any] = [token, o.ttl_ms, o.idle_ms]
        rest = [record, skip_reason, rerun, task_id or "", o.max_records]
        if self.limit == 1 and not cooldown_reason and not queued and not done and not rate:
            # The plain claim sends what it always sent: no cooldown key, no slots.
            return ACQUIRE, self._plain_keys, args + _trimmed(rest, _ACQUIRE_DEFAULTS)
        args += rest
        args.append(cooldown_reason)
        keys = self._acquire_keys
        if rate:
            # ARGV[13] comes after every optional argument before it; its key is the last.
            args += [self.limit, "1" if done else "0", queued, rate]
            if done:
                keys += (self.keys.done(task_id or ""),)
            if queued:
                keys += (self.keys.queued,)
            keys += (self.keys.rate, self.keys.rate_starts)
            booking = booking_ms if booking_ms and task_id else ""
            if o.rate_per > 1:
                args += [booking, o.rate_per]
            elif booking:
                args.append(booking)
            return ACQUIRE, keys, args
        if done or queued:
            args += [self.limit, "1" if done else "0"]
            if done:
                keys += (self.keys.done(task_id or ""),)
            if queued:
                args.append(queued)
                keys += (self.keys.queued,)
        elif self.limit > 1:
            args.append(self.limit)
        return ACQUIRE, keys, args

    def asks_done(self, task_id: str | None) -> bool:
        """Whether ACQUIRE for ``task_id`` looks at its done marker (and its grant says)."""
        return bool(task_id) and self.opts.done_ms > 0

    def refresh_call(
        self, token: str, slot: int = 0, marker: tuple[str, str] | None = None
    ) -> Call:
        """REFRESH of ``token``'s lease (and the name's lasting keys); 1 when extended.
        With ``marker`` (the enqueue marker's key and the run's task id), the marker is
        kept alive one ttl while it holds that task id (REFRESH's ARGV[5])."""
        idle_ms = self.opts.idle_ms
        # With limit 1 a refusal says so when a newer run replaced this one (REPLACE).
        notes = self.keys.replaced if self.limit == 1 else ""
        lasting = self._lasting if idle_ms else ()
        return refresh_request(
            self.keys.slot(slot), token, self.opts.ttl_ms, idle_ms, lasting, notes, marker
        )

    def replace_call(
        self,
        token: str,
        record: str,
        task_id: str,
        why: str,
        cooldown_reason: str,
        queued: str = "",
    ) -> Call:
        """REPLACE: take the name over from its holder (``why`` is noted for it), or a
        free name outside a cooldown window; read as ACQUIRE's. ``queued`` is what the
        run of ``task_id`` does to the name's enqueue marker, as for :meth:`acquire_call`.
        The holder's task id joins the name's replaced calls, and a ``task_id`` among
        them is refused (a newer call replaced it)."""
        k = self.keys
        keys: tuple[str, ...] = (k.lock, k.fence, k.records, k.replaced)
        o = self.opts
        ended = json.dumps({"reason": why}) if record else ""
        args: list[Any] = [token, o.ttl_ms, record, o.max_records, task_id, o.idle_ms, why, ended]
        if o.cooldown_ms:
            keys += (k.skips, self._cooldown)
        args.append(cooldown_reason if o.cooldown_ms else "")
        done = self.asks_done(task_id)
        if done:
            # A duplicate delivery of a task id whose run ended ok replaces nobody.
            keys += (k.done(task_id),)
        queued = queued if task_id else ""
        if queued:
            keys += (k.queued,)
        keys += (k.replaced_calls,)
        args += ["1" if done else "0", queued, REPLACED_CALLS]
        return REPLACE, keys, args

    def release_call(
        self,
        token: str,
        record: str,
        outcome: str,
        fence: int | None,
        task_id: str | None = None,
        take_reruns: bool = True,
        slot: int = 0,
        unqueue: bool = False,
        window: bool = True,
        keep_reruns: bool = False,
    ) -> Call:
        """RELEASE of ``token``'s lease (in ``slot``); its answer is read by :func:`released`.

        With ``unqueue``, the name's enqueue marker goes too while it holds ``task_id``;
        with ``window``, an ``ok`` outcome starts the cooldown window the options give;
        with ``keep_reruns``, the triggers taken stay in :attr:`ClaimKeys.rerun_sending`
        until the caller forgets them (``RERUN_SENT``), and the answer pairs each with
        its field.
        """
        # Without a task id there is no marker to set; the key still names this slot.
        done = self.keys.done(task_id) if task_id else self._no_done
        lease = self._release_keys if slot == 0 else (self.keys.slot(slot), *self._release_keys[1:])
        # The note's key: the token's random part (new_token's 32 hex digits).
        keys: tuple[str, ...] = (*lease, done, self._note_prefix + token[:32])
        o = self.opts
        take = ("2" if keep_reruns else "1") if take_reruns else "0"
        cooldown_ms = o.cooldown_ms if window else 0
        # ARGV as RELEASE takes them: token, outcome, then the record, fence, idle ms,
        # rerun triggers, done marker ms and maximum records, each left off at its
        # default when nothing after it is sent (the fence is read only to record it or
        # start a window, the idle expiry only to give a list or sending set one).
        args: list[Any] = [token, outcome]
        rest = [
            record,
            (fence or 0) if record or cooldown_ms else 0,
            o.idle_ms if record or take == "2" else 0,
            take,
            o.done_ms if task_id else 0,
            o.max_records,
        ]
        # With limit 1 a lease found gone says so when a newer run replaced this one
        # (REPLACE's note, read only then): RELEASE's A[11], with its notes last of KEYS.
        notes = self.limit == 1
        if cooldown_ms or (unqueue and task_id):
            keys += (self._cooldown,)
            args += [*rest, cooldown_ms]
        elif notes:
            args += [*rest, 0]
        else:
            args += _trimmed(rest, _RELEASE_DEFAULTS)
        if unqueue and task_id:
            keys += (self.keys.queued,)
            args.append(task_id)
        elif notes:
            args.append("")
        if take_reruns and keep_reruns:
            keys += (self.keys.rerun_sending,)
        if notes:
            keys += (self.keys.replaced,)
            args.append("1")
        return RELEASE, keys, args

    def handover_call(self, token: str, keep_ms: int, record: str, fence: int) -> Call:
        """HANDOVER: end ``token``'s run, keeping its lease ``keep_ms`` for its task's retry."""
        keys = (self.keys.lock, self.keys.records, self.keys.handover)
        o = self.opts
        return HANDOVER, keys, [token, keep_ms, record, o.max_records, fence, o.idle_ms]

    def takeover_call(
        self,
        token: str,
        record: str,
        task_id: str,
        cooldown_reason: str,
        queued: str = "",
        replacing: bool = False,
    ) -> Call:
        """TAKEOVER: take the lease kept for ``task_id`` (or a free name, outside a cooldown
        window); read as ACQUIRE's. ``queued``: as for :meth:`acquire_call`; with
        ``replacing`` (``on_busy="replace"``), a ``task_id`` among the name's replaced
        calls is refused, as REPLACE refuses it. A ``task_id`` whose run ended ok (its
        done marker, read as ACQUIRE reads it) takes over no lease: the answer says it
        is a duplicate."""
        k = self.keys
        keys: tuple[str, ...] = (k.lock, k.fence, k.records, k.handover)
        o = self.opts
        args: list[Any] = [token, o.ttl_ms, record, o.max_records, task_id, o.idle_ms]
        if o.cooldown_ms:
            keys += (k.skips, self._cooldown)
        done = self.asks_done(task_id)
        if done:
            keys += (k.done(task_id),)
        queued = queued if task_id else ""
        if o.cooldown_ms or queued or replacing or done:
            args.append(cooldown_reason if o.cooldown_ms else "")
        if queued or replacing or done:
            args.append(queued)
        if queued:
            keys += (k.queued,)
        if replacing:
            keys += (k.replaced_calls,)
        if replacing or done:
            args.append("1" if replacing else "")
        if done:
            args.append("1")
        return TAKEOVER, keys, args

    def unbook_call(self, task_id: str) -> Call:
        """RATE_UNBOOK: let go of the start booked for ``task_id`` over the rate (a call
        that will never come for it); 1 when there was one. The rate key is written
        again as ACQUIRE writes it."""
        o = self.opts
        keys = (self.keys.rate, self.keys.rate_starts)
        return RATE_UNBOOK, keys, [task_id, o.rate_window_us, o.rate_per]

    def abandon_calls(self, token: str) -> list[Call]:
        """RELEASE of a lease a timed-out request may have left (in any slot), recording
        nothing."""
        rest = (*self._release_keys[1:], self._no_done, self._note_prefix + token[:32])
        return [
            (RELEASE, (self.keys.slot(i), *rest), [token, "", "", 0, 0, "0"])
            for i in range(self.limit)
        ]

    def inspect_commands(self) -> list[tuple[str, ...]]:
        """Commands that read what the name's keys hold, for :meth:`corrupt_key`."""
        k = self.keys
        slots: list[tuple[str, ...]] = []
        if self.limit > 1:
            slots.append(("HMGET", k.slots, *map(str, range(self.limit))))
        return [
            *(("TYPE", key) for key in _key_types(k)),
            ("GET", k.fence),
            ("GET", k.skips),
            *slots,
        ]

    def corrupt_key(self, replies: Sequence[Any]) -> tuple[str, str] | None:
        """The key (and what is wrong with it) that keeps ACQUIRE from running, if any.

        ``replies`` answer :meth:`inspect_commands`, errors in place of results.
        """
        expected = _key_types(self.keys)
        for (key, kinds), kind in zip(expected.items(), replies, strict=False):
            kind = readable(kind)
            if kind != "none" and kind not in kinds:
                return key, f"is a {kind}, where fenced keeps a {' or a '.join(kinds)}"
        fence, skips, *slots = replies[len(expected) :]
        if fence is not None and not isinstance(fence, Exception) and fence_or_none(fence) is None:
            return self.keys.fence, not_a_fence(fence)
        if skips is not None and int_or_none(skips) is None:
            return self.keys.skips, f"holds {readable(skips)[:40]!r}, not an integer"
        for values in slots:
            for value in values if isinstance(values, list) else ():
                if value is not None and fence_or_none(value) is None:
                    return self.keys.slots, not_a_fence(value)
        return None


#: What ACQUIRE and RELEASE take for an optional argument left off (see their ARGV).
_ACQUIRE_DEFAULTS = ("", "", "", "", str(MAX_RECORDS))
_RELEASE_DEFAULTS = ("", "0", "0", "1", "0", str(MAX_RECORDS))


def _trimmed(args: list[Any], defaults: Sequence[str]) -> list[Any]:
    """``args`` without the trailing ones at their script's default (fewer to send)."""
    end = len(args)
    while end and str(args[end - 1]) == defaults[end - 1]:
        end -= 1
    return args[:end]


def _key_types(keys: ClaimKeys) -> dict[str, tuple[str, ...]]:
    """The Redis type each key of a name has when fenced wrote it."""
    # The rerun key of fenced 0.1 was a counter, a string: ACQUIRE still replaces it.
    return {
        keys.lock: ("string",),
        keys.fence: ("string",),
        keys.records: ("list",),
        keys.skips: ("string",),
        keys.rerun: ("set", "string"),
        keys.slots: ("hash",),
        keys.cooldown: ("string",),
    }


def corrupt_key_error(
    name: str,
    key: str,
    problem: str,
    exc: BaseException,
    doing: str = "acquire claim",
    is_fence: bool | None = None,
) -> CorruptKey:
    """CorruptKey for a script that failed at a key it could not use; names the fix."""
    is_fence = key.endswith(":fence") if is_fence is None else is_fence
    shown = printable(key)
    started = "; the work was not started" if doing.startswith("acquire") else ""
    if is_fence:
        # Stores remember the highest fence they accepted: a fence below it is refused.
        fix = (
            f"Set it to the highest fence issued or accepted by your stores (SET {shown} N, "
            "N at most 2**63-2; run records carry each run's fence), or delete it "
            f"(DEL {shown}) when no fence above the server's clock in microseconds was "
            "issued: the next fence then comes from that clock"
        )
    else:
        fix = f"Delete the key (DEL {shown}) or restore what fenced keeps there"
    return CorruptKey(
        f"cannot {doing} {name!r}: its key {shown!r} {problem} ({exc}); "
        f"fenced did not write that value. {fix}{started}",
        name=name,
        key=key,
    )


def refreshed(reply: Any) -> bool | str:
    """A REFRESH answer: True when extended, else False or REPLACE's note of why."""
    if isinstance(reply, (bytes, str)):
        return readable(reply)
    return int(reply) == 1


def refresh_request(
    key: str,
    token: str,
    ttl_ms: int,
    idle_ms: int,
    lasting: Sequence[str],
    notes: str = "",
    marker: tuple[str, str] | None = None,
) -> Call:
    """REFRESH of one lease (the claim's and the heartbeat's): with the name's replaced
    notes a refusal says why; with ``marker`` (the enqueue marker's key and the run's
    task id) the marker is kept alive one ttl while it holds that task id."""
    keys = [key, notes, *lasting] if notes else [key, *lasting]
    args: list[Any] = [token, ttl_ms, idle_ms]
    if marker is not None:
        keys.append(marker[0])
        args += ["1" if notes else "", marker[1]]
    elif notes:
        args.append("1")
    return REFRESH, keys, args


def granted_reply(res: Any) -> list[Any]:
    """An ACQUIRE (or TAKEOVER, REPLACE) answer as a list: a plain grant answers its
    fence alone, for ``[1, fence]``."""
    if isinstance(res, (bytes, str)):
        return [1, res]
    return list(res)


#: A RELEASE answer, read: (our token held the lease, the outcome recorded, reruns taken,
#: why a newer run replaced it or None).
Released = tuple[bool, str, list[str], str | None]


def released(res: Any) -> Released:
    """A RELEASE answer: (our token held the lease, the outcome recorded, reruns taken,
    REPLACE's note of why a newer run took the lease over, or None). A plain release
    answers its outcome alone, for ``[1, outcome, []]``."""
    if isinstance(res, (bytes, str)):
        return True, as_text(res), [], None
    if len(res) > 3 and res[3]:
        unrecorded(res[3], res[4], "release")
    why = readable(res[5]) if len(res) > 5 else None
    # A trigger is whatever a caller stored: bytes that are not text still name no call.
    triggers = [readable(t) for t in res[2]] if res[2] else []
    return int(res[0]) == 1, as_text(res[1]), triggers, why


def unrecorded(key: Any, kind: Any, what: str) -> None:
    """Warn that a run was not recorded: its runs key holds what fenced never writes."""
    key = printable(readable(key))
    log.warning(
        "fenced: the %s went through, but its run was not recorded: key %r is a %s, where "
        "fenced keeps a list of run records. Delete it (DEL %s) to record runs again",
        what,
        key,
        printable(readable(kind)),
        key,
    )


class LeaseStore(LeaseCalls):
    """The lease scripts of one name sent on one client: the calls :class:`LeaseCalls`
    builds, sent as they are (with the replicas' WAIT when the options ask for it)."""

    __slots__ = ("client",)

    def __init__(self, client: Any, keys: ClaimKeys, opts: LeaseOptions) -> None:
        super().__init__(keys, opts)
        self.client = client

    def send(self, call: Call) -> Any:
        """Send one call (no WAIT)."""
        script, keys, args = call
        return script(self.client, keys, args)

    def grant(self, call: Call) -> list[Any]:
        """Send ACQUIRE or TAKEOVER; unreachable errors propagate to the caller. With
        replicas to wait for, the answer has one more item: how many acknowledged."""
        if self.opts.replicas:
            reply, acked = self.replicated(*call)
            return [*granted_reply(reply), acked]
        return granted_reply(self.send(call))

    def replicated(
        self, script: Script, keys: Sequence[str], args: Sequence[Any]
    ) -> tuple[Any, int]:
        """Run a script, then WAIT for the replicas on the same connection: (reply, acked)."""
        wait = (self.opts.replicas, self.opts.replica_ms)
        return run_replicated(self.client, self.keys.lock, (script, keys, args), wait)

    def refresh(
        self, token: str, slot: int = 0, marker: tuple[str, str] | None = None
    ) -> bool | str:
        """Extend the lease if ``token`` still holds it (and keep the name's lasting keys):
        True when extended; when not, False, or why when a newer run replaced it."""
        call = self.refresh_call(token, slot, marker)
        if self.opts.replicas:
            reply, acked = self.replicated(*call)
            if reply == 1 and acked < self.opts.replicas:
                raise NotReplicated(acked)
        else:
            reply = self.send(call)
        return refreshed(reply)

    def release(self, call: Call, *, wait: bool = True) -> Released:
        """Send RELEASE: (our token held the lease, the outcome recorded, reruns taken,
        why a newer run replaced it or None).

        With replicas to wait for (and ``wait``), a WAIT follows in the same round trip;
        fewer acknowledgements are logged: the release stands on the master, but a
        failover may forget what it wrote (a cooldown window, a done marker).
        """
        if wait and self.opts.replicas:
            reply, acked = self.replicated(*call)
            answer = released(reply)
            if answer[0]:
                self._warn_unreplicated(acked, "release", "its cooldown window and done marker")
            return answer
        return released(self.send(call))

    def hand_over(self, call: Call) -> bool:
        """Send HANDOVER: True when the token held the lease and it is now kept."""
        if self.opts.replicas:
            reply, acked = self.replicated(*call)
            if int(reply[0] if isinstance(reply, list) else reply) == 1:
                self._warn_unreplicated(acked, "hand-over", "the lease kept for the retry")
        else:
            reply = self.send(call)
        if isinstance(reply, list):
            unrecorded(reply[1], reply[2], "hand-over")
            reply = reply[0]
        return int(reply) == 1

    def _warn_unreplicated(self, acked: int, what: str, forgets: str) -> None:
        if acked < self.opts.replicas:
            log.warning(
                "fenced: the %s of %r was acknowledged by %d of the %d replica(s) asked "
                "for within %g s: it stands on the master, but a failover now could "
                "forget %s. Check the replicas (INFO replication)",
                what,
                self.keys.name,
                acked,
                self.opts.replicas,
                self.opts.replica_ms / 1000,
                forgets,
            )

    def finished_ok(self, task_id: str) -> bool:
        """Whether a run of ``task_id`` ended ``ok`` within its redelivery window."""
        return bool(self.client.exists(self.keys.done(task_id)))

    def unbook(self, task_id: str) -> bool:
        """Send RATE_UNBOOK: True when a start was booked for ``task_id`` (now let go)."""
        return int(self.send(self.unbook_call(task_id))) == 1

    def find_corrupt_key(self) -> tuple[str, str] | None:
        """After a failed ACQUIRE: the key whose value stopped it, if one did."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for command in self.inspect_commands():
                pipe.execute_command(*command)
            return self.corrupt_key(pipe.execute(raise_on_error=False))
        except Exception:  # a diagnosis only: the error it explains is raised anyway
            return None

    def abandon(self, token: str) -> None:
        """A request that timed out may still have landed: drop that lease if we can."""
        try:
            for call in self.abandon_calls(token):
                self.send(call)
        except Exception:  # best effort; the lease expires within its ttl anyway
            pass


def fence_or_none(value: Any) -> int | None:
    """A fence read from Redis as an int; None unless it is one the scripts mint on: a
    decimal integer from 0 to LAST_FENCE, without sign or leading zero."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str) and _FENCE.fullmatch(value) and int(value) <= LAST_FENCE:
        return int(value)
    return None


def not_a_fence(value: Any) -> str:
    """What is wrong with a fence key's value (for CorruptKey)."""
    return f"holds {readable(value)[:40]!r}, not a fence (an integer from 0 to 2**63-2)"


def int_or_none(value: Any) -> int | None:
    """A reply as an int; None when absent, an error, or not an integer as Redis reads one
    (``INCR``, Lua's ``tonumber``): someone else's value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str) and _INTEGER.fullmatch(value):
        return int(value)
    return None


#: The last millisecond a date can show (9999-12-31 23:59:59.999 UTC).
LAST_MS = 253_402_300_799_999
_MS = re.compile("[0-9]{1,15}")


def ms_or_none(value: Any) -> int | None:
    """A time in ms since the epoch as fenced writes one (decimal digits) as an int; None
    for anything else, or a time past the last one a date can show."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if isinstance(value, str) and _MS.fullmatch(value) and int(value) <= LAST_MS:
        return int(value)
    return None

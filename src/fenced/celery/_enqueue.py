"""Deduplication at enqueue: one marker per claim name while a message for it is queued.

A claimed task with ``claim_enqueue`` set marks its claim name when ``apply_async``
publishes (``{namespace}:{name}:queued``, the name's hash tag, so one Cluster slot), in
the same atomic step that decides whether to publish: a name already marked publishes
nothing, and the caller gets the queued message's task id. The run clears the marker
when it starts (``until_started``) or when it ends (``until_finished``), only while the
marker still holds its own task id; a retry under another claim name leaves the first
name's marker cleared, and a pool child killed mid-run whose message is not delivered
again has its marker cleared by the worker's main process. The marker expires after
``claim_enqueue_ttl`` (counted from the message's ``eta`` when it has one), so a message
that is lost never blocks its name for longer. While a run holds its claim
(``until_finished``), the marker lives as its lease does: the run's acquire gives it the
lease's ttl and each renewal extends it, so a marker whose deletion was lost (a failover
that forgot the release, a run that died unreleased) frees the name within one ttl.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from redis.exceptions import DataError, ResponseError

from .._errors import ConfigError
from .._lease import ClaimKeys
from .._printable import printable
from .._scripts import Script, as_text, command

__all__ = [
    "ENQUEUE_TTL",
    "MAX_TASK_ID",
    "MODES",
    "check_mode",
    "check_ttl",
    "clear",
    "expiry_ms",
    "is_task_id",
    "mark",
    "stored_task_id",
]

#: The modes: the marker lasts until the run starts, or until it ends.
MODES = ("until_started", "until_finished")
#: How long a marker lives by default: an hour (after the message's eta, if any).
ENQUEUE_TTL = 3600.0
#: The longest task id a marker may hand back (Celery's own are uuids, 36 characters).
MAX_TASK_ID = 255

# KEYS[1] marker; ARGV[1] the new message's task id, ARGV[2] expiry (ms), ARGV[3] the
# task id of the run publishing ("" outside a run). A marker held by that run (a retry,
# a rerun, a run sending its successor) hands over to the new message. Returns the
# task id of the message already queued, or nil when the new one is to be published.
# Sent only when a plain SET NX GET cannot say (see mark).
MARK = Script(
    "enqueue_mark",
    """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[1] and current ~= ARGV[3] then
  return current
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
""",
)

# KEYS[1] marker; ARGV[1] task id; ARGV[2] new expiry (ms), or "" to delete. Only a
# marker holding this task id is touched. Returns 1 if it was, else 0.
CLEAR = Script(
    "enqueue_clear",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] == '' then
  return redis.call('DEL', KEYS[1])
end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
""",
)


def check_mode(value: Any) -> str | None:
    """A ``claim_enqueue`` value: one of MODES, or None (no deduplication at enqueue)."""
    if value is None or value in MODES:
        return value  # type: ignore[no-any-return]
    raise ConfigError(
        f"claim_enqueue={value!r} is not a mode: use 'until_started' (a message "
        "per name while one is queued) or 'until_finished' (also while it runs), or None"
    )


def check_ttl(value: Any) -> float:
    """A ``claim_enqueue_ttl``: seconds, more than zero."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"claim_enqueue_ttl={value!r} must be a number of seconds > 0 (how long "
            "a lost message may block its name), e.g. 3600"
        )
    return float(value)


def expiry_ms(ttl: float, options: Mapping[str, Any]) -> int:
    """The marker's lifetime: ``ttl`` after the message is due (its countdown or eta)."""
    wait = 0.0
    countdown, eta = options.get("countdown"), options.get("eta")
    if countdown is not None:
        wait = float(countdown)
    elif eta is not None:
        when = datetime.fromisoformat(eta) if isinstance(eta, str) else eta
        if when.tzinfo is None:  # Celery reads a naive eta as UTC by default
            when = when.replace(tzinfo=timezone.utc)
        wait = when.timestamp() - time.time()
    return max(1, int((max(0.0, wait) + ttl) * 1000))


def mark(
    client: Any, keys: ClaimKeys, task_id: str, expiry: int, running: str | None
) -> str | None:
    """Mark the name for ``task_id``; the task id already queued when it is marked.

    A marker that holds what fenced never writes (not text, not a task id: see
    :func:`is_task_id`) raises a RedisError naming its key, as a Redis that cannot be
    reached does (the caller then sends unmarked, and its run's claim still keeps a
    second run out).
    """
    try:
        found = _mark(client, keys.queued, task_id, expiry, running or "")
    except UnicodeDecodeError:  # read while it decided
        raise _not_written(keys.queued, "the enqueue marker", _NOT_UTF8) from None
    except ResponseError as exc:
        # (a script's error on Redis before 7.0 starts with where the script failed)
        if "WRONGTYPE" not in str(exc):
            raise  # READONLY, OOM...: the caller's to handle as any refusal
        problem = "is not a string holding a task id"
        raise _not_written(keys.queued, "the enqueue marker", problem) from None
    return stored_task_id(found, keys.queued) if found else None


def stored_task_id(value: Any, key: str, what: str = "the enqueue marker") -> str:
    """A task id read from ``key`` (``what`` it is, for the error), before it is handed
    to a caller as its result's id: a DataError naming the key when the value is not
    one fenced writes (see :func:`is_task_id`), as a Redis that cannot be reached raises
    a RedisError (the caller then sends its call as it is)."""
    try:
        text = as_text(value)
    except UnicodeDecodeError:
        problem = _NOT_UTF8
    else:
        if is_task_id(text):
            return text
        # Not a task id fenced wrote: never a caller's result id, nor raw text in a log.
        problem = f"holds {printable(text[:80])!r}, not a task id"
    raise _not_written(key, what, problem)


_NOT_UTF8 = "holds a value that is not UTF-8, not a task id"


def _not_written(key: str, what: str, problem: str) -> DataError:
    shown = printable(key)
    return DataError(
        f"{what} {shown!r} {problem}; fenced did not write it. Delete it (DEL {shown})"
    )


def _mark(client: Any, key: str, task_id: str, expiry: int, running: str) -> Any:
    """What MARK answers. A free name (the common case) is marked by one plain
    ``SET NX PX GET`` (Redis 7.0 and later), which also reads a marker that is there; only
    a marker this call may take over (its own task id, or the run's) goes on to MARK,
    which checks it again as it writes. A server older than 7.0 refuses NX with GET: its
    client sends MARK from then on."""
    if not getattr(client, "_fenced_mark_by_script", False):
        try:
            found = command(client, "SET", key, task_id, "NX", "PX", expiry, "GET", get=True)
        except ResponseError as exc:
            if "syntax error" not in str(exc):
                raise
            try:
                client._fenced_mark_by_script = True
            except AttributeError:  # a client that takes no attributes: asked every time
                pass
        else:
            if found is None or as_text(found) not in (task_id, running):
                return found
    return MARK(client, [key], [task_id, expiry, running])


def is_task_id(value: str) -> bool:
    """Whether a marker's value can be a task id: printable, at most MAX_TASK_ID long."""
    return 0 < len(value) <= MAX_TASK_ID and value.isprintable()


def clear(client: Any, keys: ClaimKeys, task_id: str, expiry: int | None = None) -> bool:
    """Delete the marker (or give it a new expiry) if it still holds ``task_id``."""
    return bool(CLEAR(client, [keys.queued], [task_id, "" if expiry is None else expiry]))

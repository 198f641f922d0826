"""Debounce (``claim_debounce``): the calls of one claim name coalesce into one run.

A burst is the calls of one name until its run takes them. The first call of a burst
writes the name's burst record (``{namespace}:{name}:debounce``, a hash under the name's
hash tag: the burst's task id, the times of its first and last call, the last call, and
for ``fenced ls`` how many calls joined and when it is due) and
publishes one message under the burst's task id, due ``claim_debounce`` later; every
later call only rewrites the last call and its time, and returns the same task id
(:func:`join`, one script). So a burst has one message in the broker however many calls
it has, and each call costs one round trip.

When the message is delivered, one script (:func:`take`) compares Redis's clock with
the burst's due time, ``min(last + claim_debounce, first + claim_debounce_max)``: not
yet due, or the name still held by a run, and the message is published again under the
same task id for the time left (:func:`defer`: not counted as a retry); else the burst
closes, its last call is kept under the task id (``...:debounce:<task id>``, for a
redelivery of the same message) and the run takes the claim with that call's
arguments. A call arriving after that starts the next burst, whose message waits while
the run holds the name.

A burst is one task's: the record names it, and a call of another task sharing the
name is not joined (sent as it is). The stored call is data whoever can write the
claims' Redis could plant, so it is encoded and checked as rerun triggers are
(:mod:`fenced.celery._rerun`: signed with the app's secret key together with the task
and the kind, size and depth capped, the call must give the name); one refused is
dropped (counted ``debounce_dropped``) and the run takes its message's own arguments.
The burst id a join returns is checked as the enqueue marker's is
(:func:`fenced.celery._enqueue.stored_task_id`).

The record says whether its message was published (the opener marks it once its
publish returns). The first call that joins a burst still unmarked publishes a backup of
its message under the burst's task id, due ``claim_debounce_max`` (else
``claim_debounce``) after the burst opened; a call that joins a burst still unmarked
that long after it opened publishes the message itself. A sender that died between its
join and its publish delays the burst, never loses it, whether calls come after it or
not (a message of the burst's task id that comes twice runs once: the claim's done
marker). A healthy burst sends no backup: its opener marks it within its own call.

What a Redis restart (or failover to a replica that lags) can lose: a burst record
not yet persisted. Its message then runs with its own arguments, the first call's of its
burst (the later calls' arguments are lost, the run is not); calls after the restart
start a new burst, so the name may run twice. A burst record whose message never comes
(the broker lost it after accepting it) expires ``claim_debounce_max`` plus
``claim_enqueue_ttl`` after its first call (without a max, ``claim_debounce`` plus
``claim_enqueue_ttl`` after its last): until then, calls join it and wait in vain.

A message carries the caller's ``expires`` when it is published again (the same absolute
time). One whose wait would end after it is not published again to be discarded then:
it ends as Celery ends an expired message (``REVOKED``), and its burst record (or the
call its run took) goes with it, so the next call opens a new burst
(:func:`expired_by`, :func:`forget`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any

import redis
from celery.exceptions import Retry
from celery.utils.time import maybe_iso8601, maybe_make_aware
from kombu.utils.uuid import uuid

from .._audit import claim_fields
from .._errors import ClaimUnavailable, ConfigError
from .._lease import ClaimKeys
from .._scripts import Script, as_text
from . import _enqueue, _rerun

__all__ = [
    "check",
    "defer",
    "delivered",
    "expired_by",
    "forget",
    "join",
    "join_call",
    "send",
    "take",
]

log = logging.getLogger("fenced.celery")

#: Shortest wait before a message looks at its burst again, seconds.
MIN_WAIT = 0.05
#: Longest wait while the name is held, seconds: how late, at most, the next burst
#: starts after a run that holds the name ends (for a debounce shorter than this).
HELD_POLL = 1.0
#: Options that do not go with a debounce, and why.
_CONTRADICTS = {
    "claim_enqueue": "claim_enqueue drops calls while one is queued, claim_debounce "
    "coalesces them into the last: use one",
    "claim_cooldown": "claim_cooldown skips a run inside its window, which would lose "
    "the burst's calls",
}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

# KEYS[1] the burst record; ARGV[1] a new task id, ARGV[2] the call, ARGV[3] the
# record's expiry (ms; counted from the burst's first call when there is a debounce
# max, else from this call), ARGV[4] the debounce (ms), ARGV[5] the debounce max (ms, 0:
# none), ARGV[6] the calling task's name, ARGV[7] how long a burst's message may go
# unconfirmed before a call takes its publishing over (ms). Returns {task id of the
# burst, what this call does}: 1 it opened the burst (publish its message), 0 it joined
# it, 2 the open burst is another task's (or names none: an older fenced's), so this
# call is not joined (send it as it is), 3 it joined a burst whose message its opener
# never confirmed as published in time (a sender that died or hung): publish it
# under the burst's task id, 4 it joined a burst whose message is not confirmed yet and
# is the first to: publish a backup of it under the burst's task id, due when a call
# would take its publishing over (the third item, ms), so that the burst runs even if
# its opener died and no call comes after (a message of the burst's task id that comes
# twice runs once: the claim's done marker). The record's ``due`` (when the burst runs if
# no call joins it, ms) and ``calls`` (how many joined) are for the operator tools: TAKE
# decides from first and last.
JOIN = Script(
    "debounce_join",
    """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local b = redis.call('HMGET', KEYS[1], 'id', 'first', 'calls', 'task', 'sent', 'opened',
                     'backup')
local id, first = b[1], tonumber(b[2]) or now
local new = 0
local backup_in = 0
if not id then
  id = ARGV[1]
  first = now
  new = 1
  redis.call('HSET', KEYS[1], 'id', id, 'first', now, 'task', ARGV[6], 'sent', '0',
             'opened', now)
elseif b[4] ~= ARGV[6] then
  return {id, 2}
elseif b[5] ~= '1' and now - (tonumber(b[6]) or first) >= tonumber(ARGV[7]) then
  -- its opener never said its message was published: this call publishes it, and
  -- the next one waits as long again for this one to say so
  new = 3
  redis.call('HSET', KEYS[1], 'opened', now)
elseif b[5] ~= '1' and not b[7] then
  -- not confirmed yet: the first call to join sends a backup, due when a call would
  -- take the publishing over (its opener may have died, and no call may come then)
  new = 4
  backup_in = math.max(0, (tonumber(b[6]) or first) + tonumber(ARGV[7]) - now)
  redis.call('HSET', KEYS[1], 'backup', now)
end
local due = now + tonumber(ARGV[4])
if tonumber(ARGV[5]) > 0 then
  due = math.min(due, first + tonumber(ARGV[5]))
end
local calls = new == 1 and 1 or (tonumber(b[3]) or 0) + 1
redis.call('HSET', KEYS[1], 'last', now, 'call', ARGV[2], 'due', string.format('%d', due),
           'calls', string.format('%d', calls))
local expiry = tonumber(ARGV[3])
if tonumber(ARGV[5]) > 0 then
  -- joins never push it out: a record whose message never comes goes in time
  expiry = math.max(1, first + expiry - now)
end
if redis.call('PTTL', KEYS[1]) < expiry then
  -- (never shortened: its message keeps it while a run holds the name)
  redis.call('PEXPIRE', KEYS[1], expiry)
end
return {id, new, backup_in}
""",
)

# KEYS[1] the burst record; ARGV[1] the task id of a burst whose message was published.
# Marks the record's message as published if the record is still that burst's.
# Returns 1 if it was, else 0.
SENT = Script(
    "debounce_sent",
    """
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'sent', '1')
return 1
""",
)

# KEYS[1] the burst record, KEYS[2] the call taken by this task id, KEYS[3] the name's
# lease; ARGV[1] the delivered task id, ARGV[2] debounce (ms), ARGV[3] debounce max (ms,
# 0: none), ARGV[4] how long a taken call is kept (ms), ARGV[5] the longest wait while
# the name is held (ms), ARGV[6] how long the record outlives a wait (ms). Returns
# {'wait', ms} while the burst is not due or the name is held (the record then kept
# at least ARGV[6] past the wait, so a long run holding the name never outlives it),
# {'run', call} once it is taken (again, for a redelivery), {'own'} when this task id
# has no burst (a message not debounced, or a record lost).
TAKE = Script(
    "debounce_take",
    """
local b = redis.call('HMGET', KEYS[1], 'id', 'first', 'last', 'call')
if b[1] == ARGV[1] then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local due = (tonumber(b[3]) or 0) + tonumber(ARGV[2])
  if tonumber(ARGV[3]) > 0 then
    due = math.min(due, (tonumber(b[2]) or 0) + tonumber(ARGV[3]))
  end
  local wait = due - now
  local held = redis.call('PTTL', KEYS[3])
  if held > 0 then
    wait = math.max(wait, math.min(held, tonumber(ARGV[5])))
  end
  if wait > 0 then
    if redis.call('PTTL', KEYS[1]) < wait + tonumber(ARGV[6]) then
      redis.call('PEXPIRE', KEYS[1], wait + tonumber(ARGV[6]))
    end
    return {'wait', wait}
  end
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], b[4] or '', 'PX', ARGV[4])
  return {'run', b[4] or ''}
end
local taken = redis.call('GET', KEYS[2])
if taken then
  return {'run', taken}
end
return {'own'}
""",
)


# KEYS[1] the burst record; ARGV[1] the task id of a burst whose message was not sent.
# Deletes the record if it is still that burst's. Returns 1 if it was, else 0.
ABANDON = Script(
    "debounce_abandon",
    """
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then
  return 0
end
return redis.call('DEL', KEYS[1])
""",
)


# KEYS[1] the burst record, KEYS[2] the call taken by ARGV[1]'s run; ARGV[1] the task id
# of a message that expired before its start. Deletes the record if it is still that
# message's burst (calls that come next open a new one), and the call it took.
# Returns how many keys were deleted.
FORGET = Script(
    "debounce_forget",
    """
local gone = 0
if redis.call('HGET', KEYS[1], 'id') == ARGV[1] then
  gone = redis.call('DEL', KEYS[1])
end
return gone + redis.call('DEL', KEYS[2])
""",
)


def seconds(value: Any, option: str) -> float:
    """A duration option: seconds (> 0), or text such as ``"300ms"``, ``"5s"``, ``"1m"``."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        found = _DURATION.match(value)
        if found:
            number = float(found.group(1)) * _UNITS[found.group(2)]
    if number is None or not 0 < number < float("inf"):
        raise ConfigError(
            f"{option}={value!r} is not a duration > 0: give seconds or a number "
            "with ms, s, m or h, e.g. 0.5, '300ms', '5s', '1m'"
        )
    return number


def check(values: Mapping[str, Any]) -> dict[str, Any]:
    """The debounce options cleaned; ConfigError for a bad one or a contradiction among
    ``values`` (the options given so far: a task's own, or all of them resolved)."""
    out: dict[str, Any] = {}
    debounce, most = values.get("claim_debounce"), values.get("claim_debounce_max")
    if debounce is not None:
        out["claim_debounce"] = debounce = seconds(debounce, "claim_debounce")
    if most is not None:
        out["claim_debounce_max"] = most = seconds(most, "claim_debounce_max")
        if debounce is None:
            raise ConfigError("claim_debounce_max caps a debounce: give claim_debounce too")
        if most < debounce:
            raise ConfigError(
                f"claim_debounce_max={most:g}s is shorter than claim_debounce="
                f"{debounce:g}s: a burst runs at most claim_debounce_max after its first call, "
                "so it must be at least the debounce"
            )
    if debounce is None:
        return out
    for option, why in _CONTRADICTS.items():
        if values.get(option):
            raise ConfigError(f"claim_debounce with {option}: {why}")
    on_busy = values.get("claim_on_busy")
    if on_busy is not None and on_busy != "retry":
        raise ConfigError(
            f"claim_debounce with claim_on_busy={on_busy!r}: a debounced run that "
            "finds its name busy waits for it (claim_on_busy='retry', the default with a "
            "debounce); any other policy would lose the burst's calls"
        )
    limit = values.get("claim_limit")
    if limit is not None and limit != 1:
        raise ConfigError(
            f"claim_debounce with claim_limit={limit!r}: a burst is one run at a "
            "time of its name; give claim_limit=1"
        )
    return out


def join(
    client: Any,
    keys: ClaimKeys,
    task_id: str,
    call: str,
    expiry: float,
    debounce: float,
    most: float | None = None,
    task: str = "",
) -> tuple[str, int]:
    """Add a call of ``task`` to the name's burst: (the burst's task id, what the call
    does: OPENED, JOINED, NOT_JOINED, TAKEN_OVER or BACKUP). A burst id that is not one
    fenced writes raises a DataError (the caller sends its call as it is)."""
    burst, what, _backup_in = join_call(client, keys, task_id, call, expiry, debounce, most, task)
    return burst, what


def join_call(
    client: Any,
    keys: ClaimKeys,
    task_id: str,
    call: str,
    expiry: float,
    debounce: float,
    most: float | None = None,
    task: str = "",
) -> tuple[str, int, float]:
    """:func:`join`, and for BACKUP the seconds its backup message is due in."""
    found = JOIN(
        client,
        [keys.debounce],
        [
            task_id,
            call,
            max(1, int(expiry * 1000)),
            int(debounce * 1000),
            int((most or 0) * 1000),
            task,
            max(1, int((most or debounce) * 1000)),
        ],
    )
    burst = _enqueue.stored_task_id(found[0], keys.debounce, "the burst record")
    backup_in = int(found[2]) / 1000 if len(found) > 2 else 0.0
    return burst, int(found[1]), backup_in


#: What :func:`join` says a call does.
JOINED, OPENED, NOT_JOINED, TAKEN_OVER, BACKUP = 0, 1, 2, 3, 4


def take(
    client: Any,
    keys: ClaimKeys,
    task_id: str,
    debounce: float,
    most: float | None,
    keep: float,
    outlive: float = 3600.0,
) -> tuple[str, Any]:
    """What the message ``task_id`` does: ("wait", seconds), ("run", the call's text), or
    ("own", None): run with the message's own arguments."""
    found = TAKE(
        client,
        # the name's open burst, the call this task id's run took (for a redelivery)
        [keys.debounce, f"{keys.debounce}:{task_id}", keys.lock],
        [
            task_id,
            int(debounce * 1000),
            int((most or 0) * 1000),
            max(1, int(keep * 1000)),
            int(max(debounce, HELD_POLL) * 1000),
            max(1, int(outlive * 1000)),
        ],
    )
    what = as_text(found[0])
    if what == "wait":
        return what, max(MIN_WAIT, int(found[1]) / 1000)
    if what == "run":
        return what, as_text(found[1])
    return "own", None


def expiry(task: Any) -> datetime | None:
    """When the running message expires (its ``expires``, timezone-aware, read as the
    worker reads it); None without one, or for a call run in its caller's process."""
    request = task.request
    value = getattr(request, "expires", None)
    if not value or request.called_directly or request.is_eager:
        return None
    try:
        when = maybe_iso8601(value) if isinstance(value, str) else value
        if not isinstance(when, datetime):
            return None
        aware: datetime = maybe_make_aware(when, task.app.conf.timezone)
    except (TypeError, ValueError):
        return None
    return aware


def expired_by(task: Any, seconds: float) -> datetime | None:
    """The running message's expiry when a start ``seconds`` from now comes after it (a
    message published again for then would be discarded as expired); else None."""
    when = expiry(task)
    if when is None or datetime.now(timezone.utc) + timedelta(seconds=seconds) <= when:
        return None
    return when


def forget(task: Any, keys: ClaimKeys) -> None:
    """A message of a debounced task expired before its start: its burst record (if it
    is still its burst's) and the call its run took go, so the next call opens a new
    burst. A failure is logged: the record expires by itself."""
    task_id = task.request.id
    try:
        FORGET(_client(task), [keys.debounce, f"{keys.debounce}:{task_id}"], [task_id])
    except Exception:
        log.warning(
            "fenced: could not clear the burst of %r as %s[%s] expired; it expires by itself",
            keys.name,
            task.name,
            task_id,
            exc_info=True,
            extra=claim_fields(keys.name),
        )


def send_again(task: Any, seconds: float) -> Any:
    """Publish the running message again under its task id, due in ``seconds``, with its
    retry count unchanged (as ``self.retry`` sends it, canvas options included, but not
    counted against max_retries); the signature sent. Its ``expires`` stays the one it
    was published with (the same absolute time): callers first make sure the start
    comes before it (:func:`expired_by`)."""
    sig = task.signature_from_request(task.request, countdown=seconds)
    sig.apply_async()
    return sig


def defer(task: Any, seconds: float, keys: ClaimKeys, why: str = "") -> Retry:
    """Publish the running message again (:func:`send_again`); the Retry to raise
    (Celery then acknowledges this delivery).

    A message whose wait would end after its ``expires`` is not published again: its
    burst (``keys``: the claim's) is forgotten and the delivery ends as an expired one
    (the task's ``_expire`` raises; ``why`` says what it waits for)."""
    expires = expired_by(task, seconds)
    if expires is not None:
        forget(task, keys)
        task._expire("its debounced start", seconds, expires, why, keys)
    sig = send_again(task, seconds)
    when: Any = seconds  # Celery's stubs ask for a numbers.Real
    return Retry(when=when, sig=sig)


# -- the task's two ends: a call, a delivery ------------------------------------------


def _client(task: Any) -> Any:
    # The task's own (fenced.celery._options, which checks this module's options).
    return task._lock_client()


def send(
    task: Any,
    args: Any,
    kwargs: Any,
    options: dict[str, Any],
    publish: Callable[..., Any],
    count: Callable[[str], None],
) -> Any:
    """A call of a debounced task: joins its name's burst (the burst's AsyncResult), or
    opens one and publishes its message, due ``claim_debounce`` later (or publishes the
    message of a burst whose opener never said it did, under the burst's task id).

    A call JSON cannot carry (or larger than a trigger may be) is published as it is,
    not coalesced, and so is one when the claims' Redis cannot be reached, and one while
    the name's open burst is another task's (tasks sharing a name debounce apart: a
    call never joins, nor runs as, another task's burst).
    """
    opts = task._options()
    args, kwargs = tuple(args or ()), dict(kwargs or {})
    name = task.claim_name_for(args, kwargs)
    call = _rerun.encode(args, kwargs, name, task._rerun_key(), task.name, _rerun.DEBOUNCE)
    if _rerun.is_own(call):
        log.warning(
            "fenced: %s sent as it is, not debounced: its arguments are not JSON, or larger "
            "than %d bytes",
            task.name,
            _rerun.MAX_BYTES,
            extra=claim_fields(name),
        )
        return publish(args, kwargs, **options)
    keys = ClaimKeys(opts.claim.namespace, name)
    debounce, most = opts.values["claim_debounce"], opts.values["claim_debounce_max"]
    client = _client(task)
    try:
        expiry = (most or debounce) + opts.enqueue_ttl
        burst, what, backup_in = join_call(
            client, keys, uuid(), call, expiry, debounce, most, task.name
        )
    except (redis.RedisError, OSError) as exc:
        log.warning(
            "fenced: could not debounce %r (%s): sending %s as it is",
            name,
            exc,
            task.name,
            extra=claim_fields(name),
        )
        return publish(args, kwargs, **options)
    if what == NOT_JOINED:
        log.info(
            "fenced: %r has an open burst of another task: sending %s as it is",
            name,
            task.name,
            extra=claim_fields(name),
        )
        return publish(args, kwargs, **options)
    if what == JOINED:
        count("debounced")
        return task.AsyncResult(burst)
    countdown = debounce
    if what == BACKUP:
        # joined; the burst's message is not confirmed yet: a backup of it, due when a
        # call would take its publishing over
        count("debounced")
        countdown = backup_in
    if what == TAKEN_OVER:
        count("debounced")
        log.warning(
            "fenced: the burst %s of %r was never confirmed published (its sender died or "
            "hung): %s publishes it",
            burst,
            name,
            task.name,
            extra=claim_fields(name),
        )
    # (countdown and eta are None here.) No expiry, not even the task's default: the
    # message is published again while its burst waits, and one that expired would
    # leave the burst with no message.
    options = {k: v for k, v in options.items() if k not in ("countdown", "eta", "expires")}
    try:
        sent = publish(args, kwargs, burst, countdown=countdown, expires=None, **options)
    except BaseException as exc:
        if what == BACKUP and isinstance(exc, Exception):
            # The call joined: the burst's own message (or a later call) runs it.
            log.warning("fenced: could not send a backup of the burst of %r", name, exc_info=True)
            return task.AsyncResult(burst)
        if what == OPENED:
            try:  # the calls that join it would wait for a message that never comes
                ABANDON(client, [keys.debounce], [burst])
            except Exception:
                log.warning(
                    "fenced: could not abandon the burst of %r; it expires", name, exc_info=True
                )
        raise
    try:  # a later call no longer takes its publishing over
        SENT(client, [keys.debounce], [burst])
    except Exception:
        log.warning(
            "fenced: could not mark the burst of %r published; a later call may publish it again",
            name,
            exc_info=True,
        )
    return sent


def delivered(
    task: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    count: Callable[[str], None],
    unsigned: Callable[[str], None],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call a delivered message runs with: its burst's last (set on the request),
    or its own; raises the Retry of a message published again (not due yet, or its name
    is held), or ClaimUnavailable."""
    opts = task._options()
    request = task.request
    name = task.claim_name_for(args, kwargs)
    keys = ClaimKeys(opts.claim.namespace, name)
    try:
        what, value = take(
            _client(task),
            keys,
            request.id,
            opts.values["claim_debounce"],
            opts.values["claim_debounce_max"],
            opts.claim.redelivery_window,
            opts.enqueue_ttl,
        )
    except (redis.RedisError, OSError) as exc:
        raise ClaimUnavailable(f"could not read the burst of {name!r}: {exc}", name=name) from exc
    if what == "wait":
        why = "its burst is not due yet, or its name is held"
        deferred = defer(task, value, keys, why)
        count("debounce_deferred")
        raise deferred
    if what == "own":
        return args, kwargs
    key = task._rerun_key()
    try:
        args, kwargs = _rerun.checked(
            value, name, key, task.claim_name_for, None, task.name, _rerun.DEBOUNCE
        )
    except Exception as exc:
        why = _rerun.why(exc)
        count("debounce_dropped")
        # Its text is not logged: a genuine call's arguments may be secret.
        log.warning(
            "fenced: dropped the stored call of a burst of %r (%s; %d characters): "
            "%s[%s] runs with its message's arguments",
            name,
            why,
            len(value),
            task.name,
            request.id,
            extra=claim_fields(name),
        )
        return args, kwargs
    if key is None:
        unsigned(name)
    # The body, a retry and the result's record see the call that runs.
    request.args, request.kwargs = args, kwargs
    return args, kwargs

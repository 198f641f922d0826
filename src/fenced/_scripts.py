"""The Lua scripts behind every claim operation, registered once and run with EVALSHA.

Each constant states its KEYS, ARGV and return value. Every key a script touches is
one claim's key and shares that claim's hash tag (a ``fenced.Lock``'s fence key shares
its name's slot), so the scripts run on Redis Cluster.
Release and refresh compare the owner token first and never touch a claim held under
another token.

The fence is minted inside ACQUIRE and TAKEOVER, the same way:
``max(previous fence + 1, Redis TIME in µs)``, in one write with the idle expiry. The
``TIME`` floor keeps it strictly increasing even after a restart of a Redis that keeps
nothing on disk, as long as the server clock moves forward. Fences are decimal text in
the scripts, added to and compared as text (``_FENCE``): Lua's numbers are doubles,
exact only below 2^53, and a fence key can hold more. A fence key that holds anything
but an integer from 0 to 2^63-2 grants nothing: the script answers an error instead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import redis
from redis.exceptions import NoScriptError
from redis.sentinel import SentinelConnectionPool

__all__ = [
    "ACQUIRE",
    "BEAT_DISPATCH",
    "BEAT_SENT",
    "FORCE_RELEASE",
    "HANDOVER",
    "LOCK_ACQUIRE",
    "LOCK_RELEASE",
    "RATE_UNBOOK",
    "RECORD",
    "REFRESH",
    "RELEASE",
    "REPLACE",
    "RERUN_SENT",
    "STREAK_ENTRIES",
    "TAKEOVER",
    "TOKEN_PATTERN",
    "Script",
]

#: The one definition of an owner token, read by the scripts (Lua ``string.match``) and
#: by Python (``re.fullmatch``, with DOTALL as Lua's ``.``): ``random:host:pid:task id``.
#: The pattern is written in the subset both languages read alike; only the task id may
#: contain ``:``, so the host has its colons replaced when the token is made.
TOKEN_PATTERN = "^([^:]*):([^:]*):([^:]*):(.*)$"


def as_text(value: Any) -> str:
    """A Redis reply as text, whether the client decodes responses or not."""
    return value.decode() if isinstance(value, bytes) else str(value)


class Script:
    """A Lua script with its SHA1 computed once; EVALSHA first, EVAL on a cold cache."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name
        # The token's one definition, spelled into the script as a Lua string literal.
        self.source = source.replace("TOKEN_PATTERN", repr(TOKEN_PATTERN))
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def __call__(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """Run on a client (one round trip when the server already has the script)."""
        try:
            if _pack is not None and _packable(client):
                return _send_one(client, _pack(("EVALSHA", self.sha, len(keys), *keys, *args)))
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            # EVAL also caches the script, so the next call is an EVALSHA hit again.
            return client.eval(self.source, len(keys), *keys, *args)


Call = tuple[Script, Sequence[str], Sequence[Any]]


_pack: Any
try:  # hiredis packs a command in C, ten times faster than redis-py's packer
    from hiredis import pack_command as _pack
except ImportError:  # pragma: no cover - hiredis comes with the default extras
    _pack = None


_PACKABLE_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool, SentinelConnectionPool)


def _packable(client: Any) -> bool:
    """A plain client over a standard pool, speaking RESP2 in UTF-8: its commands are
    packed here (hiredis encodes text as UTF-8, as redis-py does by default)."""
    # A single-connection client keeps its one connection: it goes through redis-py.
    if type(client) is not redis.Redis or client.connection is not None:
        return False
    pool: Any = client.connection_pool
    # What the pool says is read once per pool: every script call of a claim asks.
    known: bool | None = getattr(pool, "_fenced_packable", None)
    if known is None:
        kwargs = pool.connection_kwargs
        known = (
            type(pool) in _PACKABLE_POOLS
            and kwargs.get("protocol") in (None, 2, "2")
            and str(kwargs.get("encoding", "utf-8")).lower() in ("utf-8", "utf8")
        )
        try:
            pool._fenced_packable = known
        except AttributeError:  # a pool that takes no attributes: asked every time
            pass
    return known


def command(client: Any, *args: Any, **options: Any) -> Any:
    """One plain command, packed here as a script call is (see :func:`_packable`); its
    raw reply. Any other client parses the reply with ``options`` (redis-py's response
    callbacks read them: ``get=True`` for a ``SET ... GET``)."""
    if _pack is not None and _packable(client):
        return _send_one(client, _pack(args))
    return client.execute_command(*args, **options)


def _send_one(client: Any, packed: bytes) -> Any:
    """What ``execute_command`` does for one command, without its per-call overhead: a
    connection from the pool, the client's retries (a connection error reconnects and
    sends again), and the reply (an error reply raised, the connection kept)."""
    pool = client.connection_pool
    conn = pool.get_connection()

    def send() -> Any:
        conn.send_packed_command([packed])
        return conn.read_response()

    try:
        return conn.retry.call_with_retry(send, lambda _error: conn.disconnect())
    except redis.ResponseError:
        raise  # the whole reply was read: the connection stays usable
    except BaseException:
        # A reply may be left unread: this connection must not be used again.
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _send_packed(client: Any, calls: Sequence[Call], wait: tuple[int, int] | None) -> list[Any]:
    """What a non-transactional pipeline does, on one connection: packed in one buffer,
    the replies read in order, an error reply in place of its result."""
    from redis.exceptions import ConnectionError, ResponseError, TimeoutError

    assert _pack is not None
    parts = [
        _pack(("EVALSHA", script.sha, len(keys), *keys, *args)) for script, keys, args in calls
    ]
    if wait is not None:
        parts.append(_pack(("WAIT", *wait)))
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command([b"".join(parts)])
        replies: list[Any] = []
        for _ in calls:
            try:
                replies.append(conn.read_response())
            except ResponseError as exc:
                replies.append(exc)
        if wait is not None:
            try:
                replies.append(conn.read_response())
            except (ConnectionError, TimeoutError, OSError, ResponseError) as exc:
                # The scripts' replies are in; only the acknowledgement is missing.
                if not isinstance(exc, ResponseError):
                    conn.disconnect()
                replies.append(exc)
        return replies
    except BaseException:
        # Replies may be left unread: this connection must not be used again.
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def run_pipeline(
    client: Any, calls: Sequence[Call], *, wait: tuple[int, int] | None = None
) -> list[Any]:
    """Run many script calls in one round trip; errors come back in place of results.

    With ``wait=(replicas, timeout_ms)``, a ``WAIT`` follows the calls on the same
    connection, and its answer (how many replicas acknowledged every write before it)
    is the last item of the result. When the server has lost its script cache (a
    restart), the scripts are loaded and the batch is sent once more.
    """
    for attempt in (1, 2):
        result: list[Any]
        if _pack is not None and _packable(client):
            result = _send_packed(client, calls, wait)
        else:
            pipe = client.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            if wait is not None:
                pipe.execute_command("WAIT", *wait)
            result = pipe.execute(raise_on_error=False)
        if attempt == 2 or not any(isinstance(r, NoScriptError) for r in result):
            return result
        for source in {script.source for script, _k, _a in calls}:
            client.script_load(source)
    raise AssertionError("unreachable")


# Every script that writes a name's lasting keys (fence, records, skips, rerun) gives them
# the name's idle expiry (ms, 0 = never), so the keys of a name nobody uses any more go
# away; the TIME floor keeps the fence increasing after its key expired.
_TOUCH = """
local function touch(idle, ...)
  if idle > 0 then
    for _, key in ipairs({...}) do redis.call('PEXPIRE', key, idle) end
  end
end
"""

# Fences as text: a fence key's value is used only when it is a decimal integer from 0 to
# 2^63-2 (no sign, no leading zero, so the next fence still fits a signed 64-bit
# column); anything else (a float, "nan", a sign, 2^63-1 and above) mints nothing.
# Fewer than 16 digits are below 2^53, where Lua's doubles are exact.
_FENCE = """
local function fence_ok(v)
  if v == '0' then return true end
  if #v > 19 or not string.match(v, '^[1-9]%d*$') then return false end
  return #v < 19 or v < '9223372036854775807'
end
local function fence_below(a, b)
  if #a ~= #b then return #a < #b end
  return a < b
end
local function fence_after(v)
  if #v < 16 then return string.format('%d', tonumber(v) + 1) end
  local i = #v
  while i > 0 and string.byte(v, i) == 57 do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #v) end
  return string.sub(v, 1, i - 1) .. string.char(string.byte(v, i) + 1) ..
         string.rep('0', #v - i)
end
local function fence_clock()
  local t = redis.call('TIME')
  return t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
end
local function not_a_fence(key)
  return redis.error_reply('ERR ' .. key .. ' holds what is not a fence (0 to 2^63-2)')
end
"""

# A records key someone replaced with another type cannot take an LPUSH: a script
# checks it before its first write, so it either records nothing or stops with nothing
# written.
_RECORDABLE = """
local function unrecordable(key)
  local kind = redis.call('TYPE', key).ok
  if kind == 'list' or kind == 'none' then return nil end
  return kind
end
local function not_a_list(key, kind)
  return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. kind ..
                           ', not a list of run records')
end
"""

#: How many of a name's newest run records tell whether a run started since its last
#: skip: the scripts read as many when they count a skip, and so does what shows the
#: count (``records.skip_streak``), so that both say the same.
STREAK_ENTRIES = 4

# The skip count is of skips in a row: those since a run last started (or ended ok:
# RELEASE deletes the count then). ``count_skip`` counts one and answers the count, or
# nil and an error reply when the records key holds another type (nothing written). The
# newest entries of the records list (the first of them that is a start or a skip) say
# whether a run started since the last skip: then the count begins again at 1, whatever
# an earlier holder's skips left in it. Its LRANGE takes the place of the records key's
# TYPE check (a key of another type answers WRONGTYPE); a count left from before the
# start is set back with a command more, only when there is one. Needs _RECORDABLE.
_STREAK = (
    """
local function count_skip(records, skips)
  local recent = redis.pcall('LRANGE', records, 0, """
    + str(STREAK_ENTRIES - 1)
    + """)
  if recent.err then
    local bad = unrecordable(records)
    if bad then return nil, not_a_list(records, bad) end
    return nil, recent
  end
  local count = redis.call('INCR', skips)
  if count > 1 then
    for _, entry in ipairs(recent) do
      -- an entry's fields: its JSON object, up to the newline (cjson escapes any other)
      local head = string.sub(entry, 1, (string.find(entry, '\\n', 1, true) or 0) - 1)
      if string.find(head, '"event":"started"', 1, true) then
        redis.call('SET', skips, '1')
        return 1
      end
      if string.find(head, '"event":"skipped"', 1, true) then break end
    end
  end
  return count
end
"""
)

# The records list is cut back to ``maxlen`` entries after a push made it an eighth longer
# (``length``: LPUSH's answer): not one LTRIM per push. ACQUIRE and RELEASE define it
# first: it is all their fast paths use (a closure made per call costs the server).
_TRIM = """
local function trim_records(key, length, maxlen)
  local most = math.max(1, tonumber(maxlen))
  if length > most + math.max(1, math.floor(most / 8)) then
    redis.call('LTRIM', key, 0, most - 1)
  end
end
"""

# A run record, as it is pushed at the head of the name's records list (newest first):
# a JSON object of the entry's fields as text, its "at" the server's TIME in ms (which
# orders entries as a stream id did), then a newline, then the record's own JSON as the
# caller sent it (cjson escapes every newline inside the fields). ``...`` are field,
# value pairs.
_ENTRY = """
-- a TIME reply the script already has, for its entries' "at"; false: an entry without
-- one (a release's: its run's start and duration time it, the list's order places it)
local record_time
local function record_entry(record, ...)
  local head = {}
  if record_time ~= false then
    local t = record_time or redis.call('TIME')
    -- the ms of the µs reply, as text: string.format costs the server more
    head.at = t[1] .. string.sub(string.rep('0', 6 - #t[2]) .. t[2], 1, 3)
  end
  local fields = {...}
  for i = 1, #fields, 2 do head[fields[i]] = fields[i + 1] end
  return cjson.encode(head) .. '\\n' .. record, head.at
end
-- A run's end names its run by the start of its token's random part, as the records
-- show it (``short_token``): the whole token (host, pid, task id) is in its start.
local function run_of(token)
  return string.sub(string.match(token, '^[^:]*'), 1, 8)
end
local function append_record(key, maxlen, record, ...)
  local entry, at = record_entry(record, ...)
  local length = redis.call('LPUSH', key, entry)
  trim_records(key, length, maxlen)
  return at, length
end
"""

_APPEND = _TRIM + _ENTRY


def _queued_step(op: str, task_id: str, key: str, deferred: bool = False) -> str:
    """The first step of every script that grants a run its claim (ACQUIRE, REPLACE,
    TAKEOVER), whatever the answer: the run of ``task_id`` handles the name's enqueue
    marker (``key``) when it still holds ``task_id``. ``op`` (Lua expressions, all
    three) is "-" to delete it (the message left the queue), a number of ms to give it
    that expiry (it now covers the run), "" or nil for nothing; "~" deletes it too, but
    with ``deferred`` (ACQUIRE) only when the call is granted (:func:`_granted_queued`):
    a call refused keeps it, for the message it puts back. A marker of another type is
    left alone. Spliced as text, not a Lua function: a closure made per call costs the
    server, and ACQUIRE's fast path runs it on every call."""
    skip = f" and {op} ~= '~'" if deferred else ""
    return f"""
if ({op} or '') ~= ''{skip} then
  local queued = {key}
  if redis.pcall('GET', queued) == {task_id} then
    if {op} == '-' or {op} == '~' then
      redis.call('DEL', queued)
    else
      redis.call('PEXPIRE', queued, {op})
    end
  end
end
"""


def _granted_queued(op: str, task_id: str, key: str) -> str:
    """ACQUIRE's grant, with ``op`` "~" (see :func:`_queued_step`): the run of
    ``task_id`` deletes the name's enqueue marker (``key``) when it still holds
    ``task_id``, its message having left the queue for good."""
    return f"""
if {op} == '~' and redis.pcall('GET', {key}) == {task_id} then
  redis.call('DEL', {key})
end
"""


# ACQUIRE's enqueue marker: the last key but the rate's two.
_ACQUIRE_MARKER = "KEYS[#KEYS - ((ARGV[13] or '') == '' and 0 or 2)]"
# ACQUIRE's first step, whatever the answer (A[12]): the run of A[7] handles the name's
# enqueue marker when it still holds A[7] ("~": at the grant, _granted_queued).
_ACQUIRE_QUEUED = _queued_step("ARGV[12]", "ARGV[7]", _ACQUIRE_MARKER, deferred=True)


# The rate's per-th latest start, granted or booked (false while fewer are counted): a
# call without a booking may start one window after it; successive bookings so get
# successive starts, after every one booked before. Needs locals ``starts_key`` (the
# name's starts, see ACQUIRE's A[13]) and ``per`` (ACQUIRE's A[15]); spliced as text into
# ACQUIRE (its rate block) and RATE_UNBOOK.
_RATE_NTH = """
local function nth_latest()
  local found = redis.call('ZRANGE', starts_key, -per, -per, 'WITHSCORES')
  return found[2] and tonumber(found[2]) or false
end
"""


def _rate_key_step(nth: str) -> str:
    """The rate key written from ``nth`` (a Lua local: the per-th latest start in µs, or
    false): when a call without a booking may next start, one window after it, expiring
    then; deleted when that is not after now, or with fewer starts counted. Needs locals
    ``rate_key``, ``interval`` (the window, µs) and ``rate_now`` (Redis TIME, µs).
    Spliced as text into ACQUIRE's ``publish()`` and RATE_UNBOOK, which so write it
    alike."""
    return f"""
local free = {nth} and {nth} + interval or 0
if free > rate_now then
  redis.call('SET', rate_key, string.format('%d', free), 'PX',
             math.max(1, math.ceil((free - rate_now) / 1000)))
else
  redis.call('DEL', rate_key)
end
"""


# ACQUIRE
# ARGV as sent: token, ttl, idle, then (each may be left off at its default, when
# nothing after it is sent) record (""), skip reason (""), rerun trigger (""), task id
# (""), maximum records ("1000"), then the optional A[9] and on. The script reads them
# as ``A``, in the order described below (``_ACQUIRE_ARGS``); its common grant reads
# ARGV itself.
# KEYS[1] lock (slot 0)   KEYS[2] fence   KEYS[3] records   KEYS[4] skips   KEYS[5] rerun
#         (a set)
# KEYS[6] (with A[9] or A[10]) cooldown (set by RELEASE after a run that ended
#         "ok", expires with PX)
# KEYS[7] (with A[10] > 1) slots: a hash of each slot's fence ("0", "1", ...) and
#         the limit it was last acquired with ("limit")
# KEYS[8..] (with A[10] > 1) slots 1 .. A[10]-1, each a lease like KEYS[1]
# then (with A[11] = "1") the done marker of A[7]'s task id, then (with A[12])
#         the enqueue marker of the name (``claim_enqueue``), then (with A[13]) the
#         rate key and the starts key
# A[1] token  A[2] ttl in ms
# A[3] JSON of the run record (who, where, when), or "" to record nothing; written
#         as the "started" entry, or with the skip reason as the "skipped" entry
# A[4] the skip reason to record when we lose, or "" to record nothing (and count
#         no skip)
# A[5] maximum length of the records list
# A[6] the trigger to hand the holder when we lose the race (it runs once more for
#         each distinct trigger after its own run; equal triggers coalesce), or ""
# A[7] the caller's task id, or "": a holder whose token carries the same task id is
#         an earlier attempt of the same task (a redelivery), not a competitor, so no
#         skip is counted or recorded and no rerun is asked; with slots, such a holder
#         in any slot is reported, and no other slot is taken
# A[8] idle expiry of the name's lasting keys in ms (0 = never)
# A[9] (optional) the skip reason to record while the cooldown key lives, or "" for
#         a claim without a cooldown: checked before the lease, unless the caller is a
#         redelivery of a task (A[7]) that already holds a lease of the name or whose
#         run ended ok (its done marker, with A[11]): that goes on
#         to the lease as without a window. Such a skip is always counted and recorded,
#         and asks no rerun
# A[10] (optional) the limit: how many holders the name may have at once (1 when
#         absent: KEYS[1] alone, and nothing else of slots is touched); the first free
#         slot is taken
# A[11] (optional) "1" when KEYS carry the done marker of A[7]'s task id (see
#         RELEASE), after the slots: a grant then says whether it exists (a delivery
#         of a task id whose run already ended ok, whatever the broker's flags say)
# A[12] (optional) what the run of A[7] does to the enqueue marker, first and
#         whatever the answer, when the marker still holds A[7]: "-" deletes it (the
#         message left the queue), a number of ms gives it that expiry (it now covers
#         the run); "~" deletes it only with a grant (a call refused keeps it for the
#         message it puts back); "" or absent: nothing. A marker of another type is
#         left alone
# A[13] (optional) the rate's window: µs within which at most A[15] starts of the name
#         may be granted, with the rate key and the starts key after the markers: the
#         starts key (a sorted set) holds each start granted (member: its fence) and
#         each start booked ('b:' .. task id), scored by its time (Redis TIME in µs),
#         and expires once its latest start no longer counts; the rate key holds when a
#         call without a booking may next start (one window after the A[15]-th latest
#         start, granted or booked) and expires then. Checked only when a lease is free
#         (a busy call takes no start) and before the grant (a rate-limited call takes
#         no lease). "" or absent: no rate
# A[14] (optional, with A[13] and A[7]) how long a booking holds past its start, in
#         ms: a call over the rate books the next free start for its task id. A call
#         that holds a booking starts at it, not counted again and refused by nobody,
#         but never as the A[15]+1-th start within one window: before then it is told
#         to wait (its booking moved to that start); its grant turns the booking into
#         its start. A booking not come for within the hold is void: a call of its task
#         id after it is a new call. "" or absent: nothing is booked
# A[15] (optional, with A[13]) how many starts the window allows: "" or absent, 1
# returns {1, fence}                                    when the claim is ours (also
#                                                       when A[1] already holds it:
#                                                       a retried request is idempotent)
#         {1, fence, slot index}                        the same, with A[10] > 1
#         {1, fence, slot index or 0, done}             the same, with A[11] = "1":
#                                                       done is 1 when the task id's
#                                                       done marker exists
#         {0, holder token, pttl ms, holder fence, consecutive skips, distinct triggers}
#                                                       (with A[11] = "1", then 1 when
#                                                       the task id's done marker exists:
#                                                       no skip, no trigger, as for its
#                                                       own earlier attempt)
#                                                       busy (with slots: every slot;
#                                                       the holder reported is the
#                                                       task's own, else the one whose
#                                                       lease ends first)
#         {2, "", cooldown pttl ms, fence, consecutive skips, 0}   the name ran recently
#         {3, "", ms until the next start is allowed, fence, 0, 0}   rate limited (with
#                                                       A[13]): nothing is written
#         {4, booked start in µs, ms until it, fence, 0, 0}   rate limited, with a start
#                                                       booked for A[7] (A[14]):
#                                                       just booked, or booked before
#                                                       and not due yet
#         an error reply naming KEYS[3] (or KEYS[5]) when a skip (or a rerun trigger)
#         would be written to a key of another type; nothing is written then
#         an error reply naming KEYS[2] (or KEYS[7]) when the claim would be granted on
#         a fence that is not one (see _FENCE); nothing is granted then

# Every fence is decimal text (a holder's fence as the key holds it, unchecked).
# ACQUIRE's common grant, before anything but trim_records is defined: one holder, no
# cooldown window or rate, a token that needs no JSON escape (when it is recorded), and a
# free name whose last fence is a plain decimal below the server's clock (the enqueue
# marker is handled before it, see _ACQUIRE_QUEUED). It runs the fewest commands (its
# record takes the grant's TIME) and allocates little but its answer; anything else
# goes on to the whole
# script below, told by ``taken`` whether the lease is set (false: busy), by
# ``previous`` what the fence key held and by ``written`` what was written in its place.
_ACQUIRE_FAST = (
    """
local taken, previous, written
if (ARGV[9] or '') == '' and (ARGV[10] or '1') == '1' and (ARGV[13] or '') == ''
    and ((ARGV[4] or '') == '' or string.find(ARGV[1], '^[%w:._-]*$')) then
  -- the done marker: the last key, but for the enqueue marker
  local done_key = (ARGV[12] or '') == '' and #KEYS or #KEYS - 1
  taken = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  if taken then
    local t = redis.call('TIME')
    local now = t[1] .. string.rep('0', 6 - #t[2]) .. t[2]
    written = now
    if ARGV[3] ~= '0' then
      previous = redis.pcall('SET', KEYS[2], now, 'PX', ARGV[3], 'GET')
    else
      previous = redis.pcall('SET', KEYS[2], now, 'GET')
    end
    if not previous or (type(previous) == 'string' and #previous <= #now
        and string.find(previous, '^[1-9]%d*$') and (#previous < #now or previous < now)) then
      if (ARGV[4] or '') ~= '' then
        -- the entry as _ENTRY writes it, its head written out (nothing in it needs a
        -- JSON escape: the token was checked above)
        trim_records(KEYS[3], redis.call('LPUSH', KEYS[3], '{"at":"' .. string.sub(now, 1, -4) ..
                     '","event":"started","token":"' .. ARGV[1] .. '","fence":"' .. now ..
                     '"}\\n' .. ARGV[4]), ARGV[8] or '1000')
        -- the list's idle expiry, renewed as the fence's is: by each grant (and each
        -- renewal of the lease), not by the release of a run that held it
        if ARGV[3] ~= '0' then redis.call('PEXPIRE', KEYS[3], ARGV[3]) end
      end
"""
    + _granted_queued("ARGV[12]", "ARGV[7]", "KEYS[#KEYS]")
    + """
      if ARGV[11] == '1' then return {1, now, 0, redis.call('EXISTS', KEYS[done_key])} end
      return now  -- {1, now} as the bare fence: a table reply costs the server more
    end
  end
end
"""
)


# The arguments of ACQUIRE in the order its whole script reads them (see ACQUIRE).
_ACQUIRE_ARGS = """
local A = {ARGV[1], ARGV[2], ARGV[4] or '', ARGV[5] or '', ARGV[8] or '1000',
           ARGV[6] or '', ARGV[7] or '', ARGV[3], ARGV[9], ARGV[10], ARGV[11], ARGV[12],
           ARGV[13], ARGV[14], ARGV[15]}
local idle = tonumber(A[8])
"""

ACQUIRE = Script(
    "acquire",
    _TRIM
    + _ACQUIRE_QUEUED
    + _ACQUIRE_FAST
    + _ENTRY
    + _ACQUIRE_ARGS
    + _TOUCH
    + _RECORDABLE
    + _STREAK
    + _FENCE
    + """
local limit = tonumber(A[10] or '1')
-- the leases: KEYS[1], then (limit > 1) the slots from KEYS[8]; the markers after them
local last = #KEYS
local rate_key, starts_key, interval, per, rate_now, booking, hold, keep
if A[13] and A[13] ~= '' then
  starts_key = KEYS[last]
  rate_key = KEYS[last - 1]
  last = last - 2
  interval = tonumber(A[13])
  per = tonumber(A[15] or '1') or 1
  hold = 0
  if A[14] and A[14] ~= '' and A[7] ~= '' then
    booking = 'b:' .. A[7]
    hold = tonumber(A[14]) * 1000
  end
  -- how long a start stays in the set: while it counts, and a booking while it is held
  keep = math.max(interval, hold)
end
if A[12] and A[12] ~= '' then
  last = last - 1  -- the enqueue marker, handled first (_ACQUIRE_QUEUED)
end
local done
if A[11] == '1' then
  done = KEYS[last]
  last = last - 1
end
-- a grant: {1, fence}, {1, fence, slot} with slots; with the done marker asked for,
-- {1, fence, slot, 1 when a run of this task id already ended ok, else 0}
local function granted(fence, slot)
"""
    + _granted_queued("A[12]", "A[7]", _ACQUIRE_MARKER)
    + """
  if done then return {1, fence, slot or 0, redis.call('EXISTS', done)} end
  if limit > 1 then return {1, fence, slot} end
  return {1, fence}
end
local function own_task(holder)
  local _, _, _, task_id = string.match(holder, TOKEN_PATTERN)
  return task_id == A[7]
end
local function redelivered()
  -- a run of this very task id ended ok (so it started the window) or holds a lease
  if A[7] == '' then return false end
  if done and redis.call('EXISTS', done) == 1 then return true end
  local holder = redis.call('GET', KEYS[1])
  if holder and own_task(holder) then return true end
  if limit > 1 then
    for i = 8, last do
      holder = redis.call('GET', KEYS[i])
      if holder and own_task(holder) then return true end
    end
  end
  return false
end
if A[9] and A[9] ~= '' then
  -- Redis's own expiry times the window: the hosts' clocks play no part
  local left = redis.call('PTTL', KEYS[6])
  if left > 0 and not redelivered() then
    local skips, bad = count_skip(KEYS[3], KEYS[4])
    if not skips then return bad end
    append_record(KEYS[3], A[5], A[3],
                  'event', 'skipped', 'reason', A[9])
    touch(idle, KEYS[3], KEYS[4])
    return {2, '', left, redis.call('GET', KEYS[2]) or '0', skips, 0}
  end
end
-- the last fence minted, as text (checked by fence_ok before anything is granted on
-- it), read when first needed: a plain grant reads it in the write of the next one
local last_fence
local function read_fence()
  if not last_fence then last_fence = redis.call('GET', KEYS[2]) or '0' end
  return last_fence
end
-- The rate: at most A[15] starts in any window of A[13] µs, by the server's clock. The
-- starts key, a sorted set, holds each start granted (member: its fence) and each start
-- booked ('b:' .. task id), scored by its time; the rate key holds when a call without
-- a booking may next start (for readers), expiring then. Defined only with a rate: a
-- claim without one pays nothing.
local rate_wait, rate_take, throttled
if rate_key then
  local booked  -- the start booked for this call (µs), when it holds a booking
  local nth  -- the per-th latest start counted (µs), as rate_wait found it, or false
  -- ms from now until a time (at least 1): a key lives until it, so an idle name
  -- keeps nothing
  local function ms_until(time)
    return math.max(1, math.ceil((time - rate_now) / 1000))
  end
"""
    + _RATE_NTH
    + """
  -- After a write to the set: what can no longer count (nor be a booking still held)
  -- goes, the rate key says when a call without a booking may next start, and the set
  -- lives as long as its latest start counts. ``latest`` and ``last``: those starts
  -- (the latest, the per-th latest) when the caller knows them.
  local function publish(latest, last)
    redis.call('ZREMRANGEBYSCORE', starts_key, '-inf', string.format('%d', rate_now - keep))
    if last == nil then last = nth_latest() end
"""
    + _rate_key_step("last")
    + """
    if latest == nil then
      local found = redis.call('ZRANGE', starts_key, -1, -1, 'WITHSCORES')
      latest = tonumber(found[2])
    end
    redis.call('PEXPIRE', starts_key, ms_until(latest + keep))
  end
  -- µs to wait for the start allowed, or nil when a start is allowed now
  rate_wait = function()
    local t = redis.call('TIME')
    rate_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    if booking then
      booked = tonumber(redis.call('ZSCORE', starts_key, booking) or '')
      if booked and rate_now > booked + hold then
        booked = nil  -- held no longer: a call come this late is a new one
      end
      if booked then
        if booked > rate_now then return booked - rate_now end
        -- Its own start, counted when it was booked; but never the per+1-th start in a
        -- window: the other starts in the window ending now, granted or due.
        local low = '(' .. string.format('%d', rate_now - interval)
        local high = string.format('%d', rate_now)
        local others = redis.call('ZCOUNT', starts_key, low, high)
        if booked > rate_now - interval then others = others - 1 end
        if others < per then return nil end
        -- the start then: when the window has let enough of them go
        local gone = others - per + 1
        local oldest = redis.call('ZRANGEBYSCORE', starts_key, low, high, 'WITHSCORES',
                                  'LIMIT', 0, gone + 1)
        local start
        for i = 1, #oldest, 2 do
          if oldest[i] ~= booking then
            gone = gone - 1
            if gone == 0 then
              start = tonumber(oldest[i + 1]) + interval
              break
            end
          end
        end
        redis.call('ZADD', starts_key, start, booking)  -- its booking, moved to it
        publish()
        return start - rate_now
      end
    end
    nth = nth_latest()
    if nth and nth + interval > rate_now then return nth + interval - rate_now end
    return nil
  end
  rate_take = function(fence)
    if booked then redis.call('ZREM', starts_key, booking) end
    redis.call('ZADD', starts_key, rate_now, fence)
    if per == 1 and not booked then
      -- the one start a window counts: this one, or a booking after it
      local latest = math.max(nth or 0, rate_now)
      publish(latest, latest)
    else
      publish()
    end
  end
  throttled = function(wait)
    local ms = math.ceil(wait / 1000)
    if booked then
      return {4, string.format('%d', rate_now + wait), ms, read_fence(), 0, 0}
    end
    if booking then
      -- Book the next free start for this task id, and never within period/N of the
      -- latest start: a backlog drains one at a time, not in bursts of N that a claim
      -- of fewer slots would find busy.
      local start = rate_now + wait
      local found = redis.call('ZRANGE', starts_key, -1, -1, 'WITHSCORES')
      if found[2] then
        start = math.max(start, tonumber(found[2]) + math.ceil(interval / per))
      end
      redis.call('ZADD', starts_key, start, booking)
      publish(start)
      return {4, string.format('%d', start), math.ceil((start - rate_now) / 1000),
              read_fence(), 0, 0}
    end
    return {3, '', ms, read_fence(), 0, 0}
  end
end
local function started(minted)
  if A[3] ~= '' then
    if record_time == nil and #minted == 16 then
      -- the start's "at" is its fence's ms, as the common grant writes it (a TIME of
      -- its own could fall in the next ms)
      record_time = {string.sub(minted, 1, 10), string.sub(minted, 11)}
    end
    append_record(KEYS[3], A[5], A[3], 'event', 'started', 'token', A[1],
                  'fence', minted)
    -- the skip count and rerun triggers are given the expiry when they are written
    touch(idle, KEYS[3])
  end
  return minted
end
local function mint()
  local minted = fence_after(read_fence())
  local now = fence_clock()
  if fence_below(minted, now) then
    minted = now
  end
  -- one write gives the fence its value and its idle expiry
  if idle > 0 then
    redis.call('SET', KEYS[2], minted, 'PX', A[8])
  else
    redis.call('SET', KEYS[2], minted)
  end
  return started(minted)
end
-- The plain grant's mint, the lease just set: the server's clock is written as the
-- fence in the same write that reads the last one (SET ... GET), the common case; only
-- when the last fence is not below it (the same µs, a clock stepped back) is the fence
-- the last one + 1, in a second write. A last fence that is not one is put back and
-- grants nothing (nil: the caller gives the lease back).
local function mint_plain()
  local now
  if previous == nil then
    now = fence_clock()
    if idle > 0 then
      previous = redis.pcall('SET', KEYS[2], now, 'PX', A[8], 'GET')
    else
      previous = redis.pcall('SET', KEYS[2], now, 'GET')
    end
  else
    now = written  -- by the common grant above, which left this case to the whole script
  end
  if type(previous) == 'table' and previous.err then
    return nil, previous  -- another type: nothing was written
  end
  last_fence = previous or '0'
  if not fence_ok(last_fence) then
    redis.call('SET', KEYS[2], last_fence)  -- left as it was, for the operator to repair
    return nil, not_a_fence(KEYS[2])
  end
  local minted = fence_after(last_fence)
  if fence_below(now, minted) then
    if idle > 0 then
      redis.call('SET', KEYS[2], minted, 'PX', A[8])
    else
      redis.call('SET', KEYS[2], minted)
    end
  else
    minted = now
  end
  return started(minted)
end
local function lose(holder, pttl, fence)
  -- an earlier attempt of this task id holds it, or a run of it already ended ok: not
  -- a competitor (no skip counted or recorded, no rerun asked)
  local completed = done and redis.call('EXISTS', done) or 0
  local own = A[7] ~= '' and (completed == 1 or own_task(holder))
  -- every key written below is checked first: a wrong one stops the script unwritten
  local rerun_kind
  if A[6] ~= '' and not own then
    rerun_kind = redis.call('TYPE', KEYS[5]).ok
    if rerun_kind ~= 'set' and rerun_kind ~= 'string' and rerun_kind ~= 'none' then
      return redis.error_reply('WRONGTYPE ' .. KEYS[5] .. ' is a ' .. rerun_kind ..
                               ', not a set of rerun triggers')
    end
  end
  local skips = 0
  if own then
    skips = tonumber(redis.call('GET', KEYS[4]) or '0')
  elseif A[4] ~= '' then
    local bad
    skips, bad = count_skip(KEYS[3], KEYS[4])
    if not skips then return bad end
    append_record(KEYS[3], A[5], A[3],
                  'event', 'skipped', 'holder', holder, 'reason', A[4])
    touch(idle, KEYS[3], KEYS[4])
  end
  local rerun = 0
  if rerun_kind then
    if rerun_kind == 'string' then
      redis.call('DEL', KEYS[5])  -- a counter left by fenced 0.1
    end
    redis.call('SADD', KEYS[5], A[6])
    rerun = redis.call('SCARD', KEYS[5])
    touch(idle, KEYS[5])
  end
  if done then return {0, holder, pttl, fence, skips, rerun, completed} end
  return {0, holder, pttl, fence, skips, rerun}
end
if limit <= 1 then
  local wait = rate_key and redis.call('EXISTS', KEYS[1]) == 0 and rate_wait()
  if wait then return throttled(wait) end
  if taken or (taken == nil and redis.call('SET', KEYS[1], A[1], 'NX', 'PX', A[2])) then
    local minted, refused = mint_plain()
    if not minted then
      redis.call('DEL', KEYS[1])  -- granted nothing
      return refused
    end
    if rate_key then rate_take(minted) end
    return granted(minted)
  end
  local holder = redis.call('GET', KEYS[1]) or ''
  -- our own token: a client's retry of an ACQUIRE whose reply was lost; nobody can have
  -- acquired since, so the fence is the one minted for us
  if holder == A[1] then
    if not fence_ok(read_fence()) then
      redis.call('DEL', KEYS[1])
      return not_a_fence(KEYS[2])
    end
    return granted(last_fence)
  end
  return lose(holder, redis.call('PTTL', KEYS[1]), read_fence())
end
local slots = {KEYS[1]}
for i = 8, last do slots[#slots + 1] = KEYS[i] end
local free, own, first, first_pttl
local holders = {}
for i, key in ipairs(slots) do
  local holder = redis.call('GET', key)
  if holder == A[1] then
    -- a retry of our own request: the fence minted for this slot
    local fence = redis.call('HGET', KEYS[7], tostring(i - 1)) or '0'
    if not fence_ok(fence) then
      redis.call('DEL', key)
      return not_a_fence(KEYS[7])
    end
    return granted(fence, i - 1)
  elseif holder then
    holders[i] = holder
    if not own and A[7] ~= '' and own_task(holder) then own = i end
    local pttl = redis.call('PTTL', key)
    if first == nil or (pttl >= 0 and (first_pttl < 0 or pttl < first_pttl)) then
      first, first_pttl = i, pttl
    end
  elseif free == nil then
    free = i
  end
end
if free and not own then
  if not fence_ok(read_fence()) then return not_a_fence(KEYS[2]) end
  local wait = rate_key and rate_wait()
  if wait then return throttled(wait) end
  redis.call('SET', slots[free], A[1], 'PX', A[2])
  local fence = mint()
  if rate_key then rate_take(fence) end
  redis.call('HSET', KEYS[7], tostring(free - 1), fence, 'limit', tostring(limit))
  touch(idle, KEYS[7])
  return granted(fence, free - 1)
end
local pick = own or first
return lose(holders[pick], redis.call('PTTL', slots[pick]),
            redis.call('HGET', KEYS[7], tostring(pick - 1)) or '0')
""",
)

# RATE_UNBOOK: let go of the start booked for a call over the rate (ACQUIRE's A[14]) that
#              will never come for it (its message expired first)
# KEYS[1] the name's rate key   KEYS[2] its starts (as ACQUIRE's: the last two of its KEYS)
# ARGV[1] the task id whose booking goes (its member, "b:" .. task id)
# ARGV[2] the rate's window in µs (ACQUIRE's A[13])
# ARGV[3] how many starts the window allows (ACQUIRE's A[15])
# The booking removed, the rate key is written as ACQUIRE's publish() writes it
# (_rate_key_step): one window after the ARGV[3]-th latest start left, granted or booked,
# deleted when there is none or that is not after now. The starts key keeps its expiry
# (never shorter than what is left in it needs).
# returns 1 when the booking was there (now gone), else 0 (nothing written)
RATE_UNBOOK = Script(
    "rate_unbook",
    """
local rate_key, starts_key = KEYS[1], KEYS[2]
if redis.call('ZREM', starts_key, 'b:' .. ARGV[1]) == 0 then return 0 end
local interval, per = tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local rate_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""
    + _RATE_NTH
    + """
local last = nth_latest()
"""
    + _rate_key_step("last")
    + """
return 1
""",
)

# REFRESH
# KEYS[1] lock   KEYS[2..] (optional) the name's lasting keys, to keep while it is held
# ARGV[1] token  ARGV[2] ttl in ms  ARGV[3] (optional) idle expiry in ms (0 = never)
# ARGV[4] (optional) "1" when KEYS[2] is the name's replaced notes (see REPLACE): the
#         lasting keys then start at KEYS[3]
# ARGV[5] (optional) the task id of the run holding the lease, with the name's enqueue
#         marker (``claim_enqueue="until_finished"``) as the last of KEYS (the lasting
#         keys then end before it): while the lease is extended and the marker still
#         holds that task id, the marker lives at least ttl ms too (never less than it
#         had: a retry of the run marked it for its queued message). "" or absent:
#         no marker
# returns 1 when the lease was extended, 0 when the token no longer holds it, or the
#         reason REPLACE noted for this token when another run took the lease over
REFRESH = Script(
    "refresh",
    _TOUCH
    + """
local first, last = 2, #KEYS
if ARGV[4] == '1' then first = 3 end
local marked = ARGV[5] and ARGV[5] ~= ''
if marked then last = last - 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local idle = tonumber(ARGV[3] or '0')
  if idle > 0 and last >= first then
    touch(idle, unpack(KEYS, first, last))
  end
  if marked and redis.pcall('GET', KEYS[#KEYS]) == ARGV[5] then
    local left = redis.call('PTTL', KEYS[#KEYS])
    if left >= 0 and left < tonumber(ARGV[2]) then
      redis.call('PEXPIRE', KEYS[#KEYS], ARGV[2])
    end
  end
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if first == 3 then
  local why = redis.call('HGET', KEYS[2], string.sub(ARGV[1], 1, 32))
  if why then return why end
end
return 0
""",
)

# The sending set of a name (``claim_on_busy="rerun"`` in Celery): each member is
# "<random part of the releasing token>:<trigger>". A member's field, as RELEASE answers
# it and RERUN_SENT takes it, is "<that random part>:<SHA1 of the member>": plain text
# whatever bytes the trigger holds, and the same for the same release and trigger.
_SENDING = """
local function sending_entry(member)
  local at = string.find(member, ':', 1, true)
  local release_id, trigger = '', member
  if at then
    release_id, trigger = string.sub(member, 1, at - 1), string.sub(member, at + 1)
  end
  return release_id .. ':' .. redis.sha1hex(member), trigger
end
"""

# RELEASE: ARGV as sent: token, outcome, then (each may be left off at its default,
#          when nothing after it is sent) record (""), fence ("0"), idle ms ("0"),
#          rerun triggers ("1"), done marker ms ("0"), maximum records ("1000"), then the
#          optional A[9] and A[10]. The script reads them as ``A``, in the order
#          described below (``_RELEASE_ARGS``); its common case reads ARGV itself.
# RELEASE (safe to send again: a retry of a release whose reply was lost gets the first
#          answer back, from a short-lived note of it or from the done marker it set,
#          and records nothing twice)
# KEYS[1] lock   KEYS[2] records   KEYS[3] skips   KEYS[4] rerun
# KEYS[5] done marker (holds the first 32 characters of the token whose run ended ok)
# KEYS[6] the note of this token's release
# KEYS[7] (optional) cooldown: set to the fence with PX = A[9] after an "ok" run
# A[1] token
# A[2] JSON of the finished run record, or "" to record nothing
# A[3] maximum length of the records list
# A[4] outcome ("ok" resets the consecutive-skip count); a run that says "ok" but
#         whose lease was already gone ended "lost": it did not end under the claim
# A[5] fence of the run being finished (recorded beside the outcome)
# A[6] "1" to take (read and clear) the rerun triggers; "2" to take them into the
#         name's sending set, KEYS[#KEYS] (see _SENDING), where they stay until the
#         caller forgets each once its rerun is published (RERUN_SENT); "0" to leave them
# A[7] idle expiry of the name's lasting keys in ms (0 = never)
# A[8] how long to remember that this task id finished "ok", in ms (0 = not at all)
# A[9] (optional) the cooldown window in ms that a run ending "ok" starts (0 = none);
#         a failed or lost run starts none
# KEYS[8] and A[10] (optional) the name's enqueue marker (``claim_enqueue``) and the
#         task id of this run: the marker is deleted if it still holds that task id
#         (the run ended, not by a retry)
# KEYS[#KEYS] (with A[6] = "2") the sending set, after the keys above
# A[11] (optional) "1" when the last of KEYS (after the sending set) is the name's replaced
#         notes (see REPLACE): a release that finds the lease no longer held under its
#         token reads the note REPLACE left for it, as REFRESH does (only then: the
#         common case reads nothing more)
# returns {1 if our token held the lease and it is now deleted else 0, the outcome
#          recorded, {the rerun triggers taken}}, and two more items when the run was
#          not recorded because KEYS[2] is not a list: KEYS[2] and its type; when a
#          newer run replaced this token (A[11]), {0, the outcome, {}, KEYS[2] and its
#          type or "" and "", why REPLACE noted it} (kept as this release's note:
#          a retry gets it back and records nothing twice). With
#          A[6] = "2" the triggers are {field, trigger, ...}: the whole sending set,
#          with what earlier releases left unsent ("" for the field of a trigger taken
#          while the set's key held another type: it is kept nowhere)
# RELEASE's common case, before anything but trim_records is defined: our token holds
# the lease, no rerun trigger waits and the record's head needs no JSON escape (what the
# whole script below does then, with the fewest commands; the enqueue marker included).
# Anything else (a record
# the records key cannot take included: nothing is written then) goes on to the whole
# script, told by ``held`` what the lease key holds.
_RELEASE_FAST = """
local held, run
-- the run's entry as _ENTRY writes it, its head written out when nothing in it needs a
-- JSON escape (else the whole script writes it); ``run``: the start of the token's
-- random part, as the records show the run (``short_token``)
if (ARGV[3] or '') ~= '' then run = string.sub(string.match(ARGV[1], '^[^:]*'), 1, 8) end
if ARGV[6] ~= '2' and (not run
    or string.find(run .. (ARGV[4] or '0') .. ARGV[2], '^[%w:._-]*$')) then
  held = redis.call('GET', KEYS[1])
  if held == ARGV[1] and (ARGV[6] == '0' or redis.call('EXISTS', KEYS[4]) == 0) then
    local outcome, record, recorded = ARGV[2], ARGV[3] or '', true
    if record ~= '' then
      local entry = '{"event":"finished","token":"' .. run .. '","fence":"' ..
                    (ARGV[4] or '0') .. '","outcome":"' .. outcome .. '"}\\n' .. record
      local added = redis.pcall('LPUSH', KEYS[2], entry)
      recorded = not (type(added) == 'table' and added.err)
      if recorded then
        -- the list's idle expiry was renewed by this run's grant (and each renewal of
        -- the lease); a list this push made (the grant's gone) gets its own
        trim_records(KEYS[2], added, ARGV[8] or '1000')
        if added == 1 and (ARGV[5] or '0') ~= '0' then
          redis.call('PEXPIRE', KEYS[2], ARGV[5])
        end
      end
    end
    if recorded then
      -- the enqueue marker goes with the lease when it still holds this run's task id
      local queued = (ARGV[10] or '') ~= '' and redis.pcall('GET', KEYS[8]) == ARGV[10]
      local gone = {KEYS[1]}
      if record ~= '' and outcome == 'ok' then
        gone[2] = KEYS[3]  -- a success ends a streak of skips
      end
      if queued then gone[#gone + 1] = KEYS[8] end
      redis.call('DEL', unpack(gone))
      local done_ms = tonumber(ARGV[7] or '0')
      local marked = outcome == 'ok' and done_ms > 0
      if marked then
        redis.call('SET', KEYS[5], string.sub(ARGV[1], 1, 32), 'PX', ARGV[7])
      end
      if outcome == 'ok' and tonumber(ARGV[9] or '0') > 0 then
        redis.call('SET', KEYS[7], ARGV[4], 'PX', ARGV[9])
      end
      if not (marked and done_ms >= 60000) then
        redis.call('SET', KEYS[6], outcome, 'PX', '60000')
      end
      return outcome  -- {1, outcome, {}} as the bare outcome
    end
  end
end
"""

# The arguments of RELEASE in the order its whole script reads them (see RELEASE).
_RELEASE_ARGS = """
local A = {ARGV[1], ARGV[3] or '', ARGV[8] or '1000', ARGV[2], ARGV[4] or '0',
           ARGV[6] or '1', ARGV[5] or '0', ARGV[7] or '0', ARGV[9], ARGV[10], ARGV[11]}
"""

RELEASE = Script(
    "release",
    _TRIM
    + _RELEASE_FAST
    + _ENTRY
    + "record_time = false\n"
    + _RELEASE_ARGS
    + _TOUCH
    + _RECORDABLE
    + _SENDING
    + """
-- the done marker of a run that ended ok holds the start of its token: it is also
-- that release's note (see below)
local mark = string.sub(A[1], 1, 32)
local released = 0
local replaced  -- why REPLACE took this token's lease over, found only when it is gone
if held == nil then held = redis.call('GET', KEYS[1]) end
if held == A[1] then
  released = 1
else
  -- our token holds no lease: gone, or released already by this very request
  local noted = redis.call('GET', KEYS[6])
  if noted then
    if noted == 'ok' or noted == 'failed' or noted == 'lost' or noted == 'aborted' then
      return {1, noted, {}}
    end
    return cjson.decode(noted)
  end
  if tonumber(A[8]) > 0 and redis.call('GET', KEYS[5]) == mark then
    return {1, 'ok', {}}
  end
  -- taken over by a newer run (REPLACE): why, as this token's REFRESH would read it
  if A[11] == '1' then
    replaced = redis.call('HGET', KEYS[#KEYS], mark)
  end
end
local idle = tonumber(A[7])
-- the keys to delete, in one call
local gone = {}
if released == 1 then
  gone[1] = KEYS[1]
end
local outcome = A[4]
local vanished = released == 0 and outcome == 'ok'
if vanished then
  outcome = 'lost'
end
local unrecorded
if A[2] ~= '' then
  -- the lease is given back whatever the records key holds: another type loses the
  -- record only. Nothing is written before this LPUSH, so its own error tells (no TYPE
  -- per release).
  local entry
  if replaced then
    entry = record_entry(A[2], 'event', 'finished', 'token', run,
                         'fence', A[5], 'outcome', outcome, 'note', replaced)
  elseif vanished then
    entry = record_entry(A[2], 'event', 'finished', 'token', run,
                         'fence', A[5], 'outcome', outcome,
                         'note', 'the lease was gone before release')
  else
    entry = record_entry(A[2], 'event', 'finished', 'token', run,
                         'fence', A[5], 'outcome', outcome)
  end
  local added = redis.pcall('LPUSH', KEYS[2], entry)
  if type(added) == 'table' and added.err then
    unrecorded = unrecordable(KEYS[2])
    if not unrecorded then
      return added  -- another error: nothing is done yet
    end
  else
    trim_records(KEYS[2], added, A[3])
    touch(idle, KEYS[2])
  end
  -- a success ends a streak of skips (a claim without records counts none)
  if outcome == 'ok' then
    gone[#gone + 1] = KEYS[3]
  end
end
if A[10] and A[10] ~= '' and redis.pcall('GET', KEYS[8]) == A[10] then
  gone[#gone + 1] = KEYS[8]
end
local marked = outcome == 'ok' and tonumber(A[8]) > 0
if marked then
  redis.call('SET', KEYS[5], mark, 'PX', A[8])
end
if outcome == 'ok' and tonumber(A[9] or '0') > 0 then
  redis.call('SET', KEYS[7], A[5], 'PX', A[9])
end
local reruns = {}
if A[6] ~= '0' and released == 1 then
  local kind = redis.call('TYPE', KEYS[4]).ok
  local taken = {}
  if kind == 'set' then
    taken = redis.call('SMEMBERS', KEYS[4])
  elseif kind == 'string' then
    taken = {''}  -- a counter left by fenced 0.1: one rerun, with the holder's arguments
  end
  if kind ~= 'none' then
    gone[#gone + 1] = KEYS[4]
  end
  if A[6] ~= '2' then
    reruns = taken
  else
    -- kept until each rerun is sent: a holder that dies first leaves them to the
    -- name's next release (one TYPE when there are none)
    local sending = KEYS[#KEYS - ((A[11] == '1') and 1 or 0)]
    local out = redis.call('TYPE', sending).ok
    if out == 'set' or out == 'none' then
      local release_id = string.match(A[1], '^[^:]*')
      for _, t in ipairs(taken) do
        redis.call('SADD', sending, release_id .. ':' .. t)
      end
      if out == 'set' or #taken > 0 then
        touch(idle, sending)
        for _, member in ipairs(redis.call('SMEMBERS', sending)) do
          local field, trigger = sending_entry(member)
          reruns[#reruns + 1] = field
          reruns[#reruns + 1] = trigger
        end
      end
    else
      for _, t in ipairs(taken) do
        reruns[#reruns + 1] = ''
        reruns[#reruns + 1] = t
      end
    end
  end
end
if #gone > 0 then
  redis.call('DEL', unpack(gone))
end
local answer = {released, outcome, reruns}
if released == 1 and not (marked and #reruns == 0 and tonumber(A[8]) >= 60000) then
  -- the note of a release that took no rerun triggers is its outcome alone; an ok run
  -- with a done marker that outlives the note needs none (the marker answers a retry)
  local note = outcome
  if #reruns > 0 then note = cjson.encode(answer) end
  redis.call('SET', KEYS[6], note, 'PX', '60000')
elseif replaced then
  -- the answer that says why is this release's note: a retry gets it back
  answer[4], answer[5], answer[6] = '', '', replaced
  redis.call('SET', KEYS[6], cjson.encode(answer), 'PX', '60000')
end
if unrecorded then
  -- after the note: a retry of this release does not say it twice
  answer[4], answer[5] = KEYS[2], unrecorded
end
return answer
""",
)

# RERUN_SENT: forget the triggers of a name's sending set whose rerun is published (or
#             that ask for none). Only the commands a worker's ACL allows: the set is
#             written again without them.
# KEYS[1] the sending set
# ARGV the fields of the triggers to forget, as RELEASE answered them
# returns how many triggers stay
RERUN_SENT = Script(
    "rerun_sent",
    _SENDING
    + """
local forget = {}
for _, field in ipairs(ARGV) do forget[field] = true end
if redis.call('TYPE', KEYS[1]).ok ~= 'set' then return 0 end
local stay = {}
for _, member in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if not forget[(sending_entry(member))] then stay[#stay + 1] = member end
end
local left = redis.call('PTTL', KEYS[1])
redis.call('DEL', KEYS[1])
for _, member in ipairs(stay) do redis.call('SADD', KEYS[1], member) end
if #stay > 0 and left > 0 then redis.call('PEXPIRE', KEYS[1], left) end
return #stay
""",
)

# HANDOVER: a run that asked for a retry of its task ends, keeping its lease for the
#           retried message of the same task id (which takes it over with TAKEOVER)
# KEYS[1] lock   KEYS[2] records   KEYS[3] handover (the value of the kept lease)
# ARGV[1] token  ARGV[2] how long the lease is kept, in ms
# The kept lease's value is "retry-" + token: host, pid and task id read as before, but
# a renewal of the run still on its way (REFRESH compares the token) finds it gone and
# cannot cut the kept time short.
# ARGV[3] JSON of the finished run record, or "" to record nothing
# ARGV[4] maximum length of the records list   ARGV[5] fence of the run being finished
# ARGV[6] idle expiry of the name's lasting keys in ms (0 = never)
# returns 1 when our token held the lease (now kept, its run recorded "retried"), 0 when
#         the lease was gone or another token's (its run recorded "lost"); with records
#         and KEYS[2] not a list, {that 1 or 0, KEYS[2], its type}: nothing recorded
HANDOVER = Script(
    "handover",
    _TOUCH
    + _RECORDABLE
    + _APPEND
    + """
local unrecorded
if ARGV[3] ~= '' then unrecorded = unrecordable(KEYS[2]) end
local kept = 0
local outcome = 'lost'
if redis.call('GET', KEYS[1]) == ARGV[1] then
  local value = 'retry-' .. ARGV[1]
  redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
  redis.call('SET', KEYS[3], value, 'PX', ARGV[2])
  kept = 1
  outcome = 'retried'
end
if unrecorded then
  return {kept, KEYS[2], unrecorded}
end
if ARGV[3] ~= '' then
  if kept == 1 then
    append_record(KEYS[2], ARGV[4], ARGV[3],
                  'event', 'finished', 'token', run_of(ARGV[1]), 'fence', ARGV[5],
                  'outcome', outcome)
  else
    append_record(KEYS[2], ARGV[4], ARGV[3],
                  'event', 'finished', 'token', run_of(ARGV[1]), 'fence', ARGV[5],
                  'outcome', outcome, 'note', 'the lease was gone before release')
  end
  touch(tonumber(ARGV[6]), KEYS[2])
end
return kept
""",
)

# The fence of a new holder, minted as ACQUIRE's mint() does: max(previous fence + 1,
# Redis TIME in µs), written with the name's idle expiry (ms, 0 = never) in one SET.
# ``last`` is the fence key's value, checked with fence_ok. Returns the fence as text (as
# written, and as run records carry it). Needs _FENCE.
_MINT = """
local function mint_fence(key, last, idle)
  local minted = fence_after(last)
  local now = fence_clock()
  if fence_below(minted, now) then
    minted = now
  end
  if idle > 0 then
    redis.call('SET', key, minted, 'PX', idle)
  else
    redis.call('SET', key, minted)
  end
  return minted
end
"""

# A name within its cooldown window, as ACQUIRE's cooldown check answers it: the skip
# counted and recorded (reason, with the run record given), and ACQUIRE's "ran recently"
# reply; nil when the cooldown key has expired. Needs _TOUCH and _STREAK.
_RAN_RECENTLY = """
local function ran_recently(keys, reason, record, maxlen, idle)
  -- Redis's own expiry times the window: the hosts' clocks play no part
  local left = redis.call('PTTL', keys.cooldown)
  if left <= 0 then return nil end
  local skips, bad = count_skip(keys.records, keys.skips)
  if not skips then return bad end
  append_record(keys.records, maxlen, record, 'event', 'skipped', 'reason', reason)
  touch(idle, keys.records, keys.skips)
  return {2, '', left, redis.call('GET', keys.fence) or '0', skips, 0}
end
"""

# The name's replaced calls (``on_busy="replace"``; see REPLACE): a list, newest first, of
# a task id, a newline and why a newer call replaced it. ``replaced_call`` answers why
# ``task_id`` was replaced, or nil; nil and an error reply when the key holds another
# type. ``refused_replaced`` is the answer to such a call, {5, why, 0, fence, 0, 0} (with
# ``done``, then done), after it recorded a skip with that reason (not counted; the
# record is checked first: nothing is written when it is of another type). Needs
# _RECORDABLE, _APPEND and _TOUCH.
_REPLACED_CALLS = """
local function replaced_call(key, task_id)
  local calls = redis.pcall('LRANGE', key, 0, -1)
  if calls.err then
    return nil, redis.error_reply('WRONGTYPE ' .. key .. ' is a ' ..
                                  redis.call('TYPE', key).ok .. ', not a list of replaced calls')
  end
  if task_id == '' then return nil end
  local head = task_id .. '\\n'
  for _, call in ipairs(calls) do
    if string.sub(call, 1, #head) == head then return string.sub(call, #head + 1) end
  end
  return nil
end
local function refused_replaced(why, records, maxlen, record, idle, fence, done)
  if record ~= '' then
    local bad = unrecordable(records)
    if bad then return not_a_list(records, bad) end
    append_record(records, maxlen, record, 'event', 'skipped', 'reason', why)
    touch(idle, records)
  end
  local refused = {5, why, 0, fence, 0, 0}
  if done then refused[7] = done end
  return refused
end
"""

# TAKEOVER: a retried message takes the lease its earlier attempt kept for it (HANDOVER),
#           or the name when it is free, minting a new fence as ACQUIRE does (_MINT)
# KEYS[1] lock   KEYS[2] fence   KEYS[3] records   KEYS[4] handover
# KEYS[5] (with ARGV[7]) skips   KEYS[6] (with ARGV[7]) cooldown (set by RELEASE after a
#         run that ended "ok", expires with PX)
# ARGV[1] token  ARGV[2] ttl in ms
# ARGV[3] JSON of the "started" run record, or "" to record nothing; with the cooldown
#         reason, written as the "skipped" entry when the name ran recently
# ARGV[4] maximum length of the records list
# ARGV[5] the caller's task id: only a lease kept for a token carrying this task id is
#         taken over; a holder still running (no handover) is never taken from
# ARGV[6] idle expiry of the name's lasting keys in ms (0 = never)
# ARGV[7] (optional) the skip reason to record while the cooldown key lives, or "" for a
#         claim without a cooldown. Checked only when the name is free, as ACQUIRE would
#         (the skip counted and recorded, no rerun asked). A kept lease is taken over
#         whatever the cooldown key says: its run began outside any window and held the
#         name since, and only a run that ended "ok" starts one.
# ARGV[8] (optional, with ARGV[7] sent, "" for none) what the run of ARGV[5] does to
#         the name's enqueue marker, the last of KEYS but the replaced calls, first and
#         whatever the answer: as ACQUIRE's A[12] (_queued_step). "" or absent: nothing,
#         and no marker key
# ARGV[9] (optional, with ARGV[7] and ARGV[8] sent) "1" when the last of KEYS is the
#         name's replaced calls (see REPLACE): a task id among them is refused as REPLACE
#         refuses it (a run under ``on_busy="replace"`` taking its kept lease)
# ARGV[10] (optional, with ARGV[7] to ARGV[9] sent) "1" with the done marker of ARGV[5]'s
#         task id (see RELEASE) after the cooldown's keys: a run of it that already ended
#         ok takes over no lease, kept or not (a duplicate delivery: it is told so by the
#         busy answer, whoever holds the name), is not refused as replaced, and a free
#         name is taken whatever the cooldown key says (as ACQUIRE's A[9]); every answer
#         but "ran recently" then says whether the marker exists
# returns {1, fence}   when the claim is ours (also when ARGV[1] already holds it);
#         {1, fence, 0, done} with ARGV[10]
#         {0, holder token, pttl ms, holder fence, 0, 0}   as ACQUIRE's busy answer
#                                                       (with ARGV[10], then done)
#         {2, "", cooldown pttl ms, fence, consecutive skips, 0}   the name is free but
#                                                       ran recently, as ACQUIRE's
#         {5, why, 0, fence, 0, 0}   with ARGV[9]: as REPLACE's (with ARGV[10], then
#                                    done)
#         an error reply naming KEYS[3] when a skip would be written to a key of another
#         type; nothing is written then; one naming KEYS[2] when it holds what is not a
#         fence: nothing is granted or taken over then
TAKEOVER = Script(
    "takeover",
    _TOUCH
    + _RECORDABLE
    + _STREAK
    + _APPEND
    + _FENCE
    + _MINT
    + _RAN_RECENTLY
    + _REPLACED_CALLS
    + _queued_step("ARGV[8]", "ARGV[5]", "KEYS[#KEYS - ((ARGV[9] or '') == '' and 0 or 1)]")
    + """
local idle = tonumber(ARGV[6])
local holder = redis.call('GET', KEYS[1])
local last_fence = redis.call('GET', KEYS[2]) or '0'
-- the done marker of ARGV[5]'s task id: after the cooldown's keys, when asked for
local done
if ARGV[10] == '1' then
  done = redis.call('EXISTS', KEYS[(ARGV[7] ~= '') and 7 or 5])
end
local function granted(fence)
  if done then return {1, fence, 0, done} end
  return {1, fence}
end
if holder == ARGV[1] then
  if not fence_ok(last_fence) then return not_a_fence(KEYS[2]) end
  return granted(last_fence)
end
if ARGV[9] == '1' then
  local why, bad = replaced_call(KEYS[#KEYS], ARGV[5])
  if bad then return bad end
  if why and done ~= 1 then
    return refused_replaced(why, KEYS[3], ARGV[4], ARGV[3], idle, last_fence, done)
  end
end
if holder then
  local _, _, _, task_id = string.match(holder, TOKEN_PATTERN)
  if ARGV[5] == '' or task_id ~= ARGV[5] or redis.call('GET', KEYS[4]) ~= holder
      or done == 1 then
    local busy = {0, holder, redis.call('PTTL', KEYS[1]), last_fence, 0, 0}
    if done then busy[7] = done end
    return busy
  end
elseif ARGV[7] and ARGV[7] ~= '' and done ~= 1 then
  local recently = ran_recently({cooldown = KEYS[6], records = KEYS[3], skips = KEYS[5],
                                 fence = KEYS[2]}, ARGV[7], ARGV[3], ARGV[4], idle)
  if recently then return recently end
end
-- a kept lease stays kept, and a free name free, when no fence can be minted
if not fence_ok(last_fence) then return not_a_fence(KEYS[2]) end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('DEL', KEYS[4])
local minted = mint_fence(KEYS[2], last_fence, idle)
if ARGV[3] ~= '' then
  append_record(KEYS[3], ARGV[4], ARGV[3],
                  'event', 'started', 'token', ARGV[1], 'fence', minted)
end
touch(idle, KEYS[3])
return granted(minted)
""",
)

# REPLACE: take the name over from whoever holds it (``on_busy="replace"``): the newest
#          run wins at once, never waiting for the holder, minting a fence above the
#          holder's as ACQUIRE does (_MINT). Limit 1 only: the plain lease key.
# KEYS[1] lock   KEYS[2] fence   KEYS[3] records   KEYS[4] replaced notes (a hash: the first
#         32 characters of a replaced token -> why, read by that token's REFRESH)
# KEYS[5] (with ARGV[9]) skips   KEYS[6] (with ARGV[9]) cooldown
# ARGV[1] token  ARGV[2] ttl in ms
# ARGV[3] JSON of the "started" run record, or "" to record nothing
# ARGV[4] maximum length of the records list
# ARGV[5] the caller's task id, or "": a holder carrying the same task id is an earlier
#         attempt of this very task (a redelivery), never replaced
# ARGV[6] idle expiry of the name's lasting keys in ms (0 = never)
# ARGV[7] why the holder lost its lease ("replaced by ..."), noted for its REFRESH
# ARGV[8] JSON of the replaced run's "finished" record (outcome "lost"), written here so
#         that it holds even when the holder is dead; "" to record nothing
# ARGV[9] (optional) the skip reason to record while the cooldown key lives, checked
#         only when the name is free, as TAKEOVER does ("" for none)
# then, each only with the argument that asks for it: the done marker of ARGV[5]'s task
#         id (ARGV[10]), the name's enqueue marker (ARGV[11]), the name's replaced calls
#         (ARGV[12]: a list, newest first, of the task id, a newline and why, for each task id
#         REPLACE took the name over from, with the name's idle expiry)
# ARGV[10] (optional) "1" with the done marker of ARGV[5]'s task id (see RELEASE): a
#         run of it that already ended ok replaces nobody (a duplicate delivery: the busy
#         answer says so, whoever holds the name, another copy of the same task id too),
#         is not refused as replaced, and takes a free name whatever the cooldown key
#         says (as ACQUIRE's A[9]); every answer but "ran recently" says whether the
#         marker exists
# ARGV[11] (optional) what the run of ARGV[5] does to the name's enqueue marker, first
#         and whatever the answer: as ACQUIRE's A[12] (_queued_step). "" or absent:
#         nothing
# ARGV[12] (optional) how many replaced calls the name keeps (newest first): a task id
#         among them was replaced by a newer call and never takes the name again (its
#         retry, its redelivery: the newest call wins by call order), and a holder taken
#         over is added to them (with its token's task id). "" or absent: none read or kept
# returns {1, fence, 0}   when the claim is ours (also when ARGV[1] already holds it);
#         {1, fence, 0, done} with ARGV[10]
#         {0, holder token, pttl ms, holder fence, 0, 0}   an earlier attempt of this
#                                               task, or (with ARGV[10], then done) a
#                                               task id whose run ended ok
#         {2, "", cooldown pttl ms, fence, consecutive skips, 0}   as ACQUIRE's
#         {5, why, 0, fence, 0, 0}   ARGV[5]'s task id was replaced by a newer call
#                                    (why: the note REPLACE left it then); recorded as
#                                    a skip with that reason (not counted), nothing else
#                                    written; with ARGV[10], then done
#         an error reply naming KEYS[3] (not a list), KEYS[2] (not a fence) or the
#         replaced calls (not a list); nothing is written then
REPLACE = Script(
    "replace",
    _TOUCH
    + _RECORDABLE
    + _STREAK
    + _APPEND
    + _FENCE
    + _MINT
    + _RAN_RECENTLY
    + _REPLACED_CALLS
    + """
-- the optional keys after the cooldown's, in order
local at = (ARGV[9] and ARGV[9] ~= '') and 6 or 4
local done_key, queued_key, calls_key
if ARGV[10] == '1' then at = at + 1; done_key = KEYS[at] end
if ARGV[11] and ARGV[11] ~= '' then at = at + 1; queued_key = KEYS[at] end
if ARGV[12] and ARGV[12] ~= '' then at = at + 1; calls_key = KEYS[at] end
"""
    + _queued_step("ARGV[11]", "ARGV[5]", "queued_key")
    + """
local idle = tonumber(ARGV[6])
local holder = redis.call('GET', KEYS[1])
local last_fence = redis.call('GET', KEYS[2]) or '0'
local done
if done_key then done = redis.call('EXISTS', done_key) end
local function granted(fence)
  if done then return {1, fence, 0, done} end
  return {1, fence, 0}
end
if holder == ARGV[1] then
  if not fence_ok(last_fence) then return not_a_fence(KEYS[2]) end
  return granted(last_fence)
end
-- the name's replaced calls: this task id among them was replaced by a newer call
if calls_key then
  local why, bad = replaced_call(calls_key, ARGV[5])
  if bad then return bad end
  if why and done ~= 1 then
    return refused_replaced(why, KEYS[3], ARGV[4], ARGV[3], idle, last_fence, done)
  end
end
if holder then
  local _, _, _, task_id = string.match(holder, TOKEN_PATTERN)
  if (ARGV[5] ~= '' and task_id == ARGV[5]) or done == 1 then
    local busy = {0, holder, redis.call('PTTL', KEYS[1]), last_fence, 0, 0}
    if done then busy[7] = done end
    return busy
  end
elseif ARGV[9] and ARGV[9] ~= '' and done ~= 1 then
  local recently = ran_recently({cooldown = KEYS[6], records = KEYS[3], skips = KEYS[5],
                                 fence = KEYS[2]}, ARGV[9], ARGV[3], ARGV[4], idle)
  if recently then return recently end
end
-- every key written below is checked first: a wrong one stops the script unwritten
if not fence_ok(last_fence) then return not_a_fence(KEYS[2]) end
if ARGV[3] ~= '' then
  local bad = unrecordable(KEYS[3])
  if bad then return not_a_list(KEYS[3], bad) end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
local minted = mint_fence(KEYS[2], last_fence, idle)
if holder then
  -- the holder learns why at its next renewal; kept past the longest it can take
  redis.call('HSET', KEYS[4], string.sub(holder, 1, 32), ARGV[7])
  redis.call('PEXPIRE', KEYS[4], 2 * tonumber(ARGV[2]) + 60000)
  -- its task id never takes the name again: a newer call replaced it
  local _, _, _, was = string.match(holder, TOKEN_PATTERN)
  if calls_key and was and was ~= '' then
    redis.call('LPUSH', calls_key, was .. '\\n' .. ARGV[7])
    redis.call('LTRIM', calls_key, 0, tonumber(ARGV[12]) - 1)
    touch(idle, calls_key)
  end
  if ARGV[8] ~= '' then
    append_record(KEYS[3], ARGV[4], ARGV[8],
                  'event', 'finished', 'token', run_of(holder), 'fence', last_fence,
                  'outcome', 'lost', 'replaced', '1')
  end
end
if ARGV[3] ~= '' then
  append_record(KEYS[3], ARGV[4], ARGV[3],
                  'event', 'started', 'token', ARGV[1], 'fence', minted)
end
touch(idle, KEYS[3])
return granted(minted)
""",
)

# FORCE_RELEASE: clear a claim whatever its token, for an operator or a supervisor
# KEYS[1] lock   KEYS[2] records   KEYS[3] fence
# ARGV[1] expected token prefix ("" = any holder)   ARGV[2] JSON record   ARGV[3] maxlen
# ARGV[4] expected task id in the token ("" = any)
# ARGV[5] outcome of the holder's run, "" for "released" (an operator's act); any other
#         outcome (e.g. "aborted": its process died) ends that run's record
# ARGV[6] expected "host:pid" in the token ("" = any)
# ARGV[7] idle expiry of the name's lasting keys in ms (0 = never)
# returns {token deleted, its fence (the fence key's value)}, or {"", ""} when nothing matched
FORCE_RELEASE = Script(
    "force_release",
    _TOUCH
    + _APPEND
    + """
local holder = redis.call('GET', KEYS[1])
if not holder then return {'', ''} end
if ARGV[1] ~= '' and string.sub(holder, 1, string.len(ARGV[1])) ~= ARGV[1] then
  return {'', ''}
end
local _, host, pid, task_id = string.match(holder, TOKEN_PATTERN)
if ARGV[4] ~= '' and task_id ~= ARGV[4] then return {'', ''} end
if ARGV[6] ~= '' and (host or '') .. ':' .. (pid or '') ~= ARGV[6] then
  return {'', ''}
end
redis.call('DEL', KEYS[1])
if ARGV[2] ~= '' then
  local outcome = ARGV[5]
  if outcome == '' then
    append_record(KEYS[2], ARGV[3], ARGV[2],
                  'event', 'released', 'token', holder, 'outcome', 'released')
  else
    append_record(KEYS[2], ARGV[3], ARGV[2],
                  'event', 'finished', 'token', run_of(holder), 'fence', '0',
                  'outcome', outcome)
  end
  touch(tonumber(ARGV[7]), KEYS[2])
end
return {holder, redis.call('GET', KEYS[3]) or ''}
""",
)

# RECORD: append one run record without touching the lease
# KEYS[1] records   KEYS[2] skips
# ARGV[1] event  ARGV[2] outcome  ARGV[3] JSON record  ARGV[4] maxlen  ARGV[5] token
# ARGV[6] idle expiry of the name's lasting keys in ms (0 = never)
# returns the entry's time (the server's TIME in ms, as text)
RECORD = Script(
    "record",
    _TOUCH
    + _APPEND
    + """
local at = append_record(KEYS[1], ARGV[4], ARGV[3],
                        'event', ARGV[1], 'token', ARGV[5], 'outcome', ARGV[2])
if ARGV[2] == 'ok' then redis.call('DEL', KEYS[2]) end
touch(tonumber(ARGV[6]), KEYS[1])
return at
""",
)


# LOCK_ACQUIRE: fenced.Lock's acquire, on the key redis-py's Lock uses (so the two
#               exclude each other), minting the fence in the same step
# KEYS[1] lock (the lock's name itself; value = token)   KEYS[2] the lock's fence
# ARGV[1] token   ARGV[2] ttl in ms, or "" for a lock that never expires
# ARGV[3] idle expiry of the fence key in ms (0 = never)
# ARGV[4] "1" when the token was made for this acquire: a holder with the same token is
#         then this very acquire, retried after its reply was lost, and it is granted
#         with the fence minted for it; "0" for a token the caller chose (as redis-py,
#         a held name is not taken, whoever holds it)
# returns the fence (> 0, as text) when the lock is ours, 0 when another holder has it,
#         an error naming KEYS[2] when it holds what is not a fence (the lock not taken)
LOCK_ACQUIRE = Script(
    "lock_acquire",
    _FENCE
    + """
local granted
if ARGV[2] == '' then
  granted = redis.call('SET', KEYS[1], ARGV[1], 'NX')
else
  granted = redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
end
if not granted then
  if ARGV[4] ~= '1' or redis.call('GET', KEYS[1]) ~= ARGV[1] then
    return 0
  end
  local minted = redis.call('GET', KEYS[2])
  if minted and fence_ok(minted) then return minted end
end
local last = redis.call('GET', KEYS[2]) or '0'
if not fence_ok(last) then
  redis.call('DEL', KEYS[1])  -- ours, set above: the lock is not taken
  return not_a_fence(KEYS[2])
end
local fence = fence_after(last)
local now = fence_clock()
if fence_below(fence, now) then
  fence = now
end
local idle = tonumber(ARGV[3])
if idle > 0 then
  redis.call('SET', KEYS[2], fence, 'PX', idle)
else
  redis.call('SET', KEYS[2], fence)
end
return fence
""",
)

# LOCK_RELEASE: compare-and-delete, as redis-py's Lock releases
# KEYS[1] lock   ARGV[1] token
# returns 1 when the token held the lock (now deleted), else 0
LOCK_RELEASE = Script(
    "lock_release",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
""",
)


# BEAT_DISPATCH: the leader of several ``celery beat`` processes decides which (entry,
#                due time) pairs it sends (fenced.celery.beat); nothing is sent that this
#                script did not grant, and it grants each pair once
# KEYS[1] the leader's lease (a claim's lock)   KEYS[2] that claim's fence
# KEYS[3] the beat's entries: a hash from "entry:<entry name>" to
#         "<due time, ms since the epoch>:<fence of the leader that wrote it>:<state>",
#         state "pending" (granted, not known to be sent), "sent" or "skipped" (a
#         baseline: a due time passed over, or the time an entry was first seen: nothing
#         ran then); "tick": the server time (ms) of the last call; "reply": the last
#         call's answer, "<fence>:<call id>|<previous tick>|<tick>|<a 1 or 0 per triple>"
# ARGV[1] the leader's token   ARGV[2] its fence (decimal text)
# ARGV[3] idle expiry of KEYS[3] in ms (0 = never)
# ARGV[4] the call's id: new for each call of a leader, the same when a call is sent again
# then one triple per pair: entry name, due time in ms, and either the shortest gap in
#         ms allowed after the entry's stored due time (the pair is then granted and
#         stored "pending") or "skip" (stored "skipped", never granted)
# A pair is refused (nothing stored) when its due time is more than 1000 ms after Redis
# TIME (a leader whose clock runs ahead: fenced.celery.beat.AHEAD_MS), when it is not
# after the stored one by at least the gap (after a "skipped" one, or for "skip": not
# after it), or when the stored one was written under a higher fence. A stored value
# that is not "<digits>:<fence>:<state>", or whose due time is more than a day after
# Redis TIME (none this script stores), counts as none: a writer of the claims' Redis
# cannot stall an entry for longer than a day with it.
# A call with the fence and id of the last call is answered as that call was, nothing
# written: a reply lost after the script ran, asked again (redis-py's retry).
# returns {0} when ARGV[1] does not hold KEYS[1] or ARGV[2] is not KEYS[2]'s fence (a
#         leader that lost its lease, paused or cut off: nothing is written), else
#         {1, the previous tick ("" for none), this tick, then one 1 (granted) or 0 per
#         triple, in order}; ticks are Redis TIME in ms, as text
BEAT_DISPATCH = Script(
    "beat_dispatch",
    _FENCE
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] or redis.call('GET', KEYS[2]) ~= ARGV[2] then
  return {0}
end
local call = ARGV[2] .. ':' .. ARGV[4]
local replied = redis.call('HGET', KEYS[3], 'reply')
if replied then
  local id, before, at, grants = string.match(replied, '^([^|]*)|([^|]*)|([^|]*)|([01]*)$')
  if id == call then
    local out = {1, before, at}
    for i = 1, #grants do out[#out + 1] = tonumber(string.sub(grants, i, i)) end
    return out
  end
end
local t = redis.call('TIME')
local now = t[1] .. string.format('%03d', math.floor(t[2] / 1000))
local latest = tonumber(now) + 1000
local previous = redis.call('HGET', KEYS[3], 'tick') or ''
local out = {1, previous, now}
local grants = {}
for i = 5, #ARGV, 3 do
  local field, due, gap = 'entry:' .. ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local ok = tonumber(due) <= latest
  local stored = ok and redis.call('HGET', KEYS[3], field)
  if stored then
    local last, fence, state = string.match(stored, '^(%d+):(%d+):(.*)$')
    -- A stored due time a day past Redis's clock is none this script stored (it stores
    -- none past latest; a clock stepped back a day is not honoured): it is planted.
    if last and fence_ok(fence) and tonumber(last) <= latest + 86400000 then
      if fence_below(ARGV[2], fence) then
        ok = false
      elseif gap == 'skip' or state == 'skipped' then
        ok = tonumber(due) > tonumber(last)
      else
        ok = tonumber(due) >= tonumber(last) + tonumber(gap) and tonumber(due) > tonumber(last)
      end
    end
  end
  if ok then
    local state = 'pending'
    if gap == 'skip' then state = 'skipped' end
    redis.call('HSET', KEYS[3], field, due .. ':' .. ARGV[2] .. ':' .. state)
  end
  if ok and gap ~= 'skip' then grants[#grants + 1] = '1' else grants[#grants + 1] = '0' end
  out[#out + 1] = tonumber(grants[#grants])
end
redis.call('HSET', KEYS[3], 'tick', now,
           'reply', call .. '|' .. previous .. '|' .. now .. '|' .. table.concat(grants))
if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[3], ARGV[3]) end
return out
""",
)

# BEAT_SENT: pairs BEAT_DISPATCH granted were published
# KEYS[1] the beat's entries (as BEAT_DISPATCH)
# ARGV pairs of entry name and the value BEAT_DISPATCH stored ("...:pending")
# Each entry still holding that value becomes "...:sent"; any other value (a later due
# time, another leader's) is left alone.
# returns how many were marked
BEAT_SENT = Script(
    "beat_sent",
    """
local marked = 0
for i = 1, #ARGV, 2 do
  local field = 'entry:' .. ARGV[i]
  if redis.call('HGET', KEYS[1], field) == ARGV[i + 1] then
    local value = string.gsub(ARGV[i + 1], ':pending$', ':sent')
    redis.call('HSET', KEYS[1], field, value)
    marked = marked + 1
  end
end
return marked
""",
)

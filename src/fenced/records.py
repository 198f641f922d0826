"""Run records and skip counters: what happened to each claim, newest first.

Records live in one capped Redis list per claim (``{ns}:{name}:records``), newest
first, JSON only. The claim scripts write them in the same round trip as the lease
operation: ACQUIRE pushes ``started`` (or ``skipped``), RELEASE pushes ``finished`` with
the outcome. A run is assembled from its ``started`` and ``finished`` entries by token.

An entry is a JSON object of its fields (event, token, fence, outcome...; ``at``, the
server's time in ms), a newline, and the record's own JSON (who, where, how long). A
list of a few entries costs some hundred bytes; the stream earlier versions kept
(``{ns}:{name}:runs``, one per name) preallocated about 4 KB. That stream is still read
beside the list, newest first, so records an earlier version wrote stay shown until
they expire; nothing writes it any more.

Outcomes: ``ok``, ``skipped``, ``failed``, ``lost``, ``aborted``, ``released`` (by an
operator), ``retried`` (a Celery run that asked for a retry of its task and kept its
lease for the retried message: HANDOVER), and ``running`` for a run whose end was not
(yet) recorded.

This module owns the records' form both ways: the ``encode_*`` functions write the JSON
the scripts append, and :func:`from_entries` reads it back.
"""

from __future__ import annotations

import heapq
import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from json import encoder
from typing import Any

from ._lease import (
    HOST,
    IDLE_TTL,
    MAX_RECORDS,
    ClaimKeys,
    Holder,
    current_pid,
    fence_or_none,
    int_or_none,
    ms_or_none,
    pid_text,
    short_token,
)
from ._printable import readable
from ._redact import redact
from ._scripts import RECORD, STREAK_ENTRIES, as_text

__all__ = [
    "OUTCOMES",
    "UNREADABLE",
    "RunRecord",
    "consecutive_skips",
    "encode_fields",
    "encode_finished",
    "encode_release",
    "encode_started",
    "entries_for",
    "from_entries",
    "from_replies",
    "history",
    "last",
    "queue_read",
    "record",
    "skip_streak",
]

OUTCOMES = ("ok", "skipped", "failed", "lost", "aborted", "released", "retried", "running")
#: The outcome of a stored entry that says none of the above (its ``unreadable`` says why).
UNREADABLE = "unreadable"
#: How deep a record's data is read; anyone who can write Redis may write a record.
MAX_DEPTH = 32

# One encoder for every record: json.dumps with options builds a new encoder per call.
_encoder = json.JSONEncoder(separators=(",", ":"), default=str)
_encode = _encoder.encode
_HOST_JSON = _encode(HOST)
_quote = encoder.encode_basestring_ascii  # what _encode makes of a str
_make_encoder: Any = getattr(encoder, "c_make_encoder", None)


def _encode_object(data: dict[str, Any]) -> str:
    """``_encode(data)`` for a dict, without JSONEncoder's Python layers around the C
    encoder (the same text: its options are _encoder's). Every acquire encodes one."""
    make = _make_encoder
    if make is None:  # pragma: no cover - CPython has the C encoder
        return _encode(data)
    e = _encoder
    chunks = make({}, e.default, _quote, None, ":", ",", e.sort_keys, e.skipkeys, e.allow_nan)(
        data, 0
    )
    return "".join(chunks)


# The fields every run record starts with; ``extra`` may not shadow them on the
# pre-encoded path (a mapping that does goes through the general one).
_BASE_FIELDS = frozenset(("task_id", "host", "pid", "at"))


def encode_started(task_id: str | None, extra: Mapping[str, Any], encoded: str = "") -> str:
    """The record ACQUIRE writes as the ``started`` (or ``skipped``) entry.

    ``encoded``: more fields, as :func:`encode_fields` made them once for many runs
    (a Celery task's name, template and worker), written before ``extra``.
    """
    if extra and not _BASE_FIELDS.isdisjoint(extra):
        data = {"task_id": task_id, "host": HOST, "pid": current_pid(), "at": time.time()}
        data.update(extra)
        text = _encode(data)
        return f"{text[:-1]},{encoded}}}" if encoded else text
    # The same JSON object, built without a dict per run: this is on every acquire. The
    # time is written to the µs (cheaper than a float's shortest repr).
    head = (
        f'{{"task_id":{_quote(task_id) if type(task_id) is str else _encode(task_id)},'
        f'"host":{_HOST_JSON},"pid":{pid_text()},"at":{time.time():.6f}'
    )
    if encoded:
        head = f"{head},{encoded}"
    return f"{head},{_encode_object(dict(extra))[1:]}" if extra else head + "}"


def encode_fields(fields: Mapping[str, Any]) -> str:
    """Fields for :func:`encode_started`'s ``encoded``: the members of their JSON object
    (no braces), encoded once and written into many records."""
    shadowed = _BASE_FIELDS.intersection(fields)
    if shadowed:
        raise ValueError(f"record fields {sorted(shadowed)} are the record's own")
    return _encode_object(dict(fields))[1:-1]


def encode_finished(task_id: str | None, duration: float, reason: str | None) -> str:
    """The record RELEASE writes as the ``finished`` entry (it pairs with ``started``)."""
    # The "started" entry already says who, where and with what; this one adds only how
    # it ended. Built as text, not from a dict: this is on every release. To the µs.
    record = (
        f'{{"task_id":{_quote(task_id) if type(task_id) is str else _encode(task_id)},'
        f'"host":{_HOST_JSON},"pid":{pid_text()},"duration":{duration:.6f}'
    )
    return record + (f',"reason":{_quote(redact(reason))}}}' if reason else "}")


def encode_release(reason: str | None, **data: Any) -> str:
    """The record of a claim cleared from outside (an operator, a supervisor)."""
    return _encode(
        {"host": HOST, "pid": current_pid(), "at": time.time(), "reason": reason, **data}
    )


@dataclass
class RunRecord:
    """One run of a claim: its outcome and where, when and under which fence it ran."""

    name: str
    outcome: str
    task_id: str | None = None
    worker: str | None = None
    #: The start of the run's token (``_lease.short_token``), never the whole of it.
    token: str | None = None
    fence: int | None = None
    started: float | None = None
    finished: float | None = None
    duration: float | None = None
    reason: str | None = None
    holder: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: What in the stored record could not be read (it is shown, never skipped).
    unreadable: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


#: The longest duration a record may give, in seconds (a thousand years).
LONGEST = 1000 * 365.25 * 86_400


def _ms_time(text: str) -> float | None:
    """A time in ms since the epoch (decimal digits) as seconds; None for anything else,
    or a time no date can show."""
    ms = ms_or_none(text)
    return None if ms is None else ms / 1000.0


def _entry_time(entry_id: str) -> float:
    at = _ms_time(entry_id.split("-", 1)[0])
    return 0.0 if at is None else at  # not a stream entry id: sorts last


def _part(raw: bytes | str, what: str, problems: list[str]) -> str:
    """One part of a list entry as text; bytes that are not UTF-8 are noted, and read
    as ``\\x`` escapes (the record) or with U+FFFD (the fields, to read their JSON)."""
    if not isinstance(raw, bytes):
        return raw
    try:
        return raw.decode()
    except UnicodeDecodeError:
        if what == "r":
            problems.append("field 'r' is not UTF-8")
            return readable(raw)
        problems.append("the entry's fields are not UTF-8")
        return raw.decode("utf-8", "replace")


@dataclass
class _Entry:
    """One entry (of the list, or of an earlier version's stream), read whatever it
    holds: what could not be read is in ``problems``."""

    id: str
    at: float
    fields: dict[str, str]
    data: dict[str, Any]
    problems: list[str]
    #: False for a list entry written without a time of its own (a release's end): its
    #: ``at`` is then the next older entry's, ``before`` the next newer one's (None: it
    #: is the newest), and its run's end its start + duration, within those two.
    timed: bool = True
    before: float | None = None

    @classmethod
    def read(cls, entry_id: Any, raw: Any) -> _Entry:
        """A stream entry (XREVRANGE's id and fields)."""
        eid = readable(entry_id)
        problems: list[str] = []
        fields: dict[str, str] = {}
        for key, value in (raw or {}).items():
            try:
                fields[as_text(key)] = as_text(value)
            except UnicodeDecodeError:
                fields[readable(key)] = readable(value)
                problems.append(f"field {readable(key)!r} is not UTF-8")
        return cls(eid, _entry_time(eid), fields, _data(fields.get("r"), problems), problems)

    @classmethod
    def listed(cls, raw: bytes | str) -> _Entry:
        """A list entry: its fields' JSON object, a newline, the record's JSON."""
        problems: list[str] = []
        newline = b"\n" if isinstance(raw, bytes) else "\n"
        head_raw, sep, record_raw = raw.partition(newline)  # type: ignore[arg-type]
        head = _part(head_raw, "fields", problems)
        fields: dict[str, str] = {}
        try:
            parsed = json.loads(head) if head else {}
        except (ValueError, RecursionError):
            parsed = {}
            problems.append(f"the entry's fields are not JSON: {head[:40]!r}")
        if not isinstance(parsed, dict):
            problems.append(f"the entry's fields are a JSON {type(parsed).__name__}")
            parsed = {}
        for key, value in parsed.items():
            fields[key] = value if isinstance(value, str) else _encode(value)
        if sep:
            fields["r"] = _part(record_raw, "r", problems)
        stamp = fields.pop("at", None)
        if stamp is None:  # timed by its neighbours (see _entries)
            return cls("", 0.0, fields, _data(fields.get("r"), problems), problems, False)
        at = _ms_time(stamp)
        if at is None:
            at = 0.0  # sorts last
            problems.append(f"at {stamp[:40]!r} is not a time in ms")
        return cls(stamp, at, fields, _data(fields.get("r"), problems), problems)

    def text(self, key: str) -> str | None:
        """A field of the record's JSON as text (a value of another type, as its JSON)."""
        value = self.data.get(key)
        if value is None or isinstance(value, str):
            return value
        return _encode(value)

    def number(self, key: str) -> float | None:
        """A numeric field of the record's JSON; None (and a problem noted) otherwise."""
        value = self.data.get(key)
        if value is None:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if -LONGEST <= value <= LONGEST:  # False for NaN; no float() of a huge int
                return float(value)
            self.problems.append(f"{key} is {_encode(value)[:40]}, out of range")
            return None
        self.problems.append(f"{key} is {_encode(value)[:40]}, not a number")
        return None

    def fence(self) -> int | None:
        """The entry's fence field; None when absent, 0, or not an integer (noted)."""
        text = self.fields.get("fence", "")
        if text in ("", "0"):
            return None
        fence = fence_or_none(text)
        if fence is None:
            self.problems.append(f"fence {text[:40]!r} is not an integer from 1 to 2**63-2")
        return fence

    def holder(self, key: str) -> str | None:
        """A token field, as the holder it names."""
        text = self.fields.get(key)
        return str(Holder.parse(text)) if text else None

    def worker(self) -> str | None:
        if self.data.get("worker"):
            return self.text("worker")
        if self.data.get("host"):
            return f"{self.text('host')}:{self.text('pid')}"
        return None

    def extra(self) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k not in _CORE}

    def unreadable(self) -> str | None:
        return "; ".join(dict.fromkeys(self.problems)) or None

    def reason(self) -> str | None:
        """The reason a run ended: the record's, else the note of the script that ended it."""
        return self.text("reason") or self.fields.get("note")

    def run(self, name: str, outcome: str, **fields: Any) -> RunRecord:
        """A run read from this entry: ``fields`` (the record's task id unless given), who
        ran it, its extra data, and what could not be read (so far)."""
        fields.setdefault("task_id", self.text("task_id"))
        rec = RunRecord(name, outcome, worker=self.worker(), extra=self.extra(), **fields)
        rec.unreadable = self.unreadable()
        return rec


def _data(text: str | None, problems: list[str]) -> dict[str, Any]:
    """The record's JSON object ({} for none); anything else is noted as a problem.

    Data nested deeper than :data:`MAX_DEPTH` is cut there (and noted): whatever reads
    a record next (``asdict``, an encoder) recurses once per level.
    """
    if not text:
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        problems.append(f"r is not JSON: {text[:40]!r}")
        return {}
    if not isinstance(data, dict):
        problems.append(f"r is a JSON {type(data).__name__}, not an object")
        return {}
    if text.count("[") + text.count("{") > MAX_DEPTH:  # else it cannot be that deep
        cut: list[bool] = []
        data = _bounded(data, 0, cut)
        if cut:
            problems.append(f"r is nested deeper than {MAX_DEPTH} levels (cut there)")
    return data  # type: ignore[no-any-return]


def _bounded(value: Any, depth: int, cut: list[bool]) -> Any:
    """``value`` with every list or object deeper than MAX_DEPTH as a note (``cut`` told)."""
    if not isinstance(value, (dict, list)):
        return value
    if depth >= MAX_DEPTH:
        cut.append(True)
        return "… (nested too deep)"
    if isinstance(value, dict):
        return {k: _bounded(v, depth + 1, cut) for k, v in value.items()}
    return [_bounded(v, depth + 1, cut) for v in value]


def history(
    client: Any, name: str, *, limit: int = 20, namespace: str = "fenced"
) -> list[RunRecord]:
    """The most recent runs of a claim, newest first (one round trip)."""
    keys = ClaimKeys.of(name, namespace)
    try:
        listed, streamed = queue_read(client.pipeline(transaction=False), keys, limit).execute(
            raise_on_error=False
        )
    except UnicodeDecodeError:
        # A client that decodes replies cannot read the window at all: say so, once.
        why = "a run record is not UTF-8; a client without decode_responses reads the rest"
        return [RunRecord(name=keys.name, outcome=UNREADABLE, unreadable=why)]
    return from_replies(keys, listed, streamed, limit)


def queue_read(pipe: Any, keys: ClaimKeys, limit: int) -> Any:
    """Queue the reads of a name's records on a pipeline: LRANGE of the list, then
    XREVRANGE of an earlier version's stream (:func:`from_replies` reads both)."""
    count = entries_for(limit)
    pipe.lrange(keys.records, 0, count - 1)
    pipe.xrevrange(keys.runs, count=count)
    return pipe


def from_replies(keys: ClaimKeys, listed: Any, streamed: Any, limit: int = 20) -> list[RunRecord]:
    """The runs :func:`queue_read`'s replies hold, newest first; a key of another type
    (an error in place of its reply) is one unreadable run naming it."""
    replies = ((keys.records, listed), (keys.runs, streamed))
    bad = [
        RunRecord(name=keys.name, outcome=UNREADABLE, unreadable=f"{key}: {reply}")
        for key, reply in replies
        if isinstance(reply, Exception)
    ]
    listed, streamed = ([] if isinstance(reply, Exception) else reply for _key, reply in replies)
    return bad + from_entries(keys.name, listed, limit, streamed=streamed)


def read_problems(listed: Any, streamed: Any) -> list[str]:
    """What :func:`queue_read`'s replies could not read, for a listing's one line."""
    pairs = (("records", listed), ("runs", streamed))
    return [f"{what}: {reply}" for what, reply in pairs if isinstance(reply, Exception)]


def entries_for(limit: int) -> int:
    """How many entries to read for ``limit`` runs (each run writes up to two)."""
    return max(1, limit) * 2 + 2


def from_entries(
    name: str, entries: Any, limit: int = 20, *, streamed: Any = ()
) -> list[RunRecord]:
    """Assemble runs, newest first, from entries (for callers that pipeline): the
    records list's items (LRANGE, newest first), or XREVRANGE's pairs of a stream an
    earlier version wrote; with ``streamed``, such pairs too, merged by time.

    Entries that cannot be read (not JSON, fields of the wrong type, not UTF-8) give
    runs with ``unreadable`` saying what is wrong, and the rest is read as usual.
    """
    finished: dict[str, _Entry] = {}
    runs: list[tuple[float, RunRecord]] = []
    # An operator's release, listed on its own unless it turns out to be the only end
    # of a run in the window: then it is that run's end, not a second entry.
    releases: dict[str, tuple[float, RunRecord]] = {}
    for e in _entries(entries, streamed):
        f, at = e.fields, e.at
        event = f.get("event")
        # Runs pair by their tokens' start: the whole token would release a live lease.
        token = short_token(f.get("token"))
        if event in ("finished", "released"):
            # Newest first: a run cleared by an operator and then finished by its holder
            # (as lost) ends with the holder's own record, not the release; a run a
            # newer one replaced ends with what REPLACE wrote (it names that run).
            if f.get("replaced") or token not in finished:
                finished[token] = e
            if event == "released":
                rec = e.run(name, "released", task_id=None, token=token or None, finished=at)
                rec.reason, rec.holder = e.text("reason"), e.holder("token")
                runs.append((at, rec))
                releases.setdefault(token, runs[-1])
            continue
        if event == "skipped":
            rec = e.run(name, "skipped", started=at, finished=at, duration=0.0)
            rec.reason = f.get("reason") or e.text("reason") or "already running"
            rec.holder = e.holder("holder")
        elif event == "started":
            rec = e.run(name, "running", token=token, fence=e.fence(), started=at)
            end = finished.pop(token, None)
            if end is not None:
                rec.outcome = _outcome(end)
                duration = end.number("duration")
                rec.finished = end.at
                if not end.timed and duration is not None:
                    # measured by the holder, so bounded by what Redis saw after it
                    rec.finished = max(end.at, at + duration)
                    if end.before is not None:
                        rec.finished = min(rec.finished, end.before)
                rec.duration = duration if duration is not None else rec.finished - at
                rec.reason = end.reason()
                rec.extra.update(end.extra())
                e.problems += end.problems
                if end.fields.get("event") == "released":
                    cleared = releases.get(token)
                    if cleared is not None and cleared in runs:
                        runs.remove(cleared)
                rec.unreadable = e.unreadable()
        else:
            rec = _unknown(name, e, event)
        runs.append((at, rec))
    # Finished entries whose start fell outside the window still tell an outcome.
    for token, e in finished.items():
        if e.fields.get("event") == "finished":
            outcome, fence, duration = _outcome(e), e.fence(), e.number("duration")
            rec = e.run(name, outcome, token=token, fence=fence, finished=e.at, duration=duration)
            rec.reason = e.reason()
            runs.append((e.at, rec))
    runs.sort(key=lambda pair: pair[0], reverse=True)
    return [rec for _at, rec in runs[:limit]]


def _entry(item: Any) -> _Entry:
    if isinstance(item, (bytes, str)):
        return _Entry.listed(item)
    entry_id, raw = item
    return _Entry.read(entry_id, raw)


def _entries(entries: Any, streamed: Any) -> Any:
    """Every entry, newest first: a stream's beside the list's merged by time (each in
    its own order; the list's first at the same time, it is the newer)."""
    listed = [_entry(item) for item in entries or ()]
    # An entry without a time of its own is placed at the next older entry's time (the
    # list is in the order Redis pushed it), so the list stays newest first.
    # The oldest in the window (its older neighbour outside it) takes the newer one's.
    since = 0.0
    for e in reversed(listed):
        if e.timed:
            since = e.at
        else:
            e.at = since
    newer: float | None = None
    for e in listed:
        if e.timed:
            newer = e.at
            continue
        e.before = newer
        if not e.at:
            e.at = newer or 0.0
    if not streamed:
        return listed
    return heapq.merge(listed, map(_entry, streamed), key=lambda e: -e.at)


_CORE = {"task_id", "host", "pid", "at", "worker", "reason", "duration", "outcome"}


def _outcome(end: _Entry) -> str:
    outcome = end.fields.get("outcome", "ok")
    if outcome in OUTCOMES:
        return outcome
    end.problems.append(f"outcome {outcome[:40]!r} is not one fenced writes")
    return UNREADABLE


def _unknown(name: str, e: _Entry, event: str | None) -> RunRecord:
    """An entry no script writes (no event, or another one): shown, never skipped."""
    what = f"event {event[:40]!r} is not one fenced writes" if event else "no event field"
    return RunRecord(
        name=name,
        outcome=UNREADABLE,
        token=short_token(e.fields.get("token")) or None,
        finished=e.at,
        unreadable="; ".join(dict.fromkeys([what, *e.problems])),
    )


def last(client: Any, name: str, *, namespace: str = "fenced") -> RunRecord | None:
    """The most recent run of a claim, or None."""
    runs = history(client, name, limit=1, namespace=namespace)
    return runs[0] if runs else None


def consecutive_skips(client: Any, name: str, *, namespace: str = "fenced") -> int:
    """A claim's skips in a row: since a run of it last started or ended ok (0 when the
    counter is unreadable), as :func:`skip_streak` reads them. One round trip."""
    keys = ClaimKeys.of(name, namespace)
    pipe = client.pipeline(transaction=False)
    # The records before the count: the other way round, a start and a skip between the
    # two reads would show the count an earlier holder's skips left.
    pipe.lrange(keys.records, 0, STREAK_ENTRIES - 1)
    pipe.get(keys.skips)
    try:
        listed, value = pipe.execute(raise_on_error=False)
    except UnicodeDecodeError:  # a client that decodes replies met a record of bytes
        listed, value = None, client.get(keys.skips)
    return skip_streak(int_or_none(value) or 0, listed)


def skip_streak(count: int, listed: Any) -> int:
    """A name's consecutive skips, as every reader shows them (``fenced ls``, ``fenced
    show``, the dashboard and its API): ``count``, the value of its skip counter, unless
    a run started since the last skip. Then 0: the count the scripts keep is reset by
    the next skip, not by the start (which costs no command for it), so what it holds
    until then is an earlier holder's.

    ``listed``: the newest entries of the name's records list, newest first, as LRANGE
    answers (at least :data:`STREAK_ENTRIES` of them, or all there are; anything else,
    an error for one: ``count``). The first of the first :data:`STREAK_ENTRIES` that
    is a start or a skip decides, read as the scripts read it when they count the next
    skip (``count_skip`` in ``_scripts``): a start makes that skip the first of a new
    count, a skip adds it to the count.
    """
    if count <= 0 or not isinstance(listed, list):
        return count
    for raw in listed[:STREAK_ENTRIES]:
        if isinstance(raw, bytes):
            raw = raw.decode("utf-8", "replace")  # what is not UTF-8 is none of the two
        head = raw.partition("\n")[0] if isinstance(raw, str) else ""
        if '"event":"started"' in head:
            return 0
        if '"event":"skipped"' in head:
            break
    return count


def record(
    client: Any,
    name: str,
    outcome: str,
    *,
    namespace: str = "fenced",
    token: str = "",
    event: str = "finished",
    max_records: int = MAX_RECORDS,
    idle_ttl: float | None = IDLE_TTL,
    **data: Any,
) -> str:
    """Append one record outside a lease operation (e.g. an aborted run before acquire).

    Returns the entry's time: the server's clock in ms, as text."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
    keys = ClaimKeys.of(name, namespace)
    data.setdefault("at", time.time())
    payload = _encode(data)
    return as_text(
        RECORD(
            client,
            [keys.records, keys.skips],
            [event, outcome, payload, max_records, token, int(idle_ttl * 1000) if idle_ttl else 0],
        )
    )

"""Run records and skip counters: what happened to each claim, newest first.

Records live in one capped Redis stream per claim (``{ns}:{name}:runs``), JSON only.
The claim scripts write them in the same round trip as the lease operation: ACQUIRE
appends ``started`` (or ``skipped``), RELEASE appends ``finished`` with the outcome.
A run is assembled from its ``started`` and ``finished`` entries by token.

Outcomes: ``ok``, ``skipped``, ``failed``, ``lost``, ``aborted``, ``released`` (by an
operator), and ``running`` for a run whose end was not (yet) recorded.

This module owns the records' form both ways: the ``encode_*`` functions write the JSON
the scripts append, and :func:`from_entries` reads it back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ._lease import HOST, IDLE_TTL, MAX_RECORDS, ClaimKeys, Holder, current_pid, short_token
from ._redact import redact
from ._scripts import RECORD, as_text

__all__ = [
    "OUTCOMES",
    "RunRecord",
    "consecutive_skips",
    "encode_finished",
    "encode_release",
    "encode_started",
    "entries_for",
    "from_entries",
    "history",
    "last",
    "record",
]

OUTCOMES = ("ok", "skipped", "failed", "lost", "aborted", "released", "running")

# One encoder for every record: json.dumps with options builds a new encoder per call.
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode
_HOST_JSON = _encode(HOST)
# The fields every run record starts with; ``extra`` may not shadow them on the
# pre-encoded path (a mapping that does goes through the general one).
_BASE_FIELDS = frozenset(("task_id", "host", "pid", "at"))


def encode_started(task_id: str | None, extra: Mapping[str, Any]) -> str:
    """The record ACQUIRE writes as the ``started`` (or ``skipped``) entry."""
    if extra and not _BASE_FIELDS.isdisjoint(extra):
        data = {"task_id": task_id, "host": HOST, "pid": current_pid(), "at": time.time()}
        data.update(extra)
        return _encode(data)
    # The same JSON object, built without a dict per run: this is on every acquire.
    head = (
        f'{{"task_id":{_encode(task_id)},"host":{_HOST_JSON},'
        f'"pid":{current_pid()},"at":{time.time()!r}'
    )
    return f"{head},{_encode(dict(extra))[1:]}" if extra else head + "}"


def encode_finished(task_id: str | None, duration: float, reason: str | None) -> str:
    """The record RELEASE writes as the ``finished`` entry (it pairs with ``started``)."""
    # The "started" entry already says who, where and with what; this one adds only how
    # it ended. Built as text, not from a dict: this is on every release.
    record = (
        f'{{"task_id":{_encode(task_id)},"host":{_HOST_JSON},"pid":{current_pid()},'
        f'"duration":{round(duration, 6)!r}'
    )
    return record + (f',"reason":{_encode(redact(reason))}}}' if reason else "}")


def encode_release(reason: str | None, **data: Any) -> str:
    """The record of a claim cleared from outside (an operator, a supervisor)."""
    payload: dict[str, Any] = {
        "host": HOST,
        "pid": current_pid(),
        "at": time.time(),
        "reason": reason,
    }
    payload.update(data)
    return _encode(payload)


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

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _entry_time(entry_id: str) -> float:
    return int(entry_id.split("-", 1)[0]) / 1000.0


def _fields(raw: Any) -> dict[str, str]:
    return {as_text(k): as_text(v) for k, v in raw.items()}


def _worker(data: dict[str, Any]) -> str | None:
    if data.get("worker"):
        return str(data["worker"])
    if data.get("host"):
        return f"{data['host']}:{data.get('pid')}"
    return None


def history(
    client: Any, name: str, *, limit: int = 20, namespace: str = "fenced"
) -> list[RunRecord]:
    """The most recent runs of a claim, newest first (one round trip)."""
    keys = ClaimKeys.of(name, namespace)
    entries = client.xrevrange(keys.runs, count=entries_for(limit))
    return from_entries(name, entries, limit)


def entries_for(limit: int) -> int:
    """How many stream entries to read for ``limit`` runs (each run writes up to two)."""
    return max(1, limit) * 2 + 2


def from_entries(name: str, entries: Any, limit: int = 20) -> list[RunRecord]:
    """Assemble runs, newest first, from XREVRANGE entries (for callers that pipeline)."""
    finished: dict[str, tuple[str, dict[str, str]]] = {}
    runs: list[tuple[float, RunRecord]] = []
    # An operator's release, listed on its own unless it turns out to be the only end
    # of a run in the window: then it is that run's end, not a second entry.
    releases: dict[str, tuple[float, RunRecord]] = {}
    for entry_id, raw in entries:
        eid = as_text(entry_id)
        f = _fields(raw)
        data = json.loads(f.get("r") or "{}")
        event = f.get("event")
        at = _entry_time(eid)
        if event in ("finished", "released"):
            # Newest first: a run cleared by an operator and then finished by its holder
            # (as lost) ends with the holder's own record, not the release.
            finished.setdefault(short_token(f.get("token", "")), (eid, f))
            if event == "released":
                act = (at, _released(name, f, data, at))
                releases.setdefault(short_token(f.get("token", "")), act)
                runs.append(act)
            continue
        if event == "skipped":
            runs.append(
                (
                    at,
                    RunRecord(
                        name=name,
                        outcome="skipped",
                        task_id=data.get("task_id"),
                        worker=_worker(data),
                        started=at,
                        finished=at,
                        duration=0.0,
                        reason=f.get("reason") or data.get("reason", "already running"),
                        holder=str(Holder.parse(f["holder"])) if f.get("holder") else None,
                        extra=_extra(data),
                    ),
                )
            )
            continue
        if event == "started":
            # Runs pair by their tokens' start: the whole token would release a live lease.
            token = short_token(f.get("token", ""))
            end = finished.pop(token, None)
            rec = RunRecord(
                name=name,
                outcome="running",
                task_id=data.get("task_id"),
                worker=_worker(data),
                token=token,
                fence=int(f["fence"]) if f.get("fence") else None,
                started=at,
                extra=_extra(data),
            )
            if end is not None:
                end_id, end_f = end
                end_data = json.loads(end_f.get("r") or "{}")
                rec.outcome = end_f.get("outcome", "ok")
                rec.finished = _entry_time(end_id)
                rec.duration = end_data.get("duration", rec.finished - at)
                rec.reason = end_data.get("reason") or end_f.get("note")
                rec.extra.update(_extra(end_data))
                if end_f.get("event") == "released":
                    cleared = releases.get(token)
                    if cleared is not None and cleared in runs:
                        runs.remove(cleared)
            runs.append((at, rec))
    # Finished entries whose start fell outside the window still tell an outcome.
    for token, (eid, f) in finished.items():
        if f.get("event") != "finished":
            continue
        data = json.loads(f.get("r") or "{}")
        at = _entry_time(eid)
        runs.append(
            (
                at,
                RunRecord(
                    name=name,
                    outcome=f.get("outcome", "ok"),
                    task_id=data.get("task_id"),
                    worker=_worker(data),
                    token=token,
                    fence=int(f["fence"]) if f.get("fence", "0") not in ("", "0") else None,
                    finished=at,
                    duration=data.get("duration"),
                    reason=data.get("reason") or f.get("note"),
                    extra=_extra(data),
                ),
            )
        )
    runs.sort(key=lambda pair: pair[0], reverse=True)
    return [rec for _at, rec in runs[:limit]]


_CORE = {"task_id", "host", "pid", "at", "worker", "reason", "duration", "outcome"}


def _extra(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in _CORE}


def _released(name: str, f: dict[str, str], data: dict[str, Any], at: float) -> RunRecord:
    return RunRecord(
        name=name,
        outcome="released",
        worker=_worker(data),
        token=short_token(f["token"]) if f.get("token") else None,
        finished=at,
        reason=data.get("reason"),
        holder=str(Holder.parse(f["token"])) if f.get("token") else None,
        extra=_extra(data),
    )


def last(client: Any, name: str, *, namespace: str = "fenced") -> RunRecord | None:
    """The most recent run of a claim, or None."""
    runs = history(client, name, limit=1, namespace=namespace)
    return runs[0] if runs else None


def consecutive_skips(client: Any, name: str, *, namespace: str = "fenced") -> int:
    """Skips since the last successful run of a claim."""
    value = client.get(ClaimKeys.of(name, namespace).skips)
    return int(value) if value is not None else 0


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
    """Append one record outside a lease operation (e.g. an aborted run before acquire)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r} is not one of {', '.join(OUTCOMES)}")
    keys = ClaimKeys.of(name, namespace)
    data.setdefault("at", time.time())
    payload = _encode(data)
    return as_text(
        RECORD(
            client,
            [keys.runs, keys.skips],
            [event, outcome, payload, max_records, token, int(idle_ttl * 1000) if idle_ttl else 0],
        )
    )

"""What Redis holds of a beat led under fenced (``fenced.celery.beat``), read without
Celery: the leader's claim, each entry's last due time and next one, the task id of a tick.

``fenced beat NAME`` prints it; :func:`status` returns it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ._lease import ClaimKeys, Holder, fence_or_none, ms_or_none
from ._printable import printable, readable

__all__ = [
    "BeatStatus",
    "EntryState",
    "as_dict",
    "at",
    "beat_of",
    "claim_of",
    "lines",
    "of_state",
    "read_state",
    "task_id",
]


def claim_of(name: str) -> str:
    """The name of the claim a beat's leader holds."""
    return f"beat:{name}"


def at(ms: int) -> datetime:
    """A time in ms since the epoch, in UTC."""
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def task_id(beat_name: str, entry: str, due_ms: int) -> str:
    """The task id of an entry's tick: the same for every beat and every send of it."""
    return f"fenced-beat:{beat_name}:{entry}:{due_ms}"


@dataclass(frozen=True)
class EntryState:
    """An entry's last due time as Redis holds it."""

    due_ms: int
    fence: int
    #: ``pending`` (granted, not known to be sent), ``sent``, or ``skipped`` (passed
    #: over, or the time the entry was first seen: nothing ran)
    state: str
    raw: str

    @classmethod
    def parse(cls, value: Any) -> EntryState | None:
        """A stored value, or None when it is not one fenced wrote (a due time no date
        can show, a fence no script mints, bytes that are not UTF-8)."""
        text = readable(value)
        parts = text.split(":")
        if len(parts) != 3:
            return None
        due, fence = ms_or_none(parts[0]), fence_or_none(parts[1])
        if due is None or fence is None:
            return None
        return cls(due, fence, parts[2], text)

    @property
    def due(self) -> datetime:
        """The due time, in UTC."""
        return at(self.due_ms)


def read_state(
    client: Any, keys: ClaimKeys
) -> tuple[dict[str, EntryState], int | None, dict[str, int]]:
    """Each entry's stored state, the leader's last tick (ms) and each entry's next due
    time (ms) as the leader last wrote it, in one round trip."""
    fields = client.hgetall(keys.beat)
    entries: dict[str, EntryState] = {}
    tick = None
    upcoming: dict[str, int] = {}
    for key, value in fields.items():
        name = readable(key)  # what fenced never wrote is read, and shown escaped
        if name == "tick":
            tick = ms_or_none(value)
        elif name.startswith("entry:"):
            parsed = EntryState.parse(value)
            if parsed is not None:
                entries[name[len("entry:") :]] = parsed
        elif name.startswith("next:"):
            upcoming_ms = ms_or_none(value)
            if upcoming_ms is not None:
                upcoming[name[len("next:") :]] = upcoming_ms
    return entries, tick, upcoming


@dataclass(frozen=True)
class BeatStatus:
    """What Redis says of a beat: its leader, the leader's last tick, every entry."""

    name: str
    leader: Holder | None
    last_tick: datetime | None
    entries: Mapping[str, EntryState]
    #: Each entry's next due time, as the leader last wrote it (an entry not there: not
    #: known; a leader since gone wrote it: it comes when a beat leads again).
    upcoming: Mapping[str, datetime] = field(default_factory=dict)


def of_state(
    name: str,
    leader: Holder | None,
    entries: dict[str, EntryState],
    tick: int | None,
    upcoming: dict[str, int],
) -> BeatStatus:
    """A beat's status from its leader and what :func:`read_state` read."""
    nexts = {entry: at(ms) for entry, ms in upcoming.items() if entry in entries}
    return BeatStatus(name, leader, None if tick is None else at(tick), entries, nexts)


def as_dict(report: BeatStatus) -> dict[str, Any]:
    """A beat's status as JSON data (``fenced beat --json``)."""
    leader = report.leader
    return {
        "beat": report.name,
        "claim": claim_of(report.name),
        "leader": None
        if leader is None
        else {
            "host": leader.host,
            "pid": leader.pid,
            "fence": leader.fence,
            "token": leader.token,
            "expires_in": leader.expires_in,
        },
        "last_tick": _iso(report.last_tick),
        "entries": {
            name: {
                "due": e.due.isoformat(),
                "fence": e.fence,
                "state": e.state,
                "next": _iso(report.upcoming.get(name)),
            }
            for name, e in sorted(report.entries.items())
        },
    }


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.isoformat()


def beat_of(claim: str) -> str | None:
    """The beat whose leader holds the claim ``claim`` (``beat:NAME``), or None."""
    prefix = claim_of("")
    return claim[len(prefix) :] if claim.startswith(prefix) and len(claim) > len(prefix) else None


def lines(report: BeatStatus) -> list[str]:
    """A beat's status as ``fenced beat NAME`` prints it: who leads, the last tick, and
    each entry's last due time (its state) and next one."""
    name, leader = printable(report.name), report.leader
    if leader is None:
        out = [f"beat {name}: no leader (claim {printable(claim_of(report.name))} is free)"]
    else:
        left = "" if leader.expires_in is None else f", lease {leader.expires_in:.1f}s left"
        out = [
            f"beat {name}: led by {printable(leader.host)} pid {leader.pid} "
            f"fence {leader.fence}{left}"
        ]
    if report.last_tick is not None:
        out.append(f"last tick: {report.last_tick.isoformat()}")
    for entry, state in sorted(report.entries.items()):
        upcoming = report.upcoming.get(entry)
        then = "" if upcoming is None else f", next {upcoming.isoformat()}"
        out.append(
            f"  {printable(entry)}: {state.due.isoformat()} {printable(state.state)} "
            f"(fence {state.fence}){then}"
        )
    return out

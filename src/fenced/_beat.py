"""What Redis holds of a beat led under fenced (``fenced.celery.beat``), read without
Celery: the leader's claim, each entry's last due time, the task id of a tick.

``fenced beat NAME`` prints it; :func:`status` returns it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ._inspect import read_holder
from ._lease import ClaimKeys, Holder
from ._scripts import as_text

__all__ = ["BeatStatus", "EntryState", "at", "claim_of", "read_state", "status", "task_id"]


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
        """A stored value, or None when it is not one fenced wrote."""
        text = as_text(value)
        parts = text.split(":")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
            return None
        return cls(int(parts[0]), int(parts[1]), parts[2], text)

    @property
    def due(self) -> datetime:
        """The due time, in UTC."""
        return at(self.due_ms)


def read_state(client: Any, keys: ClaimKeys) -> tuple[dict[str, EntryState], int | None]:
    """Each entry's stored state and the leader's last tick (ms), in one round trip."""
    fields = client.hgetall(keys.beat)
    entries: dict[str, EntryState] = {}
    tick = None
    for field, value in fields.items():
        name = as_text(field)
        if name == "tick":
            text = as_text(value)
            tick = int(text) if text.isdigit() else None
        elif name.startswith("entry:"):
            parsed = EntryState.parse(value)
            if parsed is not None:
                entries[name[len("entry:") :]] = parsed
    return entries, tick


@dataclass(frozen=True)
class BeatStatus:
    """What Redis says of a beat: its leader, the leader's last tick, every entry."""

    name: str
    leader: Holder | None
    last_tick: datetime | None
    entries: Mapping[str, EntryState]


def status(client: Any, name: str, *, namespace: str = "fenced") -> BeatStatus:
    """The leader of beat ``name`` (its fence), its last tick and each entry's last due."""
    claim = claim_of(name)
    keys = ClaimKeys.of(claim, namespace)
    leader = read_holder(client, claim, namespace=namespace)
    entries, tick = read_state(client, keys)
    return BeatStatus(name, leader, None if tick is None else at(tick), entries)


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
        "last_tick": None if report.last_tick is None else report.last_tick.isoformat(),
        "entries": {
            name: {"due": e.due.isoformat(), "fence": e.fence, "state": e.state}
            for name, e in sorted(report.entries.items())
        },
    }

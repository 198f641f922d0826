"""The beat lane's checker: the ticks the worker ran (``bt-run``, chaos/beat_app.py)
against each entry's schedule (chaos/beat_schedule.py) and the faults the nemesis made.

A tick is (entry, due time); fenced's leader sends it under the task id
``fenced-beat:chaos:<entry>:<due ms>``. Due times are on Redis's clock, the host's
(one machine); the worker notes the monotonic time of each run, and each log line
carries both clocks, which relate the two.

Invariants (any violation fails the run):

- ``beat-tick``: every run is a tick of its entry: its task id is fenced's for that
  entry, and its due time lies on the entry's schedule (one task id per tick: no
  second sender, no due time off the calendar, which a leader whose clock runs ahead
  would make);
- ``beat-once``: a tick runs once; twice only when a fault hit a leader (killed,
  paused) between its due time and its second run: a granted tick not yet marked sent
  is sent again, under the same task id, by the next leader;
- ``beat-every``: every due tick from an entry's first run to the end of the run ran;
  under catch-up ``skip``, ticks that fell due while a fault held the lead may be
  passed over (the window: from :data:`LATE` seconds before the fault, a tick due then
  perhaps not sent yet, to a failover's :data:`FAILOVER` seconds after a leader was
  killed or paused, or until the chosen beat led, for the faults that hand it the lead);
- ``beat-late``: each tick ran within :data:`LATE` seconds of its due time, or of the
  end of the fault window that held it. The clock fault's window ends when the beat
  whose clock runs ahead leads: from then on its ticks must be on time (no stall
  while its clock runs ahead, nor after it comes back);
- ``beat-early``: no tick ran more than 1 s (``AHEAD_MS``, the script's tolerance of
  clocks) plus :data:`EARLY_SLACK` before its due time.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from fenced.celery.beat import AHEAD_MS, next_due

from .beat_schedule import BEAT_NAME, BEAT_TTL, entries
from .config import BEAT_FAULTS

__all__ = ["INVARIANTS", "BeatStats", "check_beat"]

Event = dict[str, Any]

INVARIANTS = {
    "beat-tick": "beat: every run is a tick of its entry (fenced's task id, on the calendar)",
    "beat-once": "beat: a tick runs once (twice only after a fault hit a leader)",
    "beat-every": "beat: every due tick ran (catch-up skip: but for a fault's window)",
    "beat-late": "beat: every tick ran within a bound of its due time or its fault",
    "beat-early": "beat: no tick ran before its due time (1 s of clock tolerance)",
}
#: A leader's failover: its lease runs out, a stand-by polls (ttl/5), and slack.
FAILOVER = 1.2 * BEAT_TTL + 1.5
#: How late a tick may run when no fault held the lead: the leader wakes for its due
#: time, publishes, the worker takes it (two loaded cores).
LATE = 2.5
EARLY_SLACK = 0.3


@dataclass
class BeatStats:
    """What the beat lane did."""

    runs: dict[str, int] = field(default_factory=dict)
    ticks: dict[str, int] = field(default_factory=dict)
    twice: int = 0
    passed_over: dict[str, int] = field(default_factory=dict)
    late_p50_max: dict[str, str] = field(default_factory=dict)
    replies_dropped: int = 0
    beat_starts: int = 0
    windows: int = 0


def _windows(faults: list[Any]) -> list[tuple[float, float]]:
    """Where a fault held the lead: (start, end) in monotonic seconds."""
    out = []
    for f in faults:
        if f.kind not in BEAT_FAULTS:
            continue
        led = f.details.get("led")
        # Killed or paused: the leader's lease runs out, a stand-by takes over. Handed
        # to a chosen beat: held until it led (the nemesis saw it lead). A tick due
        # shortly before the fault may not have been sent yet: the window opens LATE
        # seconds before it.
        end = f.start + FAILOVER if led is None else float(led) + 0.5
        out.append((f.start - LATE, end))
    return sorted(out)


def _held_until(windows: list[tuple[float, float]], t: float) -> float:
    """The end of the chain of fault windows that holds a tick due at ``t`` (``t``
    when none does)."""
    end = t
    for a, b in windows:
        if a <= end and b > end:
            end = b
    return end


def _on_grid(sched: Any, first: int, due: int) -> bool:
    every = getattr(sched, "run_every", None)
    if type(sched).__name__ == "schedule" and every is not None:
        period = round(float(every.total_seconds()) * 1000)
        return (due - first) % period == 0
    # A calendar: due is the next due time after the moment before it.
    return next_due(sched, due - 1) == due


def previous_due_of(sched: Any, due: int) -> int:
    """A moment from which ``due`` is the next due time of ``sched``."""
    return due - 1


def check_beat(
    events: list[Event], faults: list[Any], timeline: Any
) -> tuple[list[Any], BeatStats, dict[str, str]]:
    """The beat lane's violations, figures, and what each invariant checked."""
    from .checker import Violation

    stats = BeatStats()
    violations: list[Any] = []
    runs = [e for e in events if e.get("ev") == "bt-run"]
    stats.replies_dropped = sum(1 for e in events if e.get("ev") == "beat-reply-dropped")
    stats.beat_starts = sum(1 for e in events if e.get("ev") == "beat-start")
    offsets = [float(e["wall"]) - float(e["t"]) for e in events if "wall" in e and "t" in e]
    off = statistics.median(offsets) if offsets else 0.0
    stops = [float(e["t"]) for e in events if e.get("ev") == "beat-stopped"]
    end = min(stops) if stops else (max(float(e["t"]) for e in runs) if runs else 0.0)
    # A calendar's ticks are checked from a second after the first beat led.
    led = [float(e["t"]) for e in events if e.get("ev") == "beat-leading"]
    begin = min(led) + 1.0 if led else None
    windows = _windows(faults)
    stats.windows = len(windows)
    kinds = {f.kind for f in faults}
    hits = sorted(f.start for f in faults if f.kind in BEAT_FAULTS)
    spec = entries()
    by_tick: dict[tuple[str, int], list[Event]] = defaultdict(list)
    n_checked = Counter[str]()

    def v(inv: str, t: float, what: str) -> None:
        violations.append(Violation(inv, t, what, timeline.before(t)))

    for e in runs:
        t, entry, tid, due = float(e["t"]), str(e["entry"]), str(e["id"]), e.get("due")
        prefix = f"fenced-beat:{BEAT_NAME}:{entry}:"
        if entry not in spec or due is None or not tid.startswith(prefix):
            v("beat-tick", t, f"{entry}: a run under task id {tid}, not one of fenced's ticks "
                              "(a second sender?)")  # fmt: skip
            continue
        by_tick[(entry, int(due))].append(e)
    for entry, e in spec.items():
        sched = e["schedule"]
        dues = sorted(d for (n, d) in by_tick if n == entry)
        stats.runs[entry] = sum(len(by_tick[(entry, d)]) for d in dues)
        stats.ticks[entry] = len(dues)
        every = getattr(sched, "run_every", None) if type(sched).__name__ == "schedule" else None
        if every is None and begin is not None:
            first = next_due(sched, round((begin + off) * 1000))
            # From the first due time on the calendar after the lane began.
            start = previous_due_of(sched, first)
        elif dues:
            first = start = dues[0]
        else:
            if begin is not None and end - begin > 3 * LATE:
                v("beat-every", end, f"{entry}: not one tick ran")
            continue
        late: list[float] = []
        for due in dues:
            ran = sorted(by_tick[(entry, due)], key=lambda x: float(x["t"]))
            t_due = due / 1000 - off
            t_run = float(ran[0]["t"])
            if not _on_grid(sched, first, due):
                v("beat-tick", t_run, f"{entry}: tick due {due} is not on its calendar")
            if len(ran) > 1:
                stats.twice += 1
                second = float(ran[1]["t"])
                if not any(t_due - LATE <= h <= second for h in hits):
                    v("beat-once", second, f"{entry}: tick due {due} ran {len(ran)} times "
                                           "with no fault on a leader before")  # fmt: skip
            held = _held_until(windows, t_due)
            late.append(t_run - t_due)
            if t_run > held + LATE:
                why = "" if held == t_due else f" (a fault held the lead until {held:.3f})"
                v("beat-late", t_run, f"{entry}: tick due {due} ran {t_run - t_due:.2f} s after "
                                      f"its due time{why}; bound {LATE:g} s")  # fmt: skip
            if t_run < t_due - AHEAD_MS / 1000 - EARLY_SLACK:
                v("beat-early", t_run, f"{entry}: tick due {due} ran {t_due - t_run:.2f} s "
                                       "before its due time")  # fmt: skip
        n_checked[entry] = len(dues)
        if late:
            stats.late_p50_max[entry] = f"{statistics.median(late):.2f} / {max(late):.2f} s"
        # beat-every: each due time on the calendar from the first tick on.
        seen = set(dues)
        due = start
        missed = 0
        for _ in range(100_000):
            due = next_due(sched, due)
            t_due = due / 1000 - off
            if _held_until(windows, t_due) + LATE > end:
                break
            if due in seen:
                continue
            in_window = _held_until(windows, t_due) > t_due
            if e["catch_up"] == "skip" and in_window:
                missed += 1
                continue
            v(
                "beat-every",
                t_due,
                f"{entry}: tick due {due} never ran"
                + (" (catch-up all: it should have, late)" if in_window else ""),
            )
        stats.passed_over[entry] = missed
    checked = {
        "beat-tick": f"{len(runs)} runs",
        "beat-once": f"{sum(stats.ticks.values())} ticks, {stats.twice} ran twice",
        "beat-every": ", ".join(f"{k} {n}" for k, n in n_checked.items()) or "no runs",
        "beat-late": f"{len(windows)} fault windows",
        "beat-early": f"{stats.replies_dropped} replies dropped, "
        f"{'clock ahead' if 'beat_clock_ahead' in kinds else 'no clock fault'}",
    }
    return violations, stats, checked

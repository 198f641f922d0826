"""The checker: from the event logs, the lane file and the final stores to a verdict.

Order between processes is only claimed where the logs prove it: a write "came after"
another when it *began* after the other's answer arrived (``t0`` after ``t1``, on the
machine's one monotonic clock). Every violation names the invariant it breaks and the
fault that preceded it.

Invariants of the fenced lane (any violation fails the run):

- ``store-order``: each store accepted fences in non-decreasing order (the Redis
  pointer's publish stream, the upsert's log table);
- ``stale-accepted``: no write was accepted after a write under a higher fence had
  been accepted by the same store (every store, from the logs);
- ``final-value``: each store ends with the last write made under the highest fence
  it accepted;
- ``fence-order``: a grant asked for after another grant arrived has a higher fence,
  across every restart of the lock Redis;
- ``unreachable``: no grant arrived while the lock Redis was down (or, for the proxied
  worker, black-holed), and no holder passed a check more than one ttl after its
  Redis became unreachable (it cannot have renewed since);
- ``late-grant``: no grant that arrived later than the ttl after it was asked is
  counted as acquired (its deadline had passed: it must be given back);
- ``release``: a front end reports success (``release()`` True, a ``with`` block or an
  ``@exclusive`` call ending without ``ClaimLost``) only when its lease still existed
  when the release was sent;
- ``model-check``, ``model-refusal``: the run's steps are steps the protocol's model
  (spec/fenced.qnt, docs/model.md) allows. A check that passed is the model's
  ``startWrite``, allowed only to a holder that believes it holds the claim, which no
  holder does once a newer fence was granted unless Redis forgot its lease: so no check
  passes after a grant of a higher fence arrived, unless the lock Redis restarted
  between the checking holder's grant and that one. A write refused as stale is the
  model's ``landWrite`` refusing it, only when the store accepted a higher fence: so
  every refusal has a write under a higher fence to the same store that began before
  the refusal came (accepted, or of unknown outcome: its writer killed or failed);
- ``run-overlap``, ``run-orphan``: two ``fenced run`` commands never ran at once,
  and a command stops within a ttl when its runner is killed. One exception, counted
  apart: a restart of the lock Redis without persistence forgets the lease, the next
  runner is granted it at once, and the first learns of the loss at its next renewal;
  a command carries no fence, so what is checked then is that it stopped within a ttl.

Counted, not failed: overlaps (two holders believing they held the claim at once)
and what ended each one; recovery after each fault; the Lock lane's double-writes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .beat_check import INVARIANTS as BEAT_INVARIANTS
from .beat_check import BeatStats
from .config import FAULTS, Config
from .dedup_check import INVARIANTS as DEDUP_INVARIANTS
from .dedup_check import DedupStats
from .runlane import Command
from .stores import STORES, Final

__all__ = ["Report", "Setup", "Violation", "check", "recheck", "save_inputs"]

Event = dict[str, Any]

INVARIANTS = {
    "store-order": "each store accepted fences in non-decreasing order",
    "stale-accepted": "no stale write accepted after a newer holder's write",
    "final-value": "final value = last write under the highest accepted fence",
    "fence-order": "fences strictly increasing, across lock Redis restarts",
    "unreachable": "no work started or continued while the lock Redis was unreachable",
    "late-grant": "no grant counted as acquired after its own deadline",
    "release": "success reported only when the lease lasted until the release",
    "model-check": "model: no check passes once a higher fence was granted (but a restart)",
    "model-refusal": "model: a store refuses a write only after a higher fence came to it",
    "run-overlap": "fenced run: no two commands at once (after a restart: < 1 ttl)",
    "run-orphan": "fenced run: a command stops when its runner is killed",
}
#: How an overlap between two holders ended, in the order the report lists them.
OVERLAP_CLASSES = {
    "fence": "the older holder's write was refused by the fence",
    "stopped": "the older holder stopped before writing (check, loss or kill)",
    "first": "the older holder's writes landed before the newer holder wrote",
    "landed": "a stale write landed over the newer holder's write",
}
#: A fault more than this long before a violation is not named as its cause.
ATTRIBUTION_WINDOW = 30.0


@dataclass
class Setup:
    """What ran, for the report's header."""

    seconds: float
    ttl: float
    workers: int
    fronts: str
    baseline_workers: int
    celery_children: int
    runners: int
    sql: str
    #: The dedup lane: its worker's prefork children (0: lane off), cooldown, --broken.
    dedup_children: int = 0
    dedup_cooldown: float = 0.0
    broken: str = ""
    #: Seconds the dedup lane took after the faults to account for its calls.
    drain_seconds: float = 0.0
    #: The dedup lane's claim ttl (its replaced runs stop within a third of it).
    dedup_ttl: float = 3.0
    #: The beat lane's celery beat processes (0: lane off).
    beats: int = 0
    #: The stores written, comma-separated ("object": the ObjectPointer on Azurite).
    stores: str = ",".join(STORES[:-1])

    @property
    def store_names(self) -> tuple[str, ...]:
        return tuple(self.stores.split(","))

    @classmethod
    def of(
        cls,
        cfg: Config,
        sql_url: str,
        celery: bool,
        drain: dict[str, Any] | None = None,
        stores: tuple[str, ...] = STORES[:-1],
    ) -> Setup:
        claim = (cfg.workers + 1) // 2
        return cls(
            seconds=cfg.seconds,
            ttl=cfg.ttl,
            workers=cfg.workers,
            fronts=f"{claim} Claim, {cfg.workers - claim} @exclusive",
            baseline_workers=cfg.n_baseline,
            celery_children=cfg.celery_children if celery else 0,
            runners=cfg.runners if cfg.run_lane else 0,
            sql=sql_url.split(":", 1)[0].split("+", 1)[0],
            dedup_children=cfg.dedup_children if cfg.dedup else 0,
            dedup_cooldown=cfg.dedup_cooldown,
            broken=",".join(cfg.broken),
            drain_seconds=float((drain or {}).get("seconds", 0.0)),
            beats=cfg.beats if cfg.beat else 0,
            dedup_ttl=cfg.dedup_ttl,
            stores=",".join(stores),
        )


@dataclass
class Fault:
    n: int
    kind: str
    start: float
    end: float
    wall: float
    details: dict[str, Any]


@dataclass
class Write:
    holding: Holding
    store: str
    wid: str
    t0: float
    t1: float | None = None
    result: str | None = None  # accepted, stale, error; None: the writer never said


@dataclass
class Holding:
    lane: str
    w: str
    pid: int
    hold: int
    front: str
    fence: int | None
    sent: float
    acked: float
    end: float | None = None
    end_how: str = ""
    #: What the front end reported: release() True; a with block or @exclusive call that
    #: ended without ClaimLost. None where it reports nothing (Celery, killed).
    released_ok: bool | None = None
    #: When the release was about to be sent (the "releasing" event), else the last work.
    release_from: float | None = None
    work_end: float = 0.0
    steps: list[float] = field(default_factory=list)
    writes: list[Write] = field(default_factory=list)
    rank: float | None = None

    @property
    def label(self) -> str:
        fence = f" fence {self.fence}" if self.fence is not None else ""
        return f"{self.w} (pid {self.pid}, {self.front}{fence})"


@dataclass
class Violation:
    """One broken invariant, with the fault that preceded it."""

    invariant: str
    t: float | None
    message: str
    after: str

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.message}; {self.after}"


@dataclass
class LaneStats:
    """What one lane did and suffered."""

    lane: str
    acquisitions: int = 0
    #: Acquisitions per front end (claim/explicit, claim/with, exclusive, celery, lock).
    fronts: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    unavailable: int = 0
    writes: dict[str, dict[str, int]] = field(default_factory=dict)
    overlaps: dict[str, int] = field(default_factory=dict)
    #: Stale writes that landed over a newer holder's write, per store (from the logs).
    double_writes: dict[str, int] = field(default_factory=dict)
    #: Entries below an earlier one in the store's own order of acceptance, per store.
    order_regressions: dict[str, int | None] = field(default_factory=dict)
    final_newest: dict[str, bool] = field(default_factory=dict)
    recovery: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class Report:
    """The verdict of one run."""

    setup: Setup
    faults: dict[str, int]
    skipped_faults: dict[str, int]
    failed_faults: dict[str, int]
    violations: list[Violation]
    fenced: LaneStats
    lock: LaneStats | None
    run_lane: dict[str, Any]
    checked: dict[str, str]
    dedup: DedupStats | None = None
    beat: BeatStats | None = None

    @property
    def ok(self) -> bool:
        """No invariant of the fenced lane was broken."""
        return not self.violations

    def by_invariant(self) -> Counter[str]:
        return Counter(v.invariant for v in self.violations)

    def write(self, path: Path) -> None:
        data = asdict(self)
        data["ok"] = self.ok
        path.write_text(json.dumps(data, indent=2, default=str))

    # -- the tables -----------------------------------------------------------------------

    def tables(self, max_violations: int = 40) -> str:
        s = self.setup
        lines = [
            f"fenced under faults: {s.seconds:g} s, ttl {s.ttl:g} s; fenced lane: {s.workers} "
            f"workers ({s.fronts})"
            + (f" + ClaimedTask (celery prefork, {s.celery_children} children)"
               if s.celery_children else "")
            + (f"; fenced run lane: {s.runners} runners" if s.runners else "")
            + (f"; Lock lane: {s.baseline_workers} workers" if self.lock else "")
            + f"; upserts on {s.sql}"
            + (f"; dedup lane: celery prefork, {s.dedup_children} children"
               + (f", BROKEN: {s.broken}" if s.broken else "") if s.dedup_children else "")
            + (f"; beat lane: {s.beats} celery beat" if s.beats else ""),
            f"faults injected: {sum(self.faults.values())} ("
            + ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items(), key=_fault_order))
            + ")",
            "",
        ]  # fmt: skip
        counts = self.by_invariant()
        rows: list[tuple[str, ...]] = [("invariant (fenced lane)", "result", "checked")]
        every = {
            **INVARIANTS,
            **(DEDUP_INVARIANTS if self.dedup is not None else {}),
            **(BEAT_INVARIANTS if self.beat is not None else {}),
        }
        for key, text in every.items():
            n = counts.get(key, 0)
            rows.append((text, "ok" if n == 0 else f"VIOLATED x{n}", self.checked.get(key, "")))
        f = self.fenced
        rows.append(
            (
                "overlaps: two holders at once (from the logs)",
                str(sum(f.overlaps.values())),
                ", ".join(f"{f.overlaps.get(k, 0)} {k}" for k in OVERLAP_CLASSES),
            )
        )
        rec = [x for xs in f.recovery.values() for x in xs]
        rows.append(("recovery: fault end -> next acquire", _p50_max(rec), f"{len(rec)} faults"))
        lines += _table(rows)
        lines.append(
            "overlap classes: " + "; ".join(f"{k}: {v}" for k, v in OVERLAP_CLASSES.items())
        )
        if self.dedup is not None:
            lines.append("")
            lines += self._dedup()
        if self.beat is not None:
            lines.append("")
            lines += self._beat()
        lines.append("")
        lines += self._side_by_side()
        lines.append("")
        lines += self._per_fault()
        if self.violations:
            lines.append("")
            lines.append(f"violations ({len(self.violations)}):")
            for v in self.violations[:max_violations]:
                lines.append(f"  {v}")
            if len(self.violations) > max_violations:
                more = len(self.violations) - max_violations
                lines.append(f"  ... and {more} more (report.json)")
        lines.append("")
        lines.append(
            "verdict: "
            + ("PASS: no invariant of the fenced lane broke"
               if self.ok else f"FAIL: {len(self.violations)} violation(s)")
        )  # fmt: skip
        return "\n".join(lines)

    def _dedup(self) -> list[str]:
        d = self.dedup
        assert d is not None

        def kv(counts: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "0"

        rows: list[tuple[str, ...]] = [("dedup lane (Celery options)", "figures")]
        rows.append(("calls sent by the feeder", f"{d.calls} ({d.call_errors} refused at send)"))
        rows.append(("  published", str(d.published)))
        rows.append(("  coalesced at enqueue", kv(d.coalesced)))
        rows.append(("runs by claim name", kv(d.runs)))
        rows.append(("  killed mid-run", str(d.killed_runs)))
        rows.append(("skipped, by reason", kv(d.skipped)))
        rows.append(("rerun triggers / reruns run", f"{d.rerun_triggers} / {d.reruns}"))
        rows.append(("retries keeping the claim", str(d.retries)))
        rows.append(("retries: Redis unreachable at acquire", str(d.unavailable_retries)))
        rows.append(("failed runs", str(d.failed)))
        rows.append(("most runs at once, by name", kv(d.max_at_once)))
        rows.append(("chords: sent / body ran", f"{d.chords} / {d.chords_done}"))
        rows.append(("replace: runs replaced by a newer call", kv(d.replaced)))
        rows.append(("  of them by a call sent before theirs (delivery order)",
                     str(d.replaced_by_older)))  # fmt: skip
        rows.append(("  publishes through the fenced pointer", kv(d.publishes)))
        counts = (d.debounce_begun, d.debounce_calls, d.debounce_runs, d.debounce_deferred)
        rows.append(("debounce: calls begun / completed / runs / deferred",
                     " / ".join(str(n) for n in counts)))  # fmt: skip
        rows.append(("  sender killed (mid-publish)",
                     f"{d.sender_kills} ({d.sender_kills_mid_publish})"))  # fmt: skip
        rows.append(("excused: a restart or failover forgot the state", kv(d.excused)))
        rows.append(("drain after the faults", f"{self.setup.drain_seconds:g} s"))
        out = _table(rows)
        if d.beside:
            names = list(d.beside)
            keys = list(next(iter(d.beside.values())))
            side: list[tuple[str, ...]] = [("same calls, same faults", *names)]
            for k in keys:
                side.append((k, *(str(d.beside[n].get(k, "")) for n in names)))
            out += ["", *_table(side)]
        return out

    def _beat(self) -> list[str]:
        b = self.beat
        assert b is not None

        def kv(counts: dict[str, Any]) -> str:
            return ", ".join(f"{k} {v}" for k, v in counts.items()) or "0"

        rows: list[tuple[str, ...]] = [(f"beat lane ({self.setup.beats} celery beat)", "figures")]
        rows.append(("ticks run, by entry", kv(b.ticks)))
        rows.append(("runs, by entry", kv(b.runs)))
        rows.append(("ticks run twice (a fault on a leader)", str(b.twice)))
        rows.append(("passed over in a fault window (catch-up skip)", kv(b.passed_over)))
        rows.append(("lateness p50 / max, by entry", kv(b.late_p50_max)))
        rows.append(("BEAT_DISPATCH replies dropped", str(b.replies_dropped)))
        rows.append(("beat processes started", str(b.beat_starts)))
        return _table(rows)

    def _side_by_side(self) -> list[str]:
        lanes = [self.fenced] + ([self.lock] if self.lock else [])
        head = ("same faults, same work", "fenced", *(["redis-py Lock"] if self.lock else []))
        rows: list[tuple[str, ...]] = [head]

        def row(label: str, fn: Any) -> None:
            rows.append((label, *(str(fn(lane)) for lane in lanes)))

        row("acquisitions", lambda x: x.acquisitions)
        row(
            "  by front end",
            lambda x: ", ".join(f"{k} {v}" for k, v in sorted(x.fronts.items())),
        )
        row("overlaps: two holders at once", lambda x: sum(x.overlaps.values()))
        row(
            "  caught by the fence (stale write refused)",
            lambda x: x.overlaps.get("fence", 0) if x.lane == "fenced" else "-",
        )
        row("  older holder stopped before writing", lambda x: x.overlaps.get("stopped", 0))
        row("  stale write landed", lambda x: x.overlaps.get("landed", 0))
        row(
            "stale writes landed over newer (double-writes)",
            lambda x: sum(x.double_writes.values()),
        )
        for store in self.setup.store_names:
            row(f"  {store}", lambda x, s=store: x.double_writes.get(s, 0))
        row(
            "stale writes refused by the store",
            lambda x: sum(c.get("stale", 0) for c in x.writes.values()),
        )
        row(
            "final value from the newest holder",
            lambda x: "/".join(
                f"{s} {'yes' if x.final_newest.get(s) else 'NO'}" for s in self.setup.store_names
            ),
        )
        row(
            "recovery p50 / max",
            lambda x: _p50_max([r for rs in x.recovery.values() for r in rs]),
        )
        return _table(rows)

    def _per_fault(self) -> list[str]:
        after = Counter(
            v.after.split(" #", 1)[0].split()[-1] for v in self.violations if "#" in v.after
        )
        rows: list[tuple[str, ...]] = [
            ("fault", "injected", "recovery p50 / max (fenced)", "violations after it")
        ]
        for kind in FAULTS:
            if kind not in self.faults and kind not in self.skipped_faults:
                continue
            rec = self.fenced.recovery.get(kind, [])
            if kind == "kill_runner":
                rec = self.run_lane.get("recovery", [])
            rows.append(
                (kind, str(self.faults.get(kind, 0)), _p50_max(rec), str(after.get(kind, 0)))
            )
        return _table(rows)


def _fault_order(item: tuple[str, int]) -> int:
    return FAULTS.index(item[0]) if item[0] in FAULTS else len(FAULTS)


def _p50_max(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} s / {max(values):.2f} s"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


# -- reading the logs ---------------------------------------------------------------------


class Timeline:
    """The faults, for naming the one before a moment."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = sorted(faults, key=lambda f: f.start)
        self.starts = [f.start for f in self.faults]

    def before(self, t: float | None) -> str:
        if t is None:
            return "time unknown"
        i = bisect.bisect_right(self.starts, t) - 1
        if i < 0:
            return "before any fault"
        f = self.faults[i]
        if t <= f.end:
            return f"during {f.kind} #{f.n}{_targets(f)}"
        gap = t - f.end
        if gap > ATTRIBUTION_WINDOW:
            return f"no fault in the {ATTRIBUTION_WINDOW:g} s before (machine load?)"
        return f"{gap:.2f} s after {f.kind} #{f.n}{_targets(f)} ended"

    def between(self, a: float, b: float, kind: str | None = None) -> list[Fault]:
        return [
            f
            for f in self.faults
            if f.start <= b and f.end >= a and (kind is None or f.kind == kind)
        ]


def _targets(f: Fault) -> str:
    targets = f.details.get("targets") or []
    if targets:
        return " (" + ", ".join(f"{t.get('w')} pid {t.get('pid')}" for t in targets) + ")"
    if f.details.get("workers"):
        return " (" + ", ".join(f.details["workers"]) + ")"
    return ""


def _holdings(events: list[Event]) -> tuple[list[Holding], dict[str, Write], dict[int, float]]:
    holdings: dict[tuple[str, int, int], Holding] = {}
    writes: dict[str, Write] = {}
    last_seen: dict[int, float] = {}
    for e in events:
        if e.get("w") == "harness":
            continue
        pid, t = int(e["pid"]), float(e["t"])
        last_seen[pid] = max(last_seen.get(pid, t), t)
        key = (str(e["w"]), pid, int(e.get("hold", 0)))
        ev = e["ev"]
        if ev == "acquired":
            h = Holding(
                lane=e["lane"],
                w=e["w"],
                pid=pid,
                hold=key[2],
                front=f"{e['front']}/{e['form']}" if e.get("form") else e["front"],
                fence=e.get("fence"),
                sent=float(e.get("sent", t)),
                acked=t,
                work_end=t,
            )
            holdings[key] = h
            continue
        h_or_none = holdings.get(key)
        if h_or_none is None:
            continue
        h = h_or_none
        if ev == "step":
            h.steps.append(t)
            h.work_end = max(h.work_end, t)
        elif ev == "writing":
            wr = Write(h, e["store"], e["wid"], t)
            writes[wr.wid] = wr
            h.writes.append(wr)
            h.work_end = max(h.work_end, t)
        elif ev == "write":
            wr_or_none = writes.get(e["wid"])
            if wr_or_none is not None:
                wr_or_none.t1, wr_or_none.result = t, e["result"]
                h.work_end = max(h.work_end, t)
        elif ev in ("lost", "releasing", "released"):
            if h.end is None:
                h.end, h.end_how = t, ev
            if ev == "releasing":
                h.release_from = t
            if ev == "released":
                h.released_ok = e.get("ok")
    return list(holdings.values()), writes, last_seen


def _faults(events: list[Event]) -> tuple[list[Fault], Counter[str], Counter[str]]:
    faults, skipped, failed = [], Counter[str](), Counter[str]()
    for e in events:
        if e.get("w") != "harness":
            continue
        if e["ev"] == "fault":
            details = {
                k: v for k, v in e.items() if k not in ("t", "wall", "ev", "w", "pid", "kind", "n")
            }
            faults.append(
                Fault(
                    int(e["n"]),
                    e["kind"],
                    float(e["t"]),
                    float(e["end"]),
                    float(e["wall"]),
                    details,
                )
            )
        elif e["ev"] == "fault-skipped":
            skipped[e["kind"]] += 1
        elif e["ev"] == "fault-failed":
            failed[e["kind"]] += 1
    return faults, skipped, failed


def _kill_times(faults: list[Fault]) -> dict[int, float]:
    killed: dict[int, float] = {}
    for f in faults:
        if f.kind != "kill_worker":
            continue
        for target in f.details.get("targets", []):
            for pid in target.get("pids") or [target["pid"]]:
                killed.setdefault(int(pid), f.start)
    return killed


def _close_holdings(
    holdings: list[Holding], last_seen: dict[int, float], killed: dict[int, float]
) -> None:
    for h in holdings:
        if h.end is not None:
            continue
        dead = killed.get(h.pid)
        if dead is not None and dead >= h.acked:
            h.end, h.end_how = dead, "killed"
        else:
            h.end, h.end_how = max(h.work_end, last_seen.get(h.pid, h.acked)), "cut"


# -- the checks -------------------------------------------------------------------------


def save_inputs(run_dir: Path, finals: dict[str, dict[str, Final]], setup: Setup) -> None:
    """Keep what the checker reads besides the logs, so a run can be checked again."""
    data = {
        "setup": asdict(setup),
        "finals": {
            lane: {s: asdict(f) for s, f in stores.items()} for lane, stores in finals.items()
        },
    }
    (run_dir / "inputs.json").write_text(json.dumps(data))


def recheck(run_dir: Path) -> Report:
    """Check a finished run again from its directory (logs, lane file, inputs.json)."""
    from .events import read_events
    from .runlane import read_lane

    data = json.loads((run_dir / "inputs.json").read_text())
    finals = {
        lane: {
            s: Final(f["value"], f["fence"], None if f["accepted"] is None else
                     [(str(w), fence) for w, fence in f["accepted"]])
            for s, f in stores.items()
        }
        for lane, stores in data["finals"].items()
    }  # fmt: skip
    return check(
        read_events(run_dir / "logs"), read_lane(run_dir / "run-lane.txt"), finals,
        Setup(**data["setup"]),
    )  # fmt: skip


def check(
    events: list[Event],
    commands: list[Command],
    finals: dict[str, dict[str, Final]],
    setup: Setup,
) -> Report:
    """Check one run: every invariant of the fenced lane, and the figures of both lanes."""
    names = setup.store_names
    faults, skipped, failed = _faults(events)
    timeline = Timeline(faults)
    holdings, writes, last_seen = _holdings(events)
    _close_holdings(holdings, last_seen, _kill_times(faults))
    violations: list[Violation] = []
    checked: dict[str, str] = {}
    lanes: dict[str, LaneStats] = {}
    ttl = setup.ttl
    for lane in ("fenced", "lock"):
        mine = [h for h in holdings if h.lane == lane]
        if lane == "lock" and lane not in finals:
            continue
        _rank(mine, lane)
        stats = LaneStats(lane)
        stats.acquisitions = len(mine)
        stats.fronts = dict(Counter(h.front for h in mine))
        stats.lost = sum(1 for e in events if e.get("lane") == lane and e["ev"] == "lost")
        stats.unavailable = sum(
            1 for e in events if e.get("lane") == lane and e["ev"] == "unavailable"
        )
        lane_writes = [w for h in mine for w in h.writes]
        for store in names:
            stats.writes[store] = dict(
                Counter(w.result or "unknown" for w in lane_writes if w.store == store)
            )
        landed = _stale_landed(lane_writes, names)
        for store in names:
            stats.double_writes[store] = sum(1 for w in landed if w.store == store)
        stats.overlaps = dict(_overlaps(mine, {id(w) for w in landed}))
        stats.recovery = _recovery(mine, faults)
        final = finals.get(lane, {})
        for store in names:
            stats.final_newest[store], problem = _final_check(
                final.get(store), [w for w in lane_writes if w.store == store], writes
            )
            if lane == "fenced" and problem:
                violations.append(
                    Violation("final-value", None, f"{store}: {problem}", "at the end of the run")
                )
            accepted = final[store].accepted if store in final else None
            stats.order_regressions[store] = _regressions(accepted, writes, lane, violations
                                                          if lane == "fenced" else None,
                                                          store, timeline)  # fmt: skip
        if lane == "fenced":
            for w in landed:
                violations.append(
                    Violation(
                        "stale-accepted",
                        w.t0,
                        f"{w.store}: {w.holding.label} wrote {w.wid} at {w.t0:.3f}, accepted, "
                        f"after a write under a higher fence had been accepted",
                        timeline.before(w.t0),
                    )
                )
            n_acc = {s: stats.writes[s].get("accepted", 0) for s in names}
            checked["store-order"] = ", ".join(
                f"{s} {len(finals[lane][s].accepted or [])}"
                for s in names
                if finals.get(lane, {}).get(s) and finals[lane][s].accepted is not None
            )
            checked["stale-accepted"] = ", ".join(f"{s} {n}" for s, n in n_acc.items())
            checked["final-value"] = ", ".join(names)
            restarts = [f for f in faults if f.kind == "restart_lock_redis"]
            violations += _fence_order(mine, timeline)
            checked["fence-order"] = f"{len(mine)} grants, {len(restarts)} restarts"
            violations += _unreachable(mine, faults, ttl, timeline)
            windows = len(restarts) + sum(1 for f in faults if f.kind == "partition")
            checked["unreachable"] = f"{windows} outages"
            violations += _late_grants(mine, faults, ttl, timeline)
            checked["late-grant"] = f"{len(mine)} grants"
            violations += _model_checks(mine, timeline)
            checked["model-check"] = f"{sum(len(h.steps) for h in mine)} checks"
            found = _model_refusals(lane_writes, names, timeline)
            violations += found
            refusals = sum(1 for w in lane_writes if w.result == "stale")
            checked["model-refusal"] = f"{refusals} refusals"
            violations += _releases(mine, faults, timeline)
            checked["release"] = (
                f"{sum(1 for h in mine if h.released_ok is not None)} releases (not Celery's)"
            )
        lanes[lane] = stats
    run_lane = _run_lane(commands, faults, events, ttl, violations, timeline)
    if setup.runners:
        checked["run-overlap"] = (
            f"{len(commands)} commands, {run_lane['overlaps_after_restart']} short overlaps "
            "after a restart"
        )
        checked["run-orphan"] = f"{sum(1 for f in faults if f.kind == 'kill_runner')} kills"
    else:
        checked["run-overlap"] = checked["run-orphan"] = "lane off"
    dedup = None
    if setup.dedup_children:
        from .dedup_check import check_dedup

        found, dedup, dedup_checked = check_dedup(
            events, faults, timeline, setup.dedup_cooldown, setup.dedup_ttl
        )
        violations += found
        checked.update(dedup_checked)
    beat = None
    if setup.beats:
        from .beat_check import check_beat

        found, beat, beat_checked = check_beat(events, faults, timeline)
        violations += found
        checked.update(beat_checked)
    violations.sort(key=lambda v: v.t if v.t is not None else float("inf"))
    return Report(
        dedup=dedup,
        beat=beat,
        setup=setup,
        faults=dict(Counter(f.kind for f in faults)),
        skipped_faults=dict(skipped),
        failed_faults=dict(failed),
        violations=violations,
        fenced=lanes["fenced"],
        lock=lanes.get("lock"),
        run_lane=run_lane,
        checked=checked,
    )


def _rank(holdings: list[Holding], lane: str) -> None:
    """Who is newer: the fence in the fenced lane, the order of grants in the Lock lane."""
    if lane == "fenced":
        for h in holdings:
            h.rank = float(h.fence) if h.fence is not None else None
        return
    for n, h in enumerate(sorted(holdings, key=lambda h: h.acked)):
        h.rank = float(n)


def _stale_landed(lane_writes: list[Write], names: tuple[str, ...]) -> list[Write]:
    """Accepted writes that began after a higher-ranked write to the same store was accepted."""
    out: list[Write] = []
    for store in names:
        accepted = [
            w
            for w in lane_writes
            if w.store == store and w.result == "accepted" and w.holding.rank is not None
        ]
        by_end = sorted(accepted, key=lambda w: w.t1 or 0.0)
        i, best = 0, float("-inf")
        for w in sorted(accepted, key=lambda w: w.t0):
            while i < len(by_end) and (by_end[i].t1 or 0.0) < w.t0:
                best = max(best, by_end[i].holding.rank or 0.0)
                i += 1
            assert w.holding.rank is not None
            if w.holding.rank < best:
                out.append(w)
    return out


def _overlaps(holdings: list[Holding], landed: set[int]) -> Counter[str]:
    """Pairs of holders (different processes) that believed they held at the same time."""
    out: Counter[str] = Counter()
    ranked = sorted((h for h in holdings if h.rank is not None), key=lambda h: h.acked)
    for i, a in enumerate(ranked):
        assert a.end is not None
        for b in ranked[i + 1 :]:
            if b.acked >= a.end:
                break
            if b.pid == a.pid:
                continue
            older, newer = (a, b) if (a.rank or 0) < (b.rank or 0) else (b, a)
            late = [w for w in older.writes if w.t0 >= newer.acked]
            if any(w.result == "stale" for w in late):
                out["fence"] += 1
            elif any(id(w) in landed for w in late):
                out["landed"] += 1
            elif late:
                out["first"] += 1
            else:
                out["stopped"] += 1
    return out


def _recovery(holdings: list[Holding], faults: list[Fault]) -> dict[str, list[float]]:
    acked = sorted(h.acked for h in holdings)
    out: dict[str, list[float]] = defaultdict(list)
    for f in faults:
        if f.kind == "kill_runner":
            continue  # the run lane's own recovery is measured on its commands
        i = bisect.bisect_right(acked, f.end)
        if i < len(acked):
            out[f.kind].append(acked[i] - f.end)
    return dict(out)


def _final_check(
    final: Final | None, store_writes: list[Write], writes: dict[str, Write]
) -> tuple[bool, str | None]:
    """(the final value is the newest holder's last write, what is wrong if not)."""
    accepted = [w for w in store_writes if w.result == "accepted" and w.holding.rank is not None]
    if final is None:
        return False, "the store could not be read"
    if not accepted:
        return final.value is None, None if final.value is None else "a value nobody wrote"
    top = max(w.holding.rank or 0.0 for w in accepted)
    newest = max((w for w in accepted if w.holding.rank == top), key=lambda w: w.t1 or 0.0)
    if final.value == newest.wid:
        return True, None
    got = writes.get(final.value or "")
    # A write whose writer never logged the answer (killed or interrupted mid-write) is
    # fine if it is no older than the newest logged write.
    if (
        got is not None
        and got.result is None
        and got.holding.rank is not None
        and (got.holding.rank > top or (got.holding.rank == top and got.t0 >= (newest.t1 or 0)))
    ):
        return True, None
    shown = f"{got.holding.label}" if got else "unknown writer"
    return False, (
        f"ends with {final.value} (fence {final.fence}, by {shown}), but the last write under "
        f"the highest accepted fence was {newest.wid} by {newest.holding.label}"
    )


def _regressions(
    accepted: list[tuple[str, int | None]] | None,
    writes: dict[str, Write],
    lane: str,
    violations: list[Violation] | None,
    store: str,
    timeline: Timeline,
) -> int | None:
    """Entries of a store's order of acceptance below an earlier one (fenced: violations)."""
    if accepted is None:
        return None
    count, best = 0, float("-inf")
    for wid, fence in accepted:
        w = writes.get(wid)
        rank: float | None
        if lane == "fenced":
            rank = float(fence) if fence is not None else None
        else:
            rank = w.holding.rank if w is not None else None
        if rank is None:
            continue
        if rank < best:
            count += 1
            if violations is not None:
                t = w.t0 if w is not None else None
                violations.append(
                    Violation(
                        "store-order",
                        t,
                        f"{store}: accepted {wid} (fence {fence}) after fence {int(best)}",
                        timeline.before(t),
                    )
                )
        best = max(best, rank)
    return count


def _fence_order(holdings: list[Holding], timeline: Timeline) -> list[Violation]:
    out: list[Violation] = []
    granted = [h for h in holdings if h.fence is not None]
    pending: list[tuple[float, int, Holding]] = []
    for n, h in enumerate(sorted(granted, key=lambda h: h.acked)):
        heapq.heappush(pending, (h.acked, n, h))
    best: Holding | None = None
    for h in sorted(granted, key=lambda h: h.sent):
        while pending and pending[0][0] < h.sent:
            _, _, g = heapq.heappop(pending)
            if best is None or (g.fence or 0) > (best.fence or 0):
                best = g
        if best is not None and (h.fence or 0) <= (best.fence or 0):
            restarts = timeline.between(best.acked, h.sent, "restart_lock_redis")
            across = f" across restart #{restarts[-1].n}" if restarts else ""
            out.append(
                Violation(
                    "fence-order",
                    h.acked,
                    f"{h.label} was granted fence {h.fence}{across}, not above fence "
                    f"{best.fence} granted to {best.label} before it asked",
                    timeline.before(h.acked),
                )
            )
    return out


def _model_checks(holdings: list[Holding], timeline: Timeline) -> list[Violation]:
    """Checks that passed after a higher fence's grant arrived, with no restart of the
    lock Redis between the checking holder's grant and that one (the model's
    ``startWrite`` needs ``believes``, which a newer grant ends unless Redis forgot)."""
    out: list[Violation] = []
    granted = sorted((h for h in holdings if h.fence is not None), key=lambda h: h.acked)
    for a in granted:
        if not a.steps:
            continue
        # The first grant of a higher fence to arrive: a restart before it excuses it and
        # every later one (their windows hold it too).
        newer = next((b for b in granted if b is not a and (b.fence or 0) > (a.fence or 0)
                      and b.acked > a.sent), None)  # fmt: skip
        if newer is None or timeline.between(a.sent, newer.acked, "restart_lock_redis"):
            continue
        late = [t for t in a.steps if t > newer.acked]
        if late:
            out.append(
                Violation(
                    "model-check",
                    late[0],
                    f"{a.label} passed a check at {late[0]:.3f}, after {newer.label} was "
                    f"granted a higher fence at {newer.acked:.3f} with no restart between: "
                    f"a step the model does not allow ({len(late)} such check(s))",
                    timeline.before(late[0]),
                )
            )
    return out


def _model_refusals(
    lane_writes: list[Write], names: tuple[str, ...], timeline: Timeline
) -> list[Violation]:
    """Writes refused as stale with no write under a higher fence to the same store that
    began before the refusal came (the model's ``landWrite`` refuses only then)."""
    out: list[Violation] = []
    for store in names:
        mine = [w for w in lane_writes if w.store == store and w.holding.fence is not None]
        # Writes that may have been accepted (accepted, or of unknown outcome), by start,
        # and the highest fence among the first k of them.
        maybe = sorted((w for w in mine if w.result != "stale"), key=lambda w: w.t0)
        starts = [m.t0 for m in maybe]
        top = list(itertools.accumulate((m.holding.fence or 0 for m in maybe), max))
        for w in mine:
            if w.result != "stale" or w.t1 is None:
                continue
            k = bisect.bisect_left(starts, w.t1)
            if k == 0 or top[k - 1] <= (w.holding.fence or 0):
                out.append(
                    Violation(
                        "model-refusal",
                        w.t1,
                        f"{store}: {w.holding.label} was refused {w.wid} as stale at "
                        f"{w.t1:.3f}, but no write under a higher fence had come to it: a "
                        "step the model does not allow",
                        timeline.before(w.t1),
                    )
                )
    return out


def _unreachable(
    holdings: list[Holding], faults: list[Fault], ttl: float, timeline: Timeline
) -> list[Violation]:
    out: list[Violation] = []
    for f in faults:
        if f.kind == "restart_lock_redis":
            who: set[str] | None = None  # everyone
        elif f.kind == "partition":
            who = set(f.details.get("workers", []))
        else:
            continue
        # A restart's outage ends when the new server is spawned (it answers soon after).
        down_until = float(f.details.get("down_until", f.end))
        for h in holdings:
            if who is not None and h.w not in who:
                continue
            if h.sent >= f.start and h.acked <= down_until:
                out.append(
                    Violation(
                        "unreachable",
                        h.acked,
                        f"{h.label} was granted the claim at {h.acked:.3f} while the lock "
                        f"Redis was unreachable to it ({f.start:.3f}-{down_until:.3f})",
                        f"during {f.kind} #{f.n}",
                    )
                )
            if h.sent < f.start:
                late = [t for t in h.steps if t > f.start + ttl]
                if late:
                    out.append(
                        Violation(
                            "unreachable",
                            late[0],
                            f"{h.label} passed a check {late[0] - f.start:.2f} s after the "
                            f"lock Redis became unreachable to it (ttl {ttl:g} s: it cannot "
                            f"have renewed), {len(late)} step(s) in all",
                            f"after {f.kind} #{f.n} began",
                        )
                    )
    return out


def _late_grants(
    holdings: list[Holding], faults: list[Fault], ttl: float, timeline: Timeline
) -> list[Violation]:
    out: list[Violation] = []
    pauses = [f for f in faults if f.kind == "pause_holder"]
    for h in holdings:
        if h.acked - h.sent <= ttl:
            continue
        paused = any(
            h.pid in {t.get("pid") for t in f.details.get("targets", [])}
            and f.start <= h.acked
            and f.end >= h.sent
            for f in pauses
        )
        if paused:
            continue  # the process itself was stopped between asking and logging
        out.append(
            Violation(
                "late-grant",
                h.acked,
                f"{h.label} counted a grant as acquired {h.acked - h.sent:.2f} s after asking "
                f"(ttl {ttl:g} s: its deadline had passed); "
                + ("it then stopped at its first check" if not h.writes else
                   f"it went on to {len(h.writes)} write(s)"),
                _while_waiting(timeline, h),
            )
        )  # fmt: skip
    return out


def _while_waiting(timeline: Timeline, h: Holding) -> str:
    """The fault that held up a grant: one under way while it was awaited."""
    during = timeline.between(h.sent, h.acked)
    if during:
        f = during[-1]
        return f"during {f.kind} #{f.n}{_targets(f)}"
    return timeline.before(h.sent)


def _releases(holdings: list[Holding], faults: list[Fault], timeline: Timeline) -> list[Violation]:
    out: list[Violation] = []
    grants = sorted(holdings, key=lambda h: h.acked)
    acks = [h.acked for h in grants]
    restarts = [f for f in faults if f.kind == "restart_lock_redis"]
    for h in holdings:
        if h.released_ok is not True:
            continue
        said = {
            "claim/explicit": "release() said True",
            "claim/with": "the with block ended without ClaimLost",
            "exclusive": "@exclusive returned without ClaimLost",
        }.get(h.front, "the release reported success")
        sent_after = h.release_from if h.release_from is not None else h.work_end
        i = bisect.bisect_right(acks, h.acked)
        j = bisect.bisect_left(acks, sent_after)
        others = [g for g in grants[i:j] if g.pid != h.pid]
        if others:
            g = others[0]
            out.append(
                Violation(
                    "release",
                    sent_after,
                    f"{h.label}: {said}, but {g.label} had been granted the claim at "
                    f"{g.acked:.3f}, before the release was sent",
                    timeline.before(g.acked),
                )
            )
            continue
        gone = [f for f in restarts if h.acked < f.start < sent_after]
        if gone:
            out.append(
                Violation(
                    "release",
                    sent_after,
                    f"{h.label}: {said}, but its lease had vanished with lock Redis "
                    f"restart #{gone[0].n} before the release was sent",
                    f"after restart_lock_redis #{gone[0].n}",
                )
            )
    return out


def _wall_offset(events: Iterable[Event]) -> float:
    offsets = [float(e["wall"]) - float(e["t"]) for e in events if "wall" in e]
    return statistics.median(offsets) if offsets else 0.0


def _run_lane(
    commands: list[Command],
    faults: list[Fault],
    events: list[Event],
    ttl: float,
    violations: list[Violation],
    timeline: Timeline,
) -> dict[str, Any]:
    offset = _wall_offset(events)  # wall - monotonic: the lane file has wall times
    kills = {int(f.details["runner_pid"]): f for f in faults if f.kind == "kill_runner"}
    overlaps, forgotten = 0, 0
    for i, a in enumerate(commands):
        for b in commands[i + 1 :]:
            if b.start >= a.last:
                break
            overlaps += 1
            both = min(a.last, b.last) - b.start
            wiped = timeline.between(a.start - offset, b.start - offset, "restart_lock_redis")
            if wiped and both <= ttl and a.runner not in kills:
                # The lock Redis forgot the lease: the next runner was granted it at once,
                # and the first learns of the loss at its next renewal. A command carries
                # no fence; what is checked is that it stopped within a ttl.
                forgotten += 1
                continue
            killed = kills.get(a.runner)
            why = (
                f"the first one's runner was killed {b.start - killed.wall:.2f} s "
                f"before (kill_runner #{killed.n}) and it ran on"
                if killed is not None and killed.wall <= b.start
                else ""
            )
            t = b.start - offset
            violations.append(
                Violation(
                    "run-overlap",
                    t,
                    f"commands {a.pid} (runner {a.runner}) and {b.pid} (runner {b.runner}) ran "
                    f"at once for {both:.2f} s" + (f": {why}" if why else ""),
                    f"after kill_runner #{killed.n}"
                    if why and killed is not None
                    else timeline.before(t),
                )
            )
    by_pid = {c.pid: c for c in commands}
    orphans = 0
    recovery: list[float] = []
    starts = [c.start for c in commands]
    for f in kills.values():
        wall = f.wall
        for pid in f.details.get("command_pids", []):
            c = by_pid.get(int(pid))
            if c is not None and c.last > wall + ttl:
                orphans += 1
                violations.append(
                    Violation(
                        "run-orphan",
                        wall - offset,
                        f"command {c.pid} kept running {c.last - wall:.2f} s after its runner "
                        f"{c.runner} was killed (ended: {c.end or 'never marked'})",
                        f"after kill_runner #{f.n}",
                    )
                )
        i = bisect.bisect_right(starts, wall)
        if i < len(starts):
            recovery.append(starts[i] - wall)
    codes = Counter(
        str(e.get("code")) for e in events if e.get("w") == "harness" and e["ev"] == "runner-exit"
    )
    return {
        "commands": len(commands),
        "overlaps": overlaps,
        "overlaps_after_restart": forgotten,
        "orphans": orphans,
        "runner_exit_codes": dict(codes),
        "recovery": recovery,
    }

"""The dedup lane's checker: what the feeder sent and what the dedup worker ran, proven
from their logs (``dd-call``, ``dd-chord`` from :mod:`chaos.feeder`; ``dd-start``,
``dd-end``, ``dd-post``, ``dd-chord-body`` from :mod:`chaos.dedup_app`).

Invariants (any violation fails the run):

- ``dd-limit``: never more runs of a name at once than its limit (2 for ``dd:limit``,
  1 for every other name). A run lasts from its ``dd-start`` to its ``dd-end`` (both
  inside its lease), or to the SIGKILL of its process;
- ``dd-cooldown``: no run of ``dd:cooldown`` starts within the cooldown after a run of
  it that ended ok (its body ended ok and its delivery reported success);
- ``dd-accounted``: every call is accounted for: it ran, it was skipped with a
  recorded reason, or it was coalesced at enqueue into a message that had not run yet
  (that message's run or skip came after the call); a delivery ignored as a duplicate
  follows a run of its task id that completed; a retry that kept its claim was
  delivered again; a call skipped under ``claim_on_busy="rerun"`` was followed by a
  rerun with its arguments;
- ``dd-retry``: while a run that asked for a retry keeps its claim, no other run of the
  name starts before the retried attempt;
- ``dd-chord``: every chord's body ran, unless a member failed (a member whose claim
  was lost fails, and Celery fails its chord): only a member that lost its claim to a
  restart of the lock Redis excuses it;
- ``dd-replace`` (``claim_on_busy="replace"``): a call whose run a newer call replaced
  never runs again (its retry, its redelivery) and never publishes (through the fenced
  pointer) after the call that replaced it published; a replaced run stops within a
  refresh interval (``ttl/3``) plus :data:`REPLACE_SLACK`; with
  ``claim_enqueue="until_started"``, a call made while the name's message runs is
  published (it replaces that run), never coalesced into it;
- ``dd-debounce``: after every call of ``dd.debounce`` (its sender killed now and then,
  mid-publish), a run with that call's arguments or a later call's starts within
  ``claim_debounce_max`` twice (a burst whose sender died, then the burst a later call
  publishes) plus :data:`DEBOUNCE_SLACK`.

celery-once (``dd.once``, when installed) runs beside ``dd.finished`` on the same
schedule and faults; its figures are reported beside fenced's, not held to these.

A restart of the lock Redis empties it (no persistence): leases, cooldown stamps and
rerun triggers are forgotten, as fenced documents. So may a Sentinel failover
(``--sentinel``): the promoted replica may lack the last writes, and a paused master,
resumed, serves the clients still connected to it until the sentinels demote it; and
a Cluster failover (``--cluster``), until the old master is a replica of the promoted
one and every node agrees on the slot map, for the names whose slots it served. A
violation that such a fault explains (it came between the two runs, or between a
trigger and its rerun) is counted apart as excused, not failed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from fenced._lease import ClaimKeys

from .config import CLUSTER_FAULTS, FAILOVER_FAULTS, REPLACE_NAMES

__all__ = ["INVARIANTS", "DedupStats", "check_dedup", "pending"]

Event = dict[str, Any]

INVARIANTS = {
    "dd-limit": "dedup: never more runs of a name at once than its limit",
    "dd-cooldown": "dedup: no run of a name within its cooldown after an ok run",
    "dd-accounted": "dedup: every call ran, was skipped (reason), coalesced or rerun",
    "dd-retry": "dedup: a retry keeps its claim until the retried attempt",
    "dd-chord": "dedup: every chord's body ran",
    "dd-replace": "dedup: a replaced call never runs or publishes after its replacer",
    "dd-debounce": "dedup: every debounced call is followed by a run in bounded time",
}
#: How long after its replacer started a replaced run may still run, beyond ttl/3.
REPLACE_SLACK = 1.5
#: How late a debounced call's run may start, beyond twice claim_debounce_max: the
#: queue ahead of it (two cores, a dozen messages) and the worker's pickup.
DEBOUNCE_SLACK = 6.0
#: chaos.dedup_app's debounce settings (claim_debounce_max).
DEBOUNCE_MAX = 1.5
DEBOUNCE_TASK = "dd.debounce"
#: Runs of a name allowed at once (chaos.dedup_app.LIMITS; 1 for every other name).
LIMITS = {"dd:limit": 2}
#: The peer: celery-once's task, and the run name it logs (kept out of the invariants).
PEER_TASK, PEER_NAME = "dd.once", "once:finished"
#: The faults that may make the claims' Redis forget what it acknowledged.
FORGETTING = ("restart_lock_redis", *FAILOVER_FAULTS, *CLUSTER_FAULTS)
#: A rerun trigger lost to a restart of the lock Redis in this many seconds after it.
RESTART_WINDOW = 10.0
#: How long before an attempt's RETRY postrun its retry may already have logged: the
#: retry is published at the body's end, the postrun written after the result is stored.
RETRY_LEAD = 5.0


@dataclass
class Run:
    name: str
    task: str
    id: str
    pid: int
    start: float
    fence: int | None
    rerun: bool
    retries: int
    args: tuple[Any, ...] = ()
    end: float | None = None
    how: str = ""


@dataclass
class DedupStats:
    """What the dedup lane did."""

    calls: int = 0
    published: int = 0
    coalesced: dict[str, int] = field(default_factory=dict)
    call_errors: int = 0
    runs: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    reruns: int = 0
    rerun_triggers: int = 0
    retries: int = 0
    #: Retries of an acquire that could not reach Redis (they hold no claim).
    unavailable_retries: int = 0
    failed: int = 0
    max_at_once: dict[str, int] = field(default_factory=dict)
    chords: int = 0
    chords_done: int = 0
    killed_runs: int = 0
    excused: dict[str, int] = field(default_factory=dict)
    #: fenced's until_finished and celery-once under the same calls and faults.
    beside: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: replace: runs replaced by a newer call, by name; of them, by a call sent
    #: before theirs (the older message delivered later: call order as the runs took
    #: the name); publishes accepted / refused by the fence.
    replaced: dict[str, int] = field(default_factory=dict)
    replaced_by_older: int = 0
    publishes: dict[str, int] = field(default_factory=dict)
    #: debounce: calls (begun, completed), sender kills (mid-publish), runs.
    debounce_calls: int = 0
    debounce_begun: int = 0
    debounce_runs: int = 0
    debounce_deferred: int = 0
    sender_kills: int = 0
    sender_kills_mid_publish: int = 0


@dataclass
class _Lane:
    calls: list[Event]
    errors: list[Event]
    chords: list[Event]
    bodies: set[int]
    runs: list[Run]
    posts: dict[str, list[Event]]
    starts: dict[str, list[Run]]
    #: (task id, pid) -> when its body asked for a retry (dd-retrying)
    retrying: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    publishes: list[Event] = field(default_factory=list)
    dcalls: list[Event] = field(default_factory=list)
    dbegun: int = 0


def _read(events: list[Event], killed: dict[int, float]) -> _Lane:
    lane = _Lane([], [], [], set(), [], defaultdict(list), defaultdict(list))
    open_run: dict[int, Run] = {}
    last_seen: dict[int, float] = {}
    for e in events:
        ev = e.get("ev", "")
        if not ev.startswith("dd-"):
            continue
        t, pid = float(e["t"]), int(e.get("pid", 0))
        last_seen[pid] = t
        if ev == "dd-call":
            lane.calls.append(e)
        elif ev == "dd-call-error":
            lane.errors.append(e)
        elif ev == "dd-chord":
            lane.chords.append(e)
        elif ev == "dd-chord-body":
            lane.bodies.add(int(e["chord"]))
        elif ev == "dd-start":
            run = Run(e["name"], e["task"], str(e["id"]), pid, t, e.get("fence"),
                      bool(e.get("rerun")), int(e.get("retries") or 0),
                      tuple(e.get("args") or ()))  # fmt: skip
            open_run[pid] = run
            lane.runs.append(run)
            lane.starts[run.id].append(run)
        elif ev == "dd-end":
            run_or_none = open_run.pop(pid, None)
            if run_or_none is not None and run_or_none.id == str(e["id"]):
                run_or_none.end, run_or_none.how = t, str(e.get("how"))
        elif ev == "dd-post":
            lane.posts[str(e["id"])].append(e)
        elif ev == "dd-retrying":
            lane.retrying.setdefault((str(e["id"]), pid), []).append(t)
        elif ev == "dd-publish":
            lane.publishes.append(e)
        elif ev == "dd-dcall":
            lane.dcalls.append(e)
        elif ev == "dd-dcall-begin":
            lane.dbegun += 1
    for run in lane.runs:
        if run.end is None:
            dead = killed.get(run.pid)
            if dead is not None and dead >= run.start:
                run.end, run.how = dead, "killed"
            else:
                run.end, run.how = max(run.start, last_seen.get(run.pid, run.start)), "cut"
    return lane


#: A forgetting fault's window: (start, end, the slot ranges it hit; None: every slot).
Window = tuple[float, float, "tuple[tuple[int, int], ...] | None"]


def _forgetting(faults: list[Any]) -> list[Window]:
    """The faults after which the claims' Redis may have forgotten what it acknowledged:
    a restart of the lock Redis (empty), a Sentinel or Cluster failover (to a replica
    that may lack the last writes; a paused master, resumed, serves its clients until
    demoted; a killed one, started again empty, until it rejoins as a replica)."""
    # A failover's window lasts until the old master is a replica again and, on a
    # Cluster, every node agrees on the slot map ("synced"). A Cluster failover
    # forgets only what its master's slots held ("slots"): the names there.
    out: list[Window] = []
    for f in faults:
        if f.kind not in FORGETTING:
            continue
        slots = f.details.get("slots")
        hit = None if slots is None else tuple((int(a), int(b)) for a, b in slots)
        out.append((f.start, max(f.end, float(f.details.get("synced") or f.end)), hit))
    return out


def _name_of(task: str, args: Any) -> str | None:
    """The claim name of a dedup task's call (chaos.dedup_app), None if unknown."""
    if task == "dd.member" and args:
        return f"dd:member:{args[0]}"
    if task.startswith("dd.") and task != "dd.chord_body":
        return "dd:" + task[3:].removesuffix("_unclaimed")
    return None


def _in_slots(slots: tuple[tuple[int, int], ...] | None, name: str | None) -> bool:
    """Whether a claim name's keys (one hash tag: one slot) lie in the slot ranges."""
    if slots is None or name is None:
        return True
    from redis.crc import key_slot

    slot = key_slot(ClaimKeys.of(name).lock.encode())
    return any(first <= slot <= last for first, last in slots)


def _kept(lane: _Lane, post: Event) -> bool:
    """Whether a RETRY was the body's own (self.retry(), which keeps the claim), not one
    of an acquire that could not reach Redis (which holds nothing)."""
    t = float(post["t"])
    asked = lane.retrying.get((str(post["id"]), int(post["pid"])), [])
    return any(t - 5.0 <= x <= t for x in asked)


def _restart_between(restarts: list[Window], a: float, b: float, name: str | None = None) -> bool:
    """Whether a forgetting fault's window overlaps [a, b] (for a Cluster failover: and
    its master served ``name``'s slot)."""
    return any(start <= b and end >= a and _in_slots(slots, name) for start, end, slots in restarts)


def _accounting(
    lane: _Lane, restarts: list[Window], stats: DedupStats | None = None
) -> tuple[list[tuple[float, str]], int]:
    """Calls, retries and rerun triggers not accounted for: (time, what), and how many
    a restart of the lock Redis excuses."""
    problems: list[tuple[float, str]] = []
    excused = 0
    for call in lane.calls:
        if call["task"] == PEER_TASK:
            continue
        t0, own, returned = float(call["t"]), str(call["id"]), str(call["returned"])
        what = f"{call['task']}{tuple(call['args'])} (task {own[:8]})"
        name = _name_of(str(call["task"]), call["args"])
        if returned != own:
            if stats is not None:
                stats.coalesced[call["task"]] = stats.coalesced.get(call["task"], 0) + 1
            later = [r for r in lane.starts.get(returned, []) if r.start > t0] + [
                p for p in lane.posts.get(returned, []) if float(p["t"]) > t0
            ]
            # The run that cleared the mark may have cleared it on a master that the
            # failover then discarded: the mark stayed on the new one.
            ran = [r.start for r in lane.starts.get(returned, [])] + [
                float(p["t"]) for p in lane.posts.get(returned, [])
            ]
            if not later and (
                _restart_between(restarts, t0 - 1.0, t0, name)
                or any(_restart_between(restarts, t, t, name) for t in ran)
            ):
                excused += 1
            elif not later:
                problems.append((t0, f"{what} was coalesced into task {returned[:8]}, which "
                                     "had run already: the call was lost"))  # fmt: skip
            continue
        if stats is not None:
            stats.published += 1
        if not lane.starts.get(own) and not lane.posts.get(own):
            if _restart_between(restarts, t0 - 1.0, t0 + RESTART_WINDOW, name):
                excused += 1
            else:
                problems.append((t0, f"{what} was published and never delivered"))
    # A delivery ignored as a duplicate of a completed run: that run must have been. Its
    # postrun may be missing: a worker killed after the body ended ok and the release
    # set the done marker, before the postrun, has its message delivered again.
    for tid, posts in lane.posts.items():
        for p in posts:
            if p.get("state") != "IGNORED" or p.get("task") == PEER_TASK:
                continue
            t = float(p["t"])
            done = any(
                q.get("state") == "SUCCESS" and not q.get("skipped") and float(q["t"]) < t
                for q in posts
            ) or any(r.how == "ok" and (r.end or t) < t for r in lane.starts.get(tid, []))
            if not done:
                problems.append((t, f"{p['task']}{tuple(p['args'])} (task {tid[:8]}) was "
                                    "ignored as already completed, but no run of it had "
                                    "completed"))  # fmt: skip
    # A retry: the same task id comes back, as its next attempt. A debounced message
    # published again (not due yet, or its name held) shows RETRY too, without a retry
    # counted: it comes back as any later delivery of its task id.
    for tid, posts in lane.posts.items():
        for p in posts:
            if p.get("state") != "RETRY":
                continue
            if p.get("task") == DEBOUNCE_TASK:
                t = float(p["t"])
                if not any(r.start > t for r in lane.starts.get(tid, [])) and not any(
                    float(q["t"]) > t for q in posts if q is not p
                ):
                    problems.append((t, f"{p['task']}(task {tid[:8]}) was deferred and its "
                                        "message never came back"))  # fmt: skip
                continue
            t = float(p["t"])
            if not _came_back(lane, tid, p):
                problems.append((t, f"{p['task']}(task {tid[:8]}) asked for a retry that "
                                    "never came"))  # fmt: skip
    # A call skipped under the rerun policy: a rerun with its arguments comes after it.
    reruns: dict[str, list[float]] = defaultdict(list)
    for run in lane.runs:
        if run.rerun:
            reruns[f"{run.task}{run.args}"].append(run.start)
    for posts in lane.posts.values():
        for p in posts:
            if p.get("rerun"):
                reruns[_rerun_key(p)].append(float(p["t"]))
    for posts in lane.posts.values():
        for p in posts:
            if not p.get("skipped") or p.get("policy") != "rerun":
                continue
            if stats is not None:
                stats.rerun_triggers += 1
            t = float(p["t"])
            if any(x > t for x in reruns.get(_rerun_key(p), [])):
                continue
            # The skip's acquire came a moment before its postrun.
            if _restart_between(
                restarts, t - 1.0, t + RESTART_WINDOW, _name_of(str(p["task"]), p["args"])
            ):
                excused += 1
                continue
            problems.append((t, f"{p['task']}{tuple(p['args'])} (task {str(p['id'])[:8]}) was "
                                "skipped for a rerun that never came"))  # fmt: skip
    return problems, excused


def _came_back(lane: _Lane, tid: str, post: Event) -> bool:
    """Whether the retry a RETRY postrun reports was delivered: an attempt of its task
    id with more retries started or reported after it was sent. The body publishes the
    retry before its own postrun is written, so the next attempt (its countdown passed,
    in another pool child) may log a moment before that postrun: attempts are told
    apart by their retries, and "after" reaches RETRY_LEAD seconds before the postrun
    (an attempt of a copy of the same message delivered again long after, as a killed
    worker's message is, still needs a retry of its own). A postrun logged without its
    retries (older logs): any later start or postrun."""
    n, t = post.get("retries"), float(post["t"])
    posts = lane.posts.get(tid, [])
    if n is None:
        return any(r.start > t for r in lane.starts.get(tid, [])) or any(
            float(q["t"]) > t for q in posts if q is not post
        )
    since = t - RETRY_LEAD
    return any(r.retries > int(n) and r.start > since for r in lane.starts.get(tid, [])) or any(
        int(q.get("retries") or 0) > int(n) and float(q["t"]) > since
        for q in posts
        if q is not post
    )


def _rerun_key(p: Event) -> str:
    # dd.rerun's claim name is fixed: the task and its arguments name the call.
    return f"{p['task']}{tuple(p['args'])}"


def pending(events: list[Event]) -> list[str]:
    """What the dedup lane has not accounted for yet (the harness drains until none)."""
    from .checker import _faults, _kill_times

    faults, _, _ = _faults(events)
    lane = _read(events, _kill_times(faults))
    restarts = _forgetting(faults)
    problems, _ = _accounting(lane, restarts)
    out = [what for _t, what in problems]
    out += [f"debounce call {seq}" for _t, seq in _debounce_waiting(lane)]
    out += [
        f"chord {c['chord']}"
        for c in lane.chords
        if int(c["chord"]) not in lane.bodies and not _failed_members(lane, c)
    ]
    return out


def _debounce_runs(lane: _Lane) -> list[Run]:
    return sorted((r for r in lane.runs if r.task == DEBOUNCE_TASK), key=lambda r: r.start)


def _debounce_waiting(lane: _Lane) -> list[tuple[float, int]]:
    """Debounced calls (time, sequence number) with no run of theirs or of a later call
    started after them."""
    runs = _debounce_runs(lane)
    out = []
    for c in lane.dcalls:
        t0, seq = float(c["t"]), int(c["seq"])
        if not any(r.start >= t0 and r.args and int(r.args[0]) >= seq for r in runs):
            out.append((t0, seq))
    return out


def _check_debounce(
    lane: _Lane, faults: list[Any], restarts: list[Window], timeline: Any, stats: DedupStats
) -> tuple[list[Any], int]:
    """dd-debounce: each call is followed by a run (its arguments or a later call's)
    within twice claim_debounce_max plus DEBOUNCE_SLACK; a dedup worker killed or the
    claims' Redis forgetting meanwhile excuses it (its message comes back later)."""
    from .checker import Violation

    runs = _debounce_runs(lane)
    stats.debounce_calls = len(lane.dcalls)
    stats.debounce_begun = lane.dbegun
    stats.debounce_runs = len(runs)
    kills = [f for f in faults if f.kind == "kill_debounce_sender"]
    stats.sender_kills = len(kills)
    stats.sender_kills_mid_publish = sum(1 for f in kills if f.details.get("mid_publish"))
    worker_kills = [f.start for f in faults if f.kind == "kill_worker"]
    bound = 2 * DEBOUNCE_MAX + DEBOUNCE_SLACK
    found: list[Any] = []
    excused = 0
    for c in lane.dcalls:
        t0, seq = float(c["t"]), int(c["seq"])
        after = [r.start for r in runs if r.start >= t0 and r.args and int(r.args[0]) >= seq]
        first = min(after) if after else None
        if first is not None and first <= t0 + bound:
            continue
        until = first if first is not None else t0 + bound
        if any(t0 - 1.0 <= k <= until for k in worker_kills) or _restart_between(
            restarts, t0 - 1.0, until, "dd:debounce"
        ):
            excused += 1
            continue
        late = "never" if first is None else f"{first - t0:.2f} s after it"
        found.append(Violation("dd-debounce", t0, f"dd.debounce({seq}): a run of it or of a "
                               f"later call came {late} (bound {bound:g} s)",
                               timeline.before(t0)))  # fmt: skip
    return found, excused


def _check_replace(
    lane: _Lane, killed: dict[int, float], restarts: list[Window], timeline: Any,
    ttl: float, stats: DedupStats,
) -> tuple[list[Any], int]:  # fmt: skip
    """dd-replace, from who replaced whom (the replaced run's delivery says it:
    ``replaced_by``), each run's start and end, and the pointer's publishes."""
    from .checker import Violation

    found: list[Any] = []
    excused = 0
    seq_of: dict[str, int] = {}
    for c in lane.calls:
        if c["task"] in ("dd.replace_started", "dd.replace_retry") and c["args"]:
            seq_of[str(c["id"])] = int(c["args"][0])
    accepted: dict[str, list[float]] = defaultdict(list)
    for p in lane.publishes:
        answer = p.get("accepted")
        key = "accepted" if answer is True else "refused" if answer is False else "failed"
        stats.publishes[key] = stats.publishes.get(key, 0) + 1
        if p.get("accepted") is True:
            accepted[str(p["id"])].append(float(p["t"]))
        seq_of.setdefault(str(p["id"]), int(p["seq"]))
    for tid, posts in lane.posts.items():
        for p in posts:
            newer = p.get("replaced_by")
            if not newer or p.get("task") not in ("dd.replace_started", "dd.replace_retry"):
                continue
            name = _name_of(str(p["task"]), p["args"]) or "?"
            stats.replaced[name] = stats.replaced.get(name, 0) + 1
            newer = str(newer)
            if seq_of.get(newer, -1) < seq_of.get(tid, -1):
                stats.replaced_by_older += 1
            taken = [r.start for r in lane.starts.get(newer, [])]
            if not taken:
                continue  # its replacer's start is not in the logs (a prefix of its id)
            took = min(taken)
            # 1. Never runs again after the call that replaced it took the name.
            for r in lane.starts.get(tid, []):
                if r.start > took + 0.05:
                    if _restart_between(restarts, took, r.start, name):
                        excused += 1
                        continue
                    found.append(Violation("dd-replace", r.start, f"{name}: task {tid[:8]} "
                                           f"ran again at {r.start:.3f} after task {newer[:8]} "
                                           f"replaced it ({took:.3f})",
                                           timeline.before(r.start)))  # fmt: skip
            # 2. Never publishes after the call that replaced it published.
            theirs = accepted.get(newer, [])
            for t in accepted.get(tid, []):
                if theirs and t > min(theirs):
                    if _restart_between(restarts, min(theirs), t, name):
                        excused += 1
                        continue
                    what = (
                        f"{name}: task {tid[:8]} published at {t:.3f}, after task "
                        f"{newer[:8]}, which replaced it, had published"
                    )
                    found.append(Violation("dd-replace", t, what, timeline.before(t)))
            # 3. Its run stops within a refresh interval (and slack) of the takeover.
            for r in lane.starts.get(tid, []):
                end = r.end if r.end is not None else r.start
                if r.start < took and r.how != "killed" and end > took + ttl / 3 + REPLACE_SLACK:
                    what = f"{name}: task {tid[:8]} ran on {end - took:.2f} s after task "
                    what += f"{newer[:8]} replaced it"
                    found.append(Violation("dd-replace", end, what, timeline.before(end)))
    # 4. until_started: a call made while the name's message runs is published.
    for c in lane.calls:
        if c["task"] != "dd.replace_started" or str(c["returned"]) == str(c["id"]):
            continue
        t0, into = float(c["t"]), str(c["returned"])
        runs = lane.starts.get(into, [])
        if not any(r.start < t0 for r in runs):
            continue
        if any(r.how in ("killed", "cut") for r in runs) or _restart_between(
            restarts, min(r.start for r in runs) - 1.0, t0, "dd:replace_started"
        ):
            excused += 1
            continue
        found.append(Violation("dd-replace", t0, f"dd.replace_started{tuple(c['args'])}: "
                               f"coalesced into task {into[:8]}, whose run had started: "
                               "until_started must publish it (to replace that run)",
                               timeline.before(t0)))  # fmt: skip
    return found, excused


def _failed_members(lane: _Lane, chord: Event) -> list[tuple[float, float, str, str | None]]:
    """The chord's members that failed: (start, failure, error, claim name) of each."""
    out = []
    for tid in chord.get("members") or []:
        for p in lane.posts.get(str(tid), []):
            if p.get("state") == "FAILURE":
                starts = [
                    r.start for r in lane.starts.get(str(tid), []) if r.start <= float(p["t"])
                ]
                t = float(p["t"])
                out.append((max(starts) if starts else t, t, str(p.get("error") or ""),
                            _name_of(str(p.get("task") or ""), p.get("args"))))  # fmt: skip
    return out


def check_dedup(
    events: list[Event], faults: list[Any], timeline: Any, cooldown: float, ttl: float = 3.0
) -> tuple[list[Any], DedupStats, dict[str, str]]:
    """The dedup lane's violations, figures, and what each invariant checked."""
    from .checker import Violation, _kill_times

    killed = _kill_times(faults)
    lane = _read(events, killed)
    restarts = _forgetting(faults)
    stats = DedupStats()
    violations: list[Any] = []
    excused: Counter[str] = Counter()
    stats.calls = len(lane.calls)
    stats.call_errors = len(lane.errors)
    stats.runs = dict(Counter("dd:member:*" if r.name.startswith("dd:member")
                              else r.name for r in lane.runs if r.name != PEER_NAME))  # fmt: skip
    stats.runs = {k: v for k, v in sorted(stats.runs.items())}
    stats.reruns = sum(1 for r in lane.runs if r.rerun)
    stats.killed_runs = sum(1 for r in lane.runs if r.how == "killed")
    for posts in lane.posts.values():
        for p in posts:
            if p.get("skipped"):
                reason = str(p["skipped"]).split(":")[0][:40]
                stats.skipped[reason] = stats.skipped.get(reason, 0) + 1
            elif p.get("state") == "RETRY" and p.get("task") == DEBOUNCE_TASK:
                stats.debounce_deferred += 1
            elif p.get("state") == "RETRY" and _kept(lane, p):
                stats.retries += 1
            elif p.get("state") == "RETRY":
                stats.unavailable_retries += 1
            elif p.get("state") not in ("SUCCESS", None):
                stats.failed += 1

    # dd-limit: a sweep over each name's runs.
    by_name: dict[str, list[Run]] = defaultdict(list)
    for run in lane.runs:
        if run.name != PEER_NAME:
            by_name[run.name].append(run)
    for name, runs in sorted(by_name.items()):
        if name in REPLACE_NAMES:
            continue  # runs overlap while a replaced one learns it: dd-replace
        limit = LIMITS.get(name, 1)
        runs.sort(key=lambda r: r.start)
        active: list[Run] = []
        most = 0
        for run in runs:
            assert run.end is not None
            active = [a for a in active if a.end is not None and a.end > run.start]
            active.append(run)
            most = max(most, len(active))
            if len(active) > limit:
                first = min(a.start for a in active)
                if _restart_between(restarts, first, run.start, name):
                    excused["dd-limit"] += 1
                    continue
                held = ", ".join(
                    f"task {a.id[:8]} pid {a.pid} fence {a.fence} from {a.start:.3f}"
                    for a in active[:-1]
                )
                violations.append(
                    Violation(
                        "dd-limit",
                        run.start,
                        f"{name} (limit {limit}): task {run.id[:8]} (pid {run.pid}, fence "
                        f"{run.fence}) started at {run.start:.3f} while {len(active) - 1} "
                        f"ran ({held})",
                        timeline.before(run.start),
                    )
                )
        stats.max_at_once[name] = most

    # dd-cooldown: after a run that ended ok, nothing starts within the window.
    cool = sorted(by_name.get("dd:cooldown", []), key=lambda r: r.start)
    n_ok = 0
    for run in cool:
        ok = run.how == "ok" and any(
            p.get("state") == "SUCCESS" and not p.get("skipped") and int(p["pid"]) == run.pid
            and float(p["t"]) >= (run.end or 0)
            for p in lane.posts.get(run.id, [])
        )  # fmt: skip
        if not ok:
            continue
        n_ok += 1
        assert run.end is not None
        for other in cool:
            if other is run or not run.end < other.start < run.end + cooldown:
                continue
            if _restart_between(restarts, run.end, other.start, "dd:cooldown"):
                excused["dd-cooldown"] += 1
                continue
            violations.append(
                Violation(
                    "dd-cooldown",
                    other.start,
                    f"dd:cooldown: task {other.id[:8]} (pid {other.pid}) started "
                    f"{other.start - run.end:.3f} s after task {run.id[:8]} ended ok "
                    f"(cooldown {cooldown:g} s)",
                    timeline.before(other.start),
                )
            )

    # dd-accounted
    problems, n_excused = _accounting(lane, restarts, stats)
    excused["dd-accounted"] += n_excused
    for t, what in problems:
        violations.append(Violation("dd-accounted", t, what, timeline.before(t)))

    # dd-retry: between the retry (claim kept) and the retried attempt, no other run.
    n_retry = 0
    retry_runs = by_name.get("dd:retry", [])
    for tid, posts in lane.posts.items():
        for p in posts:
            if p.get("task") != "dd.retry" or p.get("state") != "RETRY" or not _kept(lane, p):
                continue  # (a retry under replace may be taken over: dd-replace)
            t = float(p["t"])
            nxt = [r.start for r in lane.starts.get(tid, []) if r.start > t]
            if not nxt:
                continue  # dd-accounted says so
            n_retry += 1
            until = min(nxt)
            # The process that kept the claim killed meanwhile (a whole worker killed
            # takes the retry's message with it until it is delivered again): the kept
            # lease is renewed no more and expires, as a dead holder's lease does.
            dead = killed.get(int(p["pid"]))
            for other in retry_runs:
                if other.id == tid or not t < other.start < until:
                    continue
                if dead is not None and t <= dead <= other.start:
                    continue
                if _restart_between(restarts, t, other.start, "dd:retry"):
                    excused["dd-retry"] += 1
                    continue
                violations.append(
                    Violation(
                        "dd-retry",
                        other.start,
                        f"dd:retry: task {other.id[:8]} started at {other.start:.3f} while "
                        f"task {tid[:8]} kept the claim for its retry ({t:.3f} to {until:.3f})",
                        timeline.before(other.start),
                    )
                )

    # dd-chord
    stats.chords = len(lane.chords)
    stats.chords_done = sum(1 for c in lane.chords if int(c["chord"]) in lane.bodies)
    for c in lane.chords:
        if int(c["chord"]) in lane.bodies:
            continue
        t = float(c["t"])
        failed = _failed_members(lane, c)
        if failed and all(
            "ClaimLost" in err and _restart_between(restarts, a, b, name)
            for a, b, err, name in failed
        ):
            excused["dd-chord"] += 1
            continue
        why = f" (a member failed: {failed[0][2][:120]})" if failed else ""
        violations.append(
            Violation("dd-chord", t, f"chord {c['chord']}: its body never ran{why}",
                      timeline.before(t))
        )  # fmt: skip
    # dd-replace, dd-debounce
    found, n_excused = _check_replace(lane, killed, restarts, timeline, ttl, stats)
    violations += found
    excused["dd-replace"] += n_excused
    found, n_excused = _check_debounce(lane, faults, restarts, timeline, stats)
    violations += found
    excused["dd-debounce"] += n_excused
    stats.excused = dict(excused)
    stats.beside = {
        "fenced until_finished": _beside(lane, "dd.finished", "dd:finished"),
        **({"celery-once": _beside(lane, PEER_TASK, PEER_NAME)}
           if any(c["task"] == PEER_TASK for c in lane.calls) else {}),
    }  # fmt: skip
    checked = {
        "dd-limit": f"{len(lane.runs)} runs, {len(by_name)} names",
        "dd-cooldown": f"{n_ok} ok runs",
        "dd-accounted": f"{stats.calls} calls, {stats.rerun_triggers} rerun triggers",
        "dd-retry": f"{n_retry} retries",
        "dd-chord": f"{stats.chords} chords",
        "dd-replace": f"{sum(stats.replaced.values())} replaced runs, "
        f"{sum(stats.publishes.values())} publishes",
        "dd-debounce": f"{stats.debounce_calls} calls, {stats.sender_kills} sender kills "
        f"({stats.sender_kills_mid_publish} mid-publish)",
    }
    return violations, stats, checked


def _beside(lane: _Lane, task: str, name: str) -> dict[str, Any]:
    """One contender's figures: its calls, what became of them, its runs.

    A call not published (fenced: coalesced into a queued message; celery-once:
    refused) is *dropped* when, as it was sent, no run of its name was running and no
    message of it was still to be delivered (published before, delivered after, a
    killed run's message coming back included): nothing was left to do its work, as
    with a lock that outlived its message.
    """
    calls = [c for c in lane.calls if c["task"] == task]
    runs = sorted((r for r in lane.runs if r.name == name), key=lambda r: r.start)
    # Each published message's last delivery (a run's start, or a post).
    last: dict[str, float] = {}
    for r in runs:
        last[r.id] = max(last.get(r.id, r.start), r.start)
    published = [c for c in calls if str(c["returned"]) == str(c["id"])]
    for c in published:
        for p in lane.posts.get(str(c["id"]), []):
            last[str(c["id"])] = max(last.get(str(c["id"]), float(p["t"])), float(p["t"]))
    kept = [c for c in calls if str(c["returned"]) != str(c["id"])]
    dropped = 0
    for c in kept:
        t0 = float(c["t"])
        running = any(r.start <= t0 <= (r.end or t0) for r in runs)
        queued = any(
            float(p["t"]) < t0 and last.get(str(p["id"]), float("inf")) > t0 for p in published
        )
        dropped += not (running or queued)
    most, active = 0, list[Run]()
    for r in runs:
        active = [a for a in active if (a.end or a.start) > r.start] + [r]
        most = max(most, len(active))
    return {
        "calls": len(calls),
        "published": len(published),
        "not published": len(kept),
        "dropped with nothing queued or running": dropped,
        "published, never delivered": sum(1 for c in published if str(c["id"]) not in last),
        "runs": len(runs),
        "most at once": most,
    }

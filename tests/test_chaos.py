"""The fault-injection suite (chaos/), short: every front end under every fault, checked.

``make chaos`` runs it for five minutes with six workers per lane; here it runs for
about 25 s with three fenced workers, two Lock workers, one Celery worker (two prefork
children) and two ``fenced run`` runners, and fails on any broken invariant of the
fenced lane. The redis-py Lock lane runs beside it under the same faults and is not
held to anything. The first test shows that the checker catches what it should.

Where Azurite runs (tests/npm, which `make test` installs; always in CI), the fenced
lane's stores include an ``ObjectPointer`` on it, and the Lock lane overwrites a
pointer object there.

The dedup lane (fenced's Celery options, chaos/dedup_app.py) and the beat lane (three
``celery beat`` under fenced's scheduler, chaos/beat_app.py) run on their own, shorter,
in tests/test_chaos_dedup.py and tests/test_chaos_beat.py (apart, so that the long runs
spread over the test workers); here their checkers are fed hand-made logs of each
violation.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chaos import Config  # noqa: E402
from chaos.beat_check import check_beat  # noqa: E402
from chaos.checker import Setup, check  # noqa: E402
from chaos.config import BEAT_FAULTS, CLUSTER_FAULTS, FAILOVER_FAULTS, FAULTS  # noqa: E402
from chaos.dedup_check import check_dedup  # noqa: E402
from chaos.harness import Harness  # noqa: E402
from chaos.stores import STORES, Final  # noqa: E402

from fenced.testing import find_azurite  # noqa: E402

TTL = 1.0


#: The object store runs where Azurite is installed, and always in CI (or the run fails).
OBJECTS = (
    bool(os.environ.get("CI")) or find_azurite(ROOT / "tests/npm/node_modules/.bin") is not None
)


def _setup(seconds: float = 10.0, stores: tuple[str, ...] = STORES[:-1]) -> Setup:
    return Setup(seconds, TTL, 2, "1 Claim, 1 @exclusive", 0, 0, 0, "sqlite",
                 stores=",".join(stores))  # fmt: skip


def _event(t: float, ev: str, w: str, pid: int, **fields: Any) -> dict[str, Any]:
    return {"t": t, "wall": 1000 + t, "ev": ev, "w": w, "pid": pid, "lane": "fenced",
            "front": "claim", **fields}  # fmt: skip


def _holding(
    w: str, pid: int, fence: int, acked: float, write_at: float, result: str,
    store: str = "redis",
) -> list[dict[str, Any]]:  # fmt: skip
    wid = f"{w}.{pid}.1.0"
    return [
        _event(acked, "acquired", w, pid, hold=1, fence=fence, sent=acked - 0.01),
        _event(acked, "step", w, pid, hold=1, step=0, fence=fence),
        _event(write_at, "writing", w, pid, hold=1, store=store, wid=wid, fence=fence),
        _event(write_at + 0.01, "write", w, pid, hold=1, store=store, wid=wid, fence=fence,
               t0=write_at, result=result),
        _event(write_at + 0.02, "releasing", w, pid, hold=1),
    ]  # fmt: skip


def test_checker_names_the_broken_invariant_and_the_fault_before_it() -> None:
    pause = {"t": 1.0, "wall": 1001.0, "ev": "fault", "w": "harness", "pid": 1,
             "kind": "pause_holder", "n": 1, "end": 3.5,
             "targets": [{"lane": "fenced", "pid": 10, "w": "w0"}]}  # fmt: skip
    # w0 (fence 100) is paused mid-step; w1 (fence 101) takes over and writes; w0 wakes
    # and its write is accepted although a higher fence was: a stale write landed.
    events = [pause, *_holding("w0", 10, 100, 0.5, 3.6, "accepted")]
    events += _holding("w1", 11, 101, 2.0, 2.5, "accepted")
    events.sort(key=lambda e: e["t"])
    finals = {"fenced": {
        "redis": Final("w0.10.1.0", 100, [("w1.11.1.0", 101), ("w0.10.1.0", 100)]),
        "file": Final(None, None, None),
        "sql": Final(None, None, []),
    }}  # fmt: skip
    report = check(events, [], finals, _setup())
    found = {v.invariant: v for v in report.violations}
    assert set(found) == {"stale-accepted", "store-order", "final-value"}, report.tables()
    assert "pause_holder #1" in found["stale-accepted"].after
    assert report.fenced.overlaps == {"landed": 1}

    # The same run with the stale write refused, as the fence does it: nothing broke.
    events = [pause, *_holding("w0", 10, 100, 0.5, 3.6, "stale")]
    events += _holding("w1", 11, 101, 2.0, 2.5, "accepted")
    events.sort(key=lambda e: e["t"])
    finals["fenced"]["redis"] = Final("w1.11.1.0", 101, [("w1.11.1.0", 101)])
    report = check(events, [], finals, _setup())
    assert report.ok, report.tables()
    assert report.fenced.overlaps == {"fence": 1}


def _finals(wid: str, fence: int) -> dict[str, dict[str, Final]]:
    """The stores as the hand-made holdings leave them: ``wid`` last, in the pointer."""
    return {"fenced": {"redis": Final(wid, fence, None), "file": Final(None, None, None),
                       "sql": Final(None, None, None)}}  # fmt: skip


def test_checker_holds_the_run_to_the_models_steps() -> None:
    """A check passed after a newer grant, and a refusal with no higher fence before it,
    are steps the model does not allow; a restart of the lock Redis between the two
    grants allows the first (Redis forgot the lease)."""
    # w0 (fence 100) passes a check at 2.5, after w1 (fence 101) was granted at 2.0.
    late_check = _event(2.5, "step", "w0", 10, hold=1, step=1, fence=100)
    events = [*_holding("w0", 10, 100, 0.5, 0.6, "accepted"), late_check]
    events += _holding("w1", 11, 101, 2.0, 2.2, "accepted")
    events.sort(key=lambda e: e["t"])
    report = check(events, [], _finals("w1.11.1.0", 101), _setup())
    found = {v.invariant: v for v in report.violations}
    assert set(found) == {"model-check"}, report.tables()
    assert "w0 (pid 10, claim fence 100) passed a check at 2.500" in found["model-check"].message

    restart = {"t": 1.0, "wall": 1001.0, "ev": "fault", "w": "harness", "pid": 1,
               "kind": "restart_lock_redis", "n": 1, "end": 1.2}  # fmt: skip
    events = sorted([restart, *events], key=lambda e: e["t"])
    report = check(events, [], _finals("w1.11.1.0", 101), _setup())
    assert "model-check" not in {v.invariant for v in report.violations}, report.tables()

    # w1 (fence 101) is refused at 2.21 although only fence 100 ever came to the store.
    events = _holding("w0", 10, 100, 0.5, 0.6, "accepted")
    events += _holding("w1", 11, 101, 2.0, 2.2, "stale")
    events.sort(key=lambda e: e["t"])
    report = check(events, [], _finals("w0.10.1.0", 100), _setup())
    found = {v.invariant: v for v in report.violations}
    assert set(found) == {"model-refusal"}, report.tables()
    assert found["model-refusal"].message.startswith("redis: w1 (pid 11, claim fence 101)")
    # Refused after a write under a higher fence began: allowed.
    events = _holding("w0", 10, 102, 0.5, 0.6, "accepted")
    events += _holding("w1", 11, 101, 2.0, 2.2, "stale")
    events.sort(key=lambda e: e["t"])
    report = check(events, [], _finals("w0.10.1.0", 102), _setup())
    assert "model-refusal" not in {v.invariant for v in report.violations}, report.tables()


def test_checker_catches_a_stale_write_to_the_object_store() -> None:
    pause = {"t": 1.0, "wall": 1001.0, "ev": "fault", "w": "harness", "pid": 1,
             "kind": "pause_holder", "n": 1, "end": 3.5,
             "targets": [{"lane": "fenced", "pid": 10, "w": "w0"}]}  # fmt: skip
    events = [pause, *_holding("w0", 10, 100, 0.5, 3.6, "accepted", "object")]
    events += _holding("w1", 11, 101, 2.0, 2.5, "accepted", "object")
    events.sort(key=lambda e: e["t"])
    finals = {"fenced": {"redis": Final(None, None, []), "file": Final(None, None, None),
                         "sql": Final(None, None, []),
                         "object": Final("w0.10.1.0", 100, None)}}  # fmt: skip
    report = check(events, [], finals, _setup(stores=STORES))
    found = {v.invariant: v for v in report.violations}
    assert set(found) == {"stale-accepted", "final-value"}, report.tables()
    assert found["stale-accepted"].message.startswith("object:"), found["stale-accepted"]
    assert found["final-value"].message.startswith("object:"), found["final-value"]
    assert report.fenced.double_writes["object"] == 1


@pytest.mark.timeout(240)
def test_fenced_keeps_its_invariants_under_every_fault(tmp_path: Path) -> None:
    cfg = Config(
        seconds=25,
        workers=3,
        baseline_workers=2,
        ttl=TTL,
        celery=True,
        celery_children=2,
        runners=2,
        seed=20240501,
        out=str(tmp_path / "run"),
        # Quiet time between faults a little shorter than make chaos's, so that every
        # kind of fault comes up in a short run.
        gap=(1.2, 2.0),
        dedup=False,  # test_dedup_lane_keeps_its_invariants_under_every_fault
        beat=False,  # test_beat_lane_keeps_its_invariants_under_its_faults
        objects=OBJECTS,
    )
    report = Harness(cfg).run()
    print(report.tables())
    if OBJECTS:
        # The ObjectPointer took writes under the faults, and the store was checked.
        assert "object" in report.setup.store_names, report.tables()
        assert report.fenced.writes["object"].get("accepted", 0) > 10, report.tables()
        assert report.fenced.final_newest["object"], report.tables()
    fronts = {front.split("/")[0] for front in report.fenced.fronts}
    assert fronts == {"claim", "exclusive", "celery"}, report.tables()
    assert report.run_lane["commands"] > 3, report.tables()
    # About one of each kind in 25 s (the failovers need --sentinel or --cluster, the
    # beat faults the beat lane, the debounce sender's kill the dedup lane); a loaded
    # machine may fit fewer.
    others = len(FAILOVER_FAULTS) + len(CLUSTER_FAULTS) + len(BEAT_FAULTS) + 1
    assert sum(report.faults.values()) >= len(FAULTS) - others - 2, report.tables()
    assert report.ok, "\n" + report.tables()


# -- the dedup lane ---------------------------------------------------------------------


class _NoFaults:
    def before(self, t: float | None) -> str:
        return "before any fault"


def _dd(t: float, ev: str, pid: int, **fields: Any) -> dict[str, Any]:
    return {"t": t, "wall": 1000 + t, "ev": ev, "w": f"dedup-{pid}", "pid": pid,
            "lane": "dedup", **fields}  # fmt: skip


def _dd_run(
    name: str, task: str, tid: str, pid: int, start: float, end: float, *, args: Any = (1,),
    rerun: bool = False, skipped: str | None = None, policy: str = "skip",
) -> list[dict[str, Any]]:  # fmt: skip
    ident = {"name": name, "task": task, "id": tid, "args": list(args)}
    post = {"task": task, "id": tid, "args": list(args), "rerun": rerun, "policy": policy}
    if skipped is not None:
        return [_dd(end, "dd-post", pid, state="SUCCESS", skipped=skipped, **post)]
    return [
        _dd(start, "dd-start", pid, fence=int(start * 10), rerun=rerun, retries=0, **ident),
        _dd(end, "dd-end", pid, how="ok", **ident),
        _dd(end + 0.01, "dd-post", pid, state="SUCCESS", skipped=None, **post),
    ]


def _dd_call(t: float, task: str, tid: str, returned: str | None = None, args: Any = (1,)) -> Any:
    return _dd(t, "dd-call", 1, t1=t + 0.01, task=task, args=list(args), id=tid,
               returned=returned or tid, closing=False)  # fmt: skip


def _dd_violations(events: list[dict[str, Any]]) -> set[str]:
    events.sort(key=lambda e: e["t"])
    found, _stats, _checked = check_dedup(events, [], _NoFaults(), cooldown=1.5)
    return {v.invariant for v in found}


@pytest.mark.parametrize(
    "broken", ["limit", "cooldown", "rerun", "coalesced", "ignored", "retry", "chord", "healthy"]
)
def test_dedup_checker_catches_each_broken_invariant(broken: str) -> None:
    """Hand-made logs of one violation each; the healthy logs report none."""
    ev: list[dict[str, Any]] = []
    ev += _dd_call(0.0, "dd.limit", "a"), _dd_call(0.1, "dd.limit", "b")
    ev += _dd_run("dd:limit", "dd.limit", "a", 10, 0.5, 1.5)
    ev += _dd_run("dd:limit", "dd.limit", "b", 11, 0.6, 1.6)
    ev += _dd_call(0.0, "dd.cooldown", "c1"), _dd_call(0.2, "dd.cooldown", "c2")
    ev += _dd_run("dd:cooldown", "dd.cooldown", "c1", 12, 0.3, 0.5)
    ev += _dd_run("dd:cooldown", "dd.cooldown", "c2", 13, 0.6, 0.61, skipped="ran recently")
    ev += _dd_call(0.0, "dd.rerun", "r1", args=(5,)), _dd_call(0.2, "dd.rerun", "r2", args=(5,))
    ev += _dd_run("dd:rerun", "dd.rerun", "r1", 14, 0.1, 0.8, args=(5,), policy="rerun")
    ev += _dd_run("dd:rerun", "dd.rerun", "r2", 15, 0.3, 0.31, args=(5,), policy="rerun",
                  skipped="already running; rerun requested")  # fmt: skip
    ev += _dd_run("dd:rerun", "dd.rerun", "r3", 14, 0.9, 1.2, args=(5,), rerun=True,
                  policy="rerun")  # fmt: skip
    ev += _dd_call(0.0, "dd.finished", "f1"), _dd_call(0.4, "dd.finished", "f2", "f1")
    ev += _dd_run("dd:finished", "dd.finished", "f1", 16, 0.2, 0.6)
    ev.append(_dd_call(2.0, "dd.retry", "t1"))
    ev += _dd_run("dd:retry", "dd.retry", "t1", 17, 2.1, 2.3)
    ev[-1]["state"] = "RETRY"  # asked for by the body (dd-retrying): the claim is kept
    ev.append(_dd(2.29, "dd-retrying", 17, name="dd:retry", id="t1", args=[1]))
    ev += _dd_run("dd:retry", "dd.retry", "t1", 17, 2.7, 2.9)
    # A retry of an acquire that could not reach Redis keeps nothing: another run may
    # start before it comes back.
    ev.append(_dd_call(3.0, "dd.retry", "t5"))
    ev.append(_dd(3.1, "dd-post", 21, task="dd.retry", id="t5", args=[1], state="RETRY",
                  skipped=None, rerun=False, policy="skip"))  # fmt: skip
    ev += _dd_run("dd:retry", "dd.retry", "t6", 22, 3.2, 3.3)
    ev += _dd_run("dd:retry", "dd.retry", "t5", 21, 3.5, 3.6)
    ev.append(_dd(3.0, "dd-chord", 1, t1=3.01, chord=1, body="x"))
    ev.append(_dd(3.5, "dd-chord-body", 18, chord=1, results=2))
    assert _dd_violations([dict(e) for e in ev]) == set()

    if broken == "limit":  # a third run of a limit-2 name
        ev += _dd_run("dd:limit", "dd.limit_unclaimed", "u", 19, 0.7, 1.0)
    elif broken == "cooldown":  # a run 0.5 s after an ok run, in a 1.5 s cooldown
        ev += _dd_run("dd:cooldown", "dd.cooldown_unclaimed", "u", 19, 1.0, 1.1)
    elif broken == "rerun":  # the rerun never came
        ev = [e for e in ev if e.get("id") != "r3"]
    elif broken == "coalesced":  # coalesced into a message whose run had ended
        ev += [_dd_call(0.7, "dd.finished", "f3", "f1")]
    elif broken == "ignored":  # a first delivery ignored as a duplicate of no run
        ev.append(_dd_call(4.0, "dd.cooldown", "c3"))
        ev.append(_dd(4.1, "dd-post", 23, task="dd.cooldown", id="c3", args=[1],
                      state="IGNORED", skipped=None, rerun=False, policy="skip"))  # fmt: skip
    elif broken == "retry":  # another run took the claim the retry kept
        ev += _dd_run("dd:retry", "dd.retry", "t2", 20, 2.5, 2.6)
    elif broken == "chord":
        ev = [e for e in ev if e["ev"] != "dd-chord-body"]
    expected = {
        "limit": {"dd-limit"},
        "cooldown": {"dd-cooldown"},
        "rerun": {"dd-accounted"},
        "coalesced": {"dd-accounted"},
        "ignored": {"dd-accounted"},
        "retry": {"dd-retry"},
        "chord": {"dd-chord"},
        "healthy": set(),
    }[broken]
    assert _dd_violations(ev) == expected


def _dedup_config(tmp_path: Path, **kw: Any) -> Config:
    base: dict[str, Any] = dict(
        workers=2, baseline=False, run_lane=False, celery=False, ttl=TTL,
        out=str(tmp_path / "run"), dedup=True, dedup_children=5, gap=(1.2, 2.0), beat=False,
    )  # fmt: skip
    return Config(**{**base, **kw})


def test_dedup_checker_excuses_what_a_failover_forgot_until_the_old_master_is_demoted() -> None:
    """Two runs of a limit-1 name at once while a paused master, resumed, still served
    clients (before the sentinels demoted it): excused and counted; the same after the
    demotion: a violation."""
    from chaos.checker import Fault, Timeline

    def overlap(at: float) -> list[dict[str, Any]]:
        ev = [_dd_call(at, "dd.started", "a"), _dd_call(at + 0.1, "dd.started", "b")]
        ev += _dd_run("dd:started", "dd.started", "a", 10, at + 0.2, at + 1.0)
        ev += _dd_run("dd:started", "dd.started", "b", 11, at + 0.5, at + 1.2)
        return sorted(ev, key=lambda e: e["t"])

    pause = Fault(1, "failover_pause", 1.0, 3.0, 1001.0, {"synced": 12.0})
    for at, excused in ((8.0, True), (20.0, False)):
        found, stats, _ = check_dedup(overlap(at), [pause], Timeline([pause]), cooldown=1.5)
        assert [v.invariant for v in found] == ([] if excused else ["dd-limit"])
        assert stats.excused.get("dd-limit", 0) == int(excused)


@pytest.mark.parametrize("kind", CLUSTER_FAULTS)
def test_dedup_checker_excuses_what_a_cluster_failover_forgot_until_the_slot_map_settles(
    kind: str,
) -> None:
    """A Cluster failover, as a Sentinel one: two runs of a limit-1 name at once, and
    calls coalesced into a task whose run cleared its mark on the old master only, are
    excused until the old master is a replica in sync and the slot map agreed
    ("synced"); the same after it, or under a master that did not serve the names'
    slots: violations."""
    from chaos.checker import Fault, Timeline

    def overlap(at: float) -> list[dict[str, Any]]:
        ev = [_dd_call(at, "dd.started", "a"), _dd_call(at + 0.1, "dd.started", "b")]
        ev += _dd_run("dd:started", "dd.started", "a", 10, at + 0.2, at + 1.0)
        ev += _dd_run("dd:started", "dd.started", "b", 11, at + 0.5, at + 1.2)
        return ev

    def forgotten_clear(at: float) -> list[dict[str, Any]]:
        # f1 ran; its release cleared the until_finished mark where the failover lost
        # it: a later call is coalesced into f1, which will not run again.
        ev = [_dd_call(at, "dd.finished", "f1")]
        ev += _dd_run("dd:finished", "dd.finished", "f1", 12, at + 0.1, at + 0.4)
        ev.append(_dd_call(at + 1.0, "dd.finished", "f2", "f1"))
        return ev

    from redis.crc import key_slot

    from fenced._lease import ClaimKeys

    hit = sorted(key_slot(ClaimKeys.of(n).lock.encode()) for n in ("dd:started", "dd:finished"))
    # The failed-over master served both names' slots; another master's failover (the
    # slots between theirs) forgets neither: nothing of theirs is excused.
    ours = {"slots": [[hit[0], hit[1]]], "synced": 6.0}
    theirs = {"slots": [[hit[0] + 1, hit[1] - 1]], "synced": 6.0}
    cases = [(2.0, ours, True), (4.5, ours, True), (10.0, ours, False), (2.0, theirs, False)]
    for at, details, excused in cases:
        failover = Fault(1, kind, 1.0, 3.5, 1001.0, details)
        events = sorted(overlap(at) + forgotten_clear(at), key=lambda e: e["t"])
        found, stats, _ = check_dedup(events, [failover], Timeline([failover]), cooldown=1.5)
        assert sorted(v.invariant for v in found) == (
            [] if excused else ["dd-accounted", "dd-limit"]
        )
        counted = {k: n for k, n in stats.excused.items() if n}
        assert counted == ({"dd-limit": 1, "dd-accounted": 1} if excused else {})


def test_cluster_and_sentinel_are_one_or_the_other() -> None:
    from chaos.__main__ import parse

    with pytest.raises(ValueError, match="choose one of them"):
        Config(sentinel=True, cluster=True).check()
    with pytest.raises(ValueError, match="drop --no-dedup"):
        Config(cluster=True, dedup=False).check()
    cfg = parse(["--cluster"])
    assert isinstance(cfg, Config) and cfg.cluster and cfg.dedup_replicas == 1
    assert Config(cluster=True, replicas=0).dedup_replicas == 0
    cfg = parse(["--no-beat"])
    assert isinstance(cfg, Config) and not cfg.beat and cfg.beats == 3
    with pytest.raises(ValueError, match="drop --no-beat"):
        Config(beat=False, broken=("beat-sender",)).check()


def test_dedup_checker_accepts_a_duplicate_ignored_after_a_run_killed_before_its_postrun() -> None:
    """The body ended ok and its release set the done marker; the worker was killed
    before the postrun: the message comes back and is ignored as completed. Without
    the ok end, the same ignore is a violation."""
    from chaos.checker import Fault, Timeline

    kill = Fault(1, "kill_worker", 0.61, 0.61, 1000.61,
                 {"targets": [{"lane": "dedup", "pid": 10, "w": "dedup-10"}]})  # fmt: skip
    ran = _dd_run("dd:rerun", "dd.rerun", "r1", 10, 0.2, 0.6, policy="rerun")[:2]
    ignored = _dd(5.0, "dd-post", 11, task="dd.rerun", id="r1", args=[1], state="IGNORED",
                  skipped=None, rerun=False, policy="rerun")  # fmt: skip
    for how, ok in (("ok", True), ("error", False)):
        events = [_dd_call(0.0, "dd.rerun", "r1"), *[dict(e) for e in ran], ignored]
        events[2]["how"] = how
        found, _, _ = check_dedup(events, [kill], Timeline([kill]), cooldown=1.5)
        assert [v.invariant for v in found] == ([] if ok else ["dd-accounted"])


def test_dedup_checker_lets_a_retry_lease_go_when_its_holder_is_killed() -> None:
    """A retry keeps its claim; the worker that held it is killed (its message comes
    back only after the broker's visibility timeout): another run may start once the
    kept lease expired. Without the kill, the same start is a violation."""
    from chaos.checker import Fault, Timeline

    ev = [_dd_call(0.0, "dd.retry", "t1"), _dd_call(3.0, "dd.retry", "t2")]
    ev += _dd_run("dd:retry", "dd.retry", "t1", 17, 0.1, 0.3)
    ev[-1]["state"] = "RETRY"
    ev.append(_dd(0.29, "dd-retrying", 17, name="dd:retry", id="t1", args=[1]))
    ev += _dd_run("dd:retry", "dd.retry", "t2", 18, 4.0, 4.2)
    ev += _dd_run("dd:retry", "dd.retry", "t1", 19, 9.0, 9.2)
    ev.sort(key=lambda e: e["t"])
    kill = Fault(1, "kill_worker", 0.5, 0.5, 1000.5,
                 {"targets": [{"lane": "dedup", "pid": 17, "w": "dedup-17",
                               "whole_celery": True, "pids": [16, 17, 18]}]})  # fmt: skip
    for faults, expected in (([kill], []), ([], ["dd-retry"])):
        found, _, _ = check_dedup(ev, faults, Timeline(faults), cooldown=1.5)
        assert [v.invariant for v in found] == expected


def test_dedup_checker_tells_a_retry_that_came_by_its_attempt_not_by_time() -> None:
    """The body publishes its retry before its own postrun is written: the next attempt
    (a short countdown, another pool child) may start before that postrun. It is the
    retry that came, whatever the order; a later delivery of the same attempt is not."""
    call = _dd_call(0.0, "dd.started", "s1")
    post = _dd(1.0, "dd-post", 17, task="dd.started", id="s1", args=[1], state="RETRY",
               skipped=None, rerun=False, policy="skip", retries=0)  # fmt: skip
    came = _dd_run("dd:started", "dd.started", "s1", 18, 0.5, 0.8)
    came[0]["retries"] = 1
    came[-1]["retries"] = 1
    assert _dd_violations([call, post, *came]) == set()
    again = _dd(2.0, "dd-post", 18, task="dd.started", id="s1", args=[1], state="SUCCESS",
                skipped="busy", rerun=False, policy="skip", retries=0)  # fmt: skip
    assert _dd_violations([call, post, again]) == {"dd-accounted"}


def test_dedup_checker_wants_a_retry_of_its_own_for_a_message_delivered_again() -> None:
    """A killed worker's message comes back: its attempt asks for a retry again. An
    attempt that the first delivery's retry made long before does not account for it."""
    call = _dd_call(0.0, "dd.started", "s1")

    def retry(t: float, pid: int) -> dict[str, Any]:
        return _dd(t, "dd-post", pid, task="dd.started", id="s1", args=[1], state="RETRY",
                   skipped=None, rerun=False, policy="skip", retries=0)  # fmt: skip

    came = _dd_run("dd:started", "dd.started", "s1", 18, 1.5, 1.8)
    came[0]["retries"] = 1
    came[-1]["retries"] = 1
    assert _dd_violations([call, retry(1.0, 17), *came]) == set()
    assert _dd_violations([call, retry(1.0, 17), *came, retry(20.0, 19)]) == {"dd-accounted"}


@pytest.mark.parametrize("broken", ["replace-ran", "replace-published", "debounce", "healthy"])
def test_dedup_checker_catches_a_broken_replace_or_debounce(broken: str) -> None:
    """Hand-made logs: a call its replacer took the name from runs again, or publishes
    after its replacer did; a debounced call no run follows. Healthy: nothing."""
    task, name = "dd.replace_retry", "dd:replace_retry"
    ev = [_dd_call(0.0, task, "a", args=(1,)), _dd_call(0.2, task, "b", args=(2,))]
    ev += _dd_run(name, task, "a", 10, 0.1, 0.6, args=(1,), policy="replace")
    ev[-1]["replaced_by"] = "b"
    ev += _dd_run(name, task, "b", 11, 0.3, 1.0, args=(2,), policy="replace")
    ev.append(_dd(0.95, "dd-publish", 11, name=name, task=task, id="b", seq=2, fence=3,
                  accepted=True))  # fmt: skip
    ev.append(_dd(0.5, "dd-publish", 10, name=name, task=task, id="a", seq=1, fence=1,
                  accepted=True))  # fmt: skip
    ev.append(_dd(2.0, "dd-dcall", 2, t1=2.01, seq=7, returned="d1"))
    ev += _dd_run("dd:debounce", "dd.debounce", "d1", 12, 2.5, 2.6, args=(7,))
    assert _dd_violations([dict(e) for e in ev]) == set()
    if broken == "replace-ran":  # its redelivery ran after b had replaced it
        ev += _dd_run(name, task, "a", 13, 1.5, 1.7, args=(1,), policy="replace")
    elif broken == "replace-published":  # a's write landed after b's
        ev.append(_dd(1.1, "dd-publish", 10, name=name, task=task, id="a", seq=1, fence=1,
                      accepted=True))  # fmt: skip
    elif broken == "debounce":  # a later call, and no run after it
        ev.append(_dd(3.0, "dd-dcall", 2, t1=3.01, seq=8, returned="d2"))
    expected = {"replace-ran": {"dd-replace"}, "replace-published": {"dd-replace"},
                "debounce": {"dd-debounce"}, "healthy": set()}[broken]  # fmt: skip
    assert _dd_violations(ev) == expected


# -- the beat lane ----------------------------------------------------------------------

#: A due time (ms) on a whole minute, far from any other test's clock.
_T0 = 1_800_000_000_000 - 1_800_000_000_000 % 60_000


def _bt(due: int, entry: str = "tick-1s", late: float = 0.1, tid: str | None = None) -> Any:
    """A run noted by the beat lane's worker; wall and monotonic clocks 1000 s apart."""
    t = due / 1000 - 1000 + late
    return {"t": t, "wall": t + 1000, "ev": "bt-run", "w": "beat-worker-9", "pid": 9,
            "lane": "beat", "entry": entry, "due": due,
            "id": tid or f"fenced-beat:chaos:{entry}:{due}"}  # fmt: skip


@pytest.mark.parametrize("broken", ["foreign", "lost", "late", "early", "twice", "healthy"])
def test_beat_checker_catches_each_broken_invariant(broken: str) -> None:
    """Hand-made logs of the beat lane: ten ticks of an every-second entry, and the
    uneven-seconds calendar's ticks in that time; one violation each, or none."""
    from chaos.beat_schedule import SECONDS

    begin = _T0 / 1000 - 1000
    # The first beat led 1.5 s before the first tick; the beats stopped 11 s after it.
    ev: list[dict[str, Any]] = [
        {"t": begin - 1.5, "wall": begin + 998.5, "ev": "beat-leading", "w": "harness", "pid": 1},
    ]
    ev += [_bt(_T0 + 1000 * k) for k in range(10)]
    ev += [_bt(_T0 + 1000 * s, "cron-seconds") for s in SECONDS if s < 10]
    ev.append(_bt(_T0, "cron-minutes"))
    ev.append({"t": begin + 11.0, "wall": begin + 1011.0, "ev": "beat-stopped", "w": "harness",
               "pid": 1})  # fmt: skip
    if broken == "foreign":  # a second sender, ids of its own
        ev.append(_bt(_T0 + 3000, tid="6f1c0e4e-0000-4000-8000-000000000000"))
    elif broken == "lost":
        ev = [e for e in ev if e.get("due") != _T0 + 4000]
    elif broken == "late":
        ev = [e for e in ev if e.get("due") != _T0 + 5000] + [_bt(_T0 + 5000, late=4.0)]
    elif broken == "early":
        ev = [e for e in ev if e.get("due") != _T0 + 6000] + [_bt(_T0 + 6000, late=-2.0)]
    elif broken == "twice":
        ev.append(_bt(_T0 + 7000, late=0.5))
    ev.sort(key=lambda e: e["t"])
    found, stats, _ = check_beat(ev, [], _NoFaults())
    expected = {"foreign": {"beat-tick"}, "lost": {"beat-every"}, "late": {"beat-late"},
                "early": {"beat-early"}, "twice": {"beat-once"},
                "healthy": set()}[broken]  # fmt: skip
    assert {v.invariant for v in found} == expected, [str(v) for v in found]
    assert stats.ticks["tick-1s"] >= 9

"""The fault-injection suite (chaos/), short: every front end under every fault, checked.

``make chaos`` runs it for five minutes with six workers per lane; here it runs for
about 25 s with three fenced workers, two Lock workers, one Celery worker (two prefork
children) and two ``fenced run`` runners, and fails on any broken invariant of the
fenced lane. The redis-py Lock lane runs beside it under the same faults and is not
held to anything. The first test shows that the checker catches what it should.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chaos import Config  # noqa: E402
from chaos.checker import Setup, check  # noqa: E402
from chaos.config import FAULTS  # noqa: E402
from chaos.harness import Harness  # noqa: E402
from chaos.stores import Final  # noqa: E402

TTL = 1.0


def _setup(seconds: float = 10.0) -> Setup:
    return Setup(seconds, TTL, 2, "1 Claim, 1 @exclusive", 0, 0, 0, "sqlite")


def _event(t: float, ev: str, w: str, pid: int, **fields: Any) -> dict[str, Any]:
    return {"t": t, "wall": 1000 + t, "ev": ev, "w": w, "pid": pid, "lane": "fenced",
            "front": "claim", **fields}  # fmt: skip


def _holding(
    w: str, pid: int, fence: int, acked: float, write_at: float, result: str
) -> list[dict[str, Any]]:
    wid = f"{w}.{pid}.1.0"
    return [
        _event(acked, "acquired", w, pid, hold=1, fence=fence, sent=acked - 0.01),
        _event(acked, "step", w, pid, hold=1, step=0, fence=fence),
        _event(write_at, "writing", w, pid, hold=1, store="redis", wid=wid, fence=fence),
        _event(write_at + 0.01, "write", w, pid, hold=1, store="redis", wid=wid, fence=fence,
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
    )
    report = Harness(cfg).run()
    print(report.tables())
    fronts = {front.split("/")[0] for front in report.fenced.fronts}
    assert fronts == {"claim", "exclusive", "celery"}, report.tables()
    assert report.run_lane["commands"] > 3, report.tables()
    # About one of each kind in 25 s; a loaded machine may fit fewer.
    assert sum(report.faults.values()) >= len(FAULTS) - 2, report.tables()
    assert report.ok, "\n" + report.tables()

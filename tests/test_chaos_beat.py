"""The chaos suite's beat lane under its faults, and the dedup lane broken on purpose
(with a second beat sender): the checkers must fail it. Apart from tests/test_chaos.py
so that the long runs spread over the test workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chaos import Config
from chaos.config import BEAT_FAULTS
from chaos.harness import Harness

from test_chaos import TTL, _dedup_config


@pytest.mark.timeout(120)
def test_dedup_checker_fails_a_broken_lane(tmp_path: Path) -> None:
    cfg = _dedup_config(
        tmp_path, seconds=6, seed=1, faults=("client_kill", "kill_debounce_sender"),
        broken=("limit", "cooldown", "rerun", "beat-sender"), beat=True,
    )  # fmt: skip
    report = Harness(cfg).run()
    print(report.tables())
    found = report.by_invariant()
    d = report.dedup
    assert d is not None
    # --broken limit: a third run of dd:limit; cooldown: a run inside the window.
    assert found["dd-limit"] and found["dd-cooldown"], report.tables()
    # beat-sender: Celery's own scheduler beside fenced's sends ticks under its own ids.
    assert found["beat-tick"], report.tables()
    # What was not broken holds: the debounce sender killed, the replace tasks.
    assert d.sender_kills and not found["dd-debounce"] and not found["dd-replace"], report.tables()
    # rerun: triggers dropped, never rerun; when a call came while a run held the name
    # at all (a loaded machine can space six seconds of calls so that none did: the
    # checker catches a dropped trigger on hand-made logs every time: see above).
    if d.rerun_triggers:
        assert found["dd-accounted"], report.tables()
    assert not report.ok


@pytest.mark.timeout(150)
def test_beat_lane_keeps_its_invariants_under_its_faults(tmp_path: Path) -> None:
    """Three celery beat processes under fenced's scheduler: the leader killed and
    restarted, paused, the proxied beat's dispatch reply dropped, the beat whose clock
    runs ahead made leader and moved further ahead. Every tick runs once, on time."""
    cfg = Config(
        seconds=15, workers=2, baseline=False, run_lane=False, celery=False, dedup=False,
        beat=True, faults=BEAT_FAULTS, gap=(1.0, 1.5), seed=20240503, ttl=TTL,
        out=str(tmp_path / "run"),
    )  # fmt: skip
    report = Harness(cfg).run()
    print(report.tables())
    b = report.beat
    assert b is not None
    assert sum(report.faults.get(k, 0) for k in BEAT_FAULTS) >= 3, report.tables()
    # The cron entry is due a few times in 15 s: each ran, or fell in a fault's window
    # and was passed over there (the catch-up skip, which the checker holds to the
    # windows): either way the calendar was followed.
    cron = b.ticks["cron-seconds"] + b.passed_over.get("cron-seconds", 0)
    assert b.ticks["tick-1s"] >= 10 and cron >= 1, report.tables()
    assert report.ok, "\n" + report.tables()

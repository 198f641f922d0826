"""``fenced run`` when its own process fails: killed, stopped, or its watchdog killed.

The command must never outlive its runner, and a stopped runner must not leave it
working past the lease. Real processes throughout, read through /proc.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from _wait import wait_for
from fenced.testing import RedisServer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads processes through /proc"
)

FENCED = [sys.executable, "-m", "fenced.cli"]
GRACE = 1.0
#: How long past the grace a stop may take on a busy two-core machine.
SLACK = 5.0

# The command: records its pid, starts a grandchild that beats too, and beats every
# 0.1 s until the file "go" appears, then exits with the status given as $1.
FAMILY = """
echo $$ > pid.tmp && mv pid.tmp pid
( while :; do : > gbeat; sleep 0.1; done ) &
echo $! > gpid.tmp && mv gpid.tmp gpid
while [ ! -e go ]; do echo A >> log; sleep 0.1; done
exit "${1:-0}"
"""

# The second copy's command: what state the first copy's command is in as it starts.
SECOND = """
import sys
pid, seen, log = sys.argv[1:]
try:
    with open(f"/proc/{pid}/stat") as f:
        state = f.read().rsplit(")", 1)[1].split()[0]
except FileNotFoundError:
    state = "gone"
with open(seen, "w") as f:
    f.write(state)
with open(log, "a") as f:
    f.write("B\\n")
"""

# ``fenced run`` with a Popen that returns only once the file "popen-return" appears:
# the command runs, but the runner has not yet been told (as on a starved machine).
SLOW_START = """
import os, runpy, subprocess, sys, time

class SlowPopen(subprocess.Popen):
    def __init__(self, args, *rest, **kw):
        super().__init__(args, *rest, **kw)
        if args[0] == "sh":
            open("in-popen", "w").close()
            while not os.path.exists("popen-return"):
                time.sleep(0.02)

subprocess.Popen = SlowPopen
sys.argv = ["fenced", *sys.argv[1:]]
runpy.run_module("fenced.cli", run_name="__main__")
"""


# -- processes, through /proc ---------------------------------------------------------------


def stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def state(pid: int) -> str | None:
    fields = stat(pid)
    return fields[0] if fields else None


def stopped(pid: int) -> bool:
    """Stopped, or as good as: a shell in vfork waits (state D) for a child that was
    stopped before it could exec, and the stop signal stays pending for the shell until
    that child goes on, which a SIGCONT to the group also cancels."""
    here = state(pid)
    if here == "D":
        return any(state(child) == "T" for child in children(pid))
    return here == "T"


def alive(pid: int) -> bool:
    """Running or stopped; a zombie has stopped for good (its parent may not reap it)."""
    return state(pid) not in (None, "Z", "X")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat(int(entry))
            if fields and fields[1] == str(pid):
                found.append(int(entry))
    return found


def watchdogs_of(runner: int) -> list[int]:
    return [c for c in children(runner) if "_watchdog" in cmdline(c) and alive(c)]


def watchdogs_named(name: str) -> list[int]:
    """Watchdogs of runs of ``name`` anywhere, their runner alive or not."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            line = cmdline(int(entry))
            if "_watchdog" in line and f" {name} " in line and alive(int(entry)):
                found.append(int(entry))
    return found


def pipes(pid: int) -> set[str]:
    links = set()
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("pipe:"):
            links.add(link)
    return links


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


# -- fixtures -------------------------------------------------------------------------------


@dataclass
class Runs:
    """The runs a test started; whatever is left of them is killed afterwards."""

    dir: Path
    url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    def start(self, *args: str, tag: str = "run") -> subprocess.Popen[bytes]:
        with open(self.dir / f"{tag}.out", "wb") as out, open(self.dir / f"{tag}.err", "wb") as err:
            proc = subprocess.Popen(
                [*FENCED, "run", *args], stdout=out, stderr=err, cwd=self.dir, env=self.env()
            )
        self.procs.append(proc)
        return proc

    def family(self, name: str, *opts: str, status: int = 0) -> subprocess.Popen[bytes]:
        """A run of FAMILY under ``name``; returns once its command and grandchild beat."""
        proc = self.start(*opts, name, "--", "sh", "-c", FAMILY, "sh", str(status))
        pid = wait_for("the command's pid", lambda: read_pid(self.dir / "pid"), proc=proc)
        self.groups.append(pid)
        wait_for("the grandchild's pid", lambda: read_pid(self.dir / "gpid"), proc=proc)
        return proc

    def env(self) -> dict[str, str]:
        return {**os.environ, "FENCED_REDIS_URL": self.url}

    def beats(self) -> int:
        """How often the command has written to its log."""
        return (self.dir / "log").read_text().count("A")

    def err(self, tag: str = "run") -> str:
        return (self.dir / f"{tag}.err").read_text()

    @property
    def pid(self) -> int:
        pid = read_pid(self.dir / "pid")
        assert pid is not None
        return pid

    @property
    def gpid(self) -> int:
        pid = read_pid(self.dir / "gpid")
        assert pid is not None
        return pid

    def show(self, name: str) -> list[dict[str, Any]]:
        res = subprocess.run(
            [*FENCED, "show", name, "--json"], capture_output=True, text=True, env=self.env()
        )
        runs: list[dict[str, Any]] = json.loads(res.stdout)["runs"]
        return runs


@pytest.fixture
def runs(redis_server: RedisServer, tmp_path: Path) -> Iterator[Runs]:
    redis_server.client().flushall()
    started = Runs(tmp_path, redis_server.url)
    yield started
    for proc in started.procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    for group in started.groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in started.pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def gone_within(pids: list[int], timeout: float, what: str) -> float:
    """Wait until none of ``pids`` runs; return how long that took."""
    start = time.monotonic()
    wait_for(what, lambda: not any(alive(pid) for pid in pids), timeout)
    return time.monotonic() - start


# -- the runner killed ----------------------------------------------------------------------


def test_runner_killed_by_sigkill_takes_its_command_and_grandchild_along(runs: Runs) -> None:
    proc = runs.family("job:k9", "--grace", str(GRACE))
    dogs = watchdogs_of(proc.pid)  # started before the command
    assert alive(runs.pid) and alive(runs.gpid)
    proc.kill()
    proc.wait()
    gone_within([runs.pid, runs.gpid], GRACE + SLACK, "the command and its grandchild to stop")
    gone_within(dogs, GRACE + SLACK, "the watchdog to exit")
    assert "'job:k9'" in runs.err() and "SIGTERM" in runs.err()


def test_a_command_ignoring_sigterm_is_killed_after_the_grace_when_its_runner_dies(
    runs: Runs,
) -> None:
    script = "trap '' TERM; echo $$ > pid.tmp && mv pid.tmp pid; while :; do sleep 0.1; done"
    proc = runs.start("--grace", str(GRACE), "job:stubborn", "--", "sh", "-c", script)
    pid = wait_for("the command's pid", lambda: read_pid(runs.dir / "pid"), proc=proc)
    runs.groups.append(pid)
    proc.kill()
    proc.wait()
    took = gone_within([pid], GRACE + SLACK, "the command to be killed")
    assert took >= GRACE * 0.8  # it was given its grace first


def test_a_command_ignoring_sigterm_is_killed_when_its_runner_dies_before_naming_its_group(
    runs: Runs,
) -> None:
    # The runner is killed while its Popen has not returned: the command runs, but the
    # runner never told the watchdog its process group, and the death signal is ignored.
    script = "trap '' TERM; echo $$ > pid.tmp && mv pid.tmp pid; while :; do sleep 0.1; done"
    args = ["run", "--grace", str(GRACE), "job:stubborn-start", "--", "sh", "-c", script]
    with open(runs.dir / "run.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_START, *args], stderr=err, cwd=runs.dir, env=runs.env()
        )
    runs.procs.append(proc)
    wait_for("Popen to hold", lambda: (runs.dir / "in-popen").exists(), proc=proc)
    pid = wait_for("the command's pid", lambda: read_pid(runs.dir / "pid"), proc=proc)
    runs.groups.append(pid)
    proc.kill()
    proc.wait()
    took = gone_within([pid], GRACE + SLACK, "the command to be killed")
    assert took >= GRACE * 0.8  # it was given its grace first


# -- the runner stopped ---------------------------------------------------------------------


def test_a_stopped_runner_has_its_command_stopped_before_a_second_copy_starts(
    runs: Runs,
) -> None:
    proc = runs.family("job:stop", "--ttl", "1", "--grace", str(GRACE))
    proc.send_signal(signal.SIGSTOP)
    try:
        # A second run waits for the claim and starts as soon as the lease has ended.
        second = runs.start(
            "--on-busy", "wait", "--wait-timeout", "60", "job:stop", "--",
            sys.executable, "-c", SECOND, str(runs.pid), "seen", "log", tag="second",
        )  # fmt: skip
        assert second.wait(timeout=90) == 0, runs.err("second")
        # As the second copy started, the first one no longer ran.
        assert (runs.dir / "seen").read_text() in ("gone", "Z")
        assert not alive(runs.gpid)
        log = (runs.dir / "log").read_text()
        assert "A" in log and "A" not in log[log.index("B") :]
    finally:
        proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=60) == 76, runs.err()
    assert "lost" in runs.err()
    outcomes = {run["outcome"] for run in runs.show("job:stop")}
    assert outcomes == {"lost", "ok"}


def test_ctrl_z_stops_the_command_and_fg_resumes_it(runs: Runs) -> None:
    proc = runs.family("job:tstp", "--ttl", "30", status=4)
    proc.send_signal(signal.SIGTSTP)
    wait_for("the runner to stop", lambda: state(proc.pid) == "T")
    wait_for("the command to stop", lambda: stopped(runs.pid))
    wait_for("the grandchild to stop", lambda: stopped(runs.gpid))
    proc.send_signal(signal.SIGCONT)
    wait_for("the command to resume", lambda: state(runs.pid) in ("S", "R"))
    (runs.dir / "go").touch()
    assert proc.wait(timeout=60) == 4, runs.err()
    assert "stopped" in runs.err()  # one line said what a stop means for the claim


def test_ctrl_z_while_the_command_is_being_started_stops_the_command_too(
    runs: Runs,
) -> None:
    args = ["run", "--ttl", "30", "job:tstp-start", "--", "sh", "-c", FAMILY, "sh", "4"]
    with open(runs.dir / "run.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_START, *args], stderr=err, cwd=runs.dir, env=runs.env()
        )
    runs.procs.append(proc)
    wait_for("Popen to hold", lambda: (runs.dir / "in-popen").exists(), proc=proc)
    wait_for("the grandchild's pid", lambda: read_pid(runs.dir / "gpid"), proc=proc)
    runs.groups.append(runs.pid)
    proc.send_signal(signal.SIGTSTP)  # the runner's Popen has not returned yet
    time.sleep(0.3)  # let the handler run before Popen returns
    (runs.dir / "popen-return").touch()
    wait_for("the runner to stop", lambda: state(proc.pid) == "T")
    wait_for("the command to stop", lambda: stopped(runs.pid))
    wait_for("the grandchild to stop", lambda: stopped(runs.gpid))
    proc.send_signal(signal.SIGCONT)
    wait_for("the command to resume", lambda: state(runs.pid) in ("S", "R"))
    (runs.dir / "go").touch()
    assert proc.wait(timeout=60) == 4, runs.err()


def test_ctrl_z_past_the_lease_ends_the_command_and_the_run_reports_the_loss(
    runs: Runs,
) -> None:
    proc = runs.family("job:tstp-long", "--ttl", "1", "--grace", str(GRACE))
    proc.send_signal(signal.SIGTSTP)
    wait_for("the command to stop", lambda: stopped(runs.pid))
    # Stopped, the command would not act on SIGTERM: the watchdog continues it to.
    gone_within([runs.pid, runs.gpid], 1 + GRACE + SLACK, "the watchdog to end the command")
    assert state(proc.pid) == "T"
    proc.send_signal(signal.SIGCONT)
    assert proc.wait(timeout=60) == 76, runs.err()
    assert [run["outcome"] for run in runs.show("job:tstp-long")] == ["lost"]


# -- an ordinary run, and the watchdog itself -----------------------------------------------


def test_a_normal_run_passes_its_status_through_and_leaves_no_watchdog(runs: Runs) -> None:
    proc = runs.family("job:normal", status=3)
    watchdog = wait_for("the watchdog", lambda: watchdogs_of(proc.pid), proc=proc)[0]
    assert os.getsid(watchdog) == watchdog  # its own session: a terminal's signals miss it
    # The command holds neither end of the watchdog's pipe: only the runner's death
    # closes it.
    assert not pipes(runs.pid) & pipes(watchdog)
    (runs.dir / "go").touch()
    assert proc.wait(timeout=60) == 3
    assert state(watchdog) is None  # exited, and reaped
    assert not watchdogs_named("job:normal")
    assert runs.err() == ""  # cron mails any output: a normal run prints none
    assert [run["outcome"] for run in runs.show("job:normal")] == ["failed"]


def test_the_watchdog_killed_does_not_stop_a_healthy_run(runs: Runs) -> None:
    proc = runs.family("job:wd", "--ttl", "1")
    first = wait_for("the watchdog", lambda: watchdogs_of(proc.pid), proc=proc)[0]
    os.kill(first, signal.SIGKILL)
    second = wait_for(
        "another watchdog", lambda: [w for w in watchdogs_of(proc.pid) if w != first], proc=proc
    )[0]
    assert alive(runs.pid) and alive(runs.gpid) and alive(second)
    # The run goes on past its first lease (ttl 1 s): renewals continue.
    beats = runs.beats()
    wait_for("15 more beats", lambda: runs.beats() >= beats + 15, proc=proc)
    assert alive(runs.pid) and alive(runs.gpid)
    (runs.dir / "go").touch()
    assert proc.wait(timeout=60) == 0, runs.err()
    assert [run["outcome"] for run in runs.show("job:wd")] == ["ok"]


def test_the_replacement_watchdog_guards_like_the_first(runs: Runs) -> None:
    proc = runs.family("job:wd2", "--grace", str(GRACE))
    first = wait_for("the watchdog", lambda: watchdogs_of(proc.pid), proc=proc)[0]
    os.kill(first, signal.SIGKILL)
    wait_for(
        "another watchdog", lambda: [w for w in watchdogs_of(proc.pid) if w != first], proc=proc
    )
    proc.kill()
    proc.wait()
    gone_within([runs.pid, runs.gpid], GRACE + SLACK, "the command to stop")


def test_with_its_watchdog_stopped_the_runners_death_still_ends_the_command(
    runs: Runs,
) -> None:
    proc = runs.family("job:pdeath", "--grace", str(GRACE))
    watchdog = wait_for("the watchdog", lambda: watchdogs_of(proc.pid), proc=proc)[0]
    runs.pids.append(watchdog)
    os.kill(watchdog, signal.SIGSTOP)
    proc.kill()
    proc.wait()
    # The second line: the kernel's parent-death signal, to the direct child only.
    gone_within([runs.pid], SLACK, "the command to get its parent-death signal")
    assert alive(runs.gpid)
    os.kill(watchdog, signal.SIGCONT)
    gone_within([runs.gpid], GRACE + SLACK, "the watchdog to end the grandchild")
    gone_within([watchdog], GRACE + SLACK, "the watchdog to exit")


def test_a_command_that_cannot_start_leaves_no_watchdog(runs: Runs) -> None:
    proc = runs.start("job:nf", "--", "no-such-command-here")
    assert proc.wait(timeout=60) == 127
    assert not watchdogs_named("job:nf")


def test_a_lease_gone_when_the_command_ends_exits_76(redis_server: RedisServer) -> None:
    import subprocess
    import sys

    from fenced._lease import ClaimKeys

    key = ClaimKeys.of("gone-at-end").lock
    command = "import redis, sys; redis.Redis.from_url(sys.argv[1]).delete(sys.argv[2])"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "fenced.cli",
            "run",
            "gone-at-end",
            "--",
            sys.executable,
            "-c",
            command,
            redis_server.url,
            key,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "FENCED_REDIS_URL": redis_server.url},
    )
    assert res.returncode == 76, res.stderr
    assert "was not held when the command ended" in res.stderr


def test_a_runner_gone_before_its_command_execs_keeps_the_command_from_running(
    tmp_path: Path,
) -> None:
    """The runner killed between the fork and the exec of its command (before it could
    tell its watchdog the command's group): the child, under the runner's Python signal
    handlers until its exec, must end itself, not run the command unsupervised."""
    from fenced._watchdog import dies_with_runner

    previous = signal.signal(signal.SIGTERM, lambda _s, _f: None)  # as fenced run has
    try:
        # A parent other than the runner the function was made for: the runner is gone.
        gone = dies_with_runner(runner=1)
        assert gone is not None
        proc = subprocess.Popen(["sh", "-c", "echo ran"], preexec_fn=gone,
                                stdout=subprocess.PIPE)  # fmt: skip
        out, _ = proc.communicate(timeout=10)
        assert (out, proc.returncode) == (b"", 128 + signal.SIGTERM)
        # The runner alive: the command runs, and its SIGTERM has its default action.
        proc = subprocess.Popen(["sh", "-c", "echo ran; kill -TERM $$; echo survived"],
                                preexec_fn=dies_with_runner(), stdout=subprocess.PIPE)  # fmt: skip
        out, _ = proc.communicate(timeout=10)
        assert (out, proc.returncode) == (b"ran\n", -signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)

"""The ``fenced run`` lane: runners competing for a second name, each running a command.

Each runner is a real ``fenced run --on-busy wait NAME -- sh -c COMMAND`` process;
when it exits, its loop starts another. The command carries no fence: it appends
``start``, a ``tick`` every 0.1 s and ``end`` lines, each with its pid and the wall
time, to one file, so the checker can tell whether two commands ever ran at once, and
whether a command kept running after its runner was killed.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .events import EventLog

__all__ = ["COMMAND", "Command", "RunLane", "read_lane"]

#: The command under the claim: marks its start, ticks, and its end (also on SIGTERM).
COMMAND = r"""
f="$1"; n="$2"
echo "start $$ $PPID $(date +%s.%N)" >> "$f"
trap 'echo "end $$ term $(date +%s.%N)" >> "$f"; exit 143' TERM INT HUP
i=0
while [ "$i" -lt "$n" ]; do
  sleep 0.1
  echo "tick $$ $(date +%s.%N)" >> "$f"
  i=$((i + 1))
done
echo "end $$ ok $(date +%s.%N)" >> "$f"
"""
#: What the command is called in ``ps`` (its $0), to recognise it.
MARK = "chaos-run-command"


class RunLane:
    """``runners`` loops, each running one ``fenced run`` after another until stopped."""

    def __init__(
        self,
        *,
        name: str,
        lock_url: str,
        ttl: float,
        runners: int,
        file: Path,
        log: EventLog,
        env: dict[str, str],
        out_dir: Path,
        seconds_per_command: float = 2.0,
    ) -> None:
        self.name = name
        self.lock_url = lock_url
        self.ttl = ttl
        self.file = file
        self.log = log
        self.env = env
        self.out_dir = out_dir
        self.ticks = max(1, round(seconds_per_command / 0.1))
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), name=f"runner-{i}", daemon=True)
            for i in range(runners)
        ]

    def argv(self) -> list[str]:
        """One runner's command line."""
        return [
            sys.executable, "-m", "fenced", "run",
            "--ttl", str(self.ttl), "--redis", self.lock_url,
            "--on-busy", "wait", "--wait-timeout", "10", "--grace", "1", "--quiet",
            self.name, "--", "sh", "-c", COMMAND, MARK, str(self.file), str(self.ticks),
        ]  # fmt: skip

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def runner_pids(self) -> set[int]:
        """Pids of the runners running now."""
        with self._lock:
            return {p.pid for p in self.procs.values() if p.poll() is None}

    def _loop(self, i: int) -> None:
        rng = random.Random()
        out = open(self.out_dir / f"runner-{i}.out", "ab")  # noqa: SIM115 - for the loop's life
        try:
            while not self.stopping.is_set():
                proc = subprocess.Popen(
                    self.argv(), env=self.env, stdout=out, stderr=subprocess.STDOUT
                )
                with self._lock:
                    self.procs[i] = proc
                self.log.emit("runner-start", runner=i, runner_pid=proc.pid)
                code = proc.wait()
                self.log.emit("runner-exit", runner=i, runner_pid=proc.pid, code=code)
                self.stopping.wait(rng.uniform(0.05, 0.3))
        finally:
            out.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loops; SIGTERM running runners (they stop their commands)."""
        self.stopping.set()
        with self._lock:
            procs = list(self.procs.values())
        stop_processes(procs, timeout)
        for t in self.threads:
            t.join(timeout)


@dataclass
class Command:
    """One command's life, read from the lane file (wall times)."""

    pid: int
    runner: int
    start: float
    last: float
    end: str | None  # "ok", "term", or None: it never wrote its end (killed)


def read_lane(path: Path) -> list[Command]:
    """The commands the lane file saw, by start time."""
    commands: dict[int, Command] = {}
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        parts = line.split()
        try:
            if parts[0] == "start" and len(parts) == 4:
                pid, runner, when = int(parts[1]), int(parts[2]), float(parts[3])
                commands[pid] = Command(pid, runner, when, when, None)
            elif parts[0] == "tick" and len(parts) == 3 and int(parts[1]) in commands:
                c = commands[int(parts[1])]
                c.last = max(c.last, float(parts[2]))
            elif parts[0] == "end" and len(parts) == 4 and int(parts[1]) in commands:
                c = commands[int(parts[1])]
                c.last, c.end = max(c.last, float(parts[3])), parts[2]
        except (IndexError, ValueError):
            continue  # a line cut short by a kill
    return sorted(commands.values(), key=lambda c: c.start)


def alive_commands(commands: list[Command]) -> list[int]:
    """Pids of lane commands still running (an orphan of a killed runner, say)."""
    alive = []
    for c in commands:
        try:
            cmdline = Path(f"/proc/{c.pid}/cmdline").read_bytes()
        except OSError:
            continue
        if MARK.encode() in cmdline:
            alive.append(c.pid)
    return alive


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(x) for x in text.split()]


def stop_processes(procs: list[subprocess.Popen[Any]], timeout: float = 10.0) -> None:
    """SIGTERM each process still running (SIGCONT first: it may be paused), then
    SIGKILL whatever has not ended when ``timeout`` runs out."""
    for p in procs:
        if p.poll() is None:
            kill_quietly(p.pid, signal.SIGCONT)
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process that may be gone already."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def process_age(pid: int) -> float:
    """Seconds since process ``pid`` started (Linux); infinity if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return float("inf")
    # Field 22 (starttime, in clock ticks since boot) counts from after the ")" that
    # ends the command name, which may itself hold spaces.
    fields = stat.rsplit(")", 1)[1].split()
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")

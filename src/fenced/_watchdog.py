"""The watchdog of ``fenced run``: the command never outlives its runner.

``fenced run`` starts its command in a process group of its own, so that stopping the
command stops what it started. The other side of that: when the runner dies without
stopping it (``kill -9``, the OOM killer), nothing else does, the lease runs out, and the
next cron run starts a second copy beside the first. And a *stopped* runner (``kill
-STOP``, Ctrl-Z) renews nothing, so its claim runs out while the command works on.

The watchdog is a small process the runner starts just before the command, in a session
of its own (a terminal's signals and a kill of the runner's process group miss it). It
holds the read end of a pipe whose write end only the runner has: the command does not
inherit it. Over the pipe the runner tells it the command's process group and, each
time the claim is renewed, the time by which it must have been renewed again
(``time.monotonic()`` is one clock for every process of a Linux or macOS system). The
watchdog ends the group (SIGTERM and SIGCONT, SIGKILL after the grace) when

- the pipe reaches end of file: the runner is gone, however it went; or
- the last time it was told passes with no later one: the runner is stopped or starved,
  or its heartbeat cannot renew the claim; or
- the runner asks it to, having seen the claim lost (one process sends the signals, so
  the command never gets a second SIGTERM from the same loss).

SIGCONT follows SIGTERM because a stopped process acts on SIGTERM only once continued.
When the runner says the command has ended, the watchdog exits; its exit status tells
the runner what it did. It imports nothing but the standard library and runs as a plain
script (``python -I -S``), so it starts in a few tens of milliseconds.

A second line for the command's direct child, on Linux: ``PR_SET_PDEATHSIG`` sends it
SIGTERM when the runner dies. It cannot be the only line (grandchildren are not
covered, and it cannot see a stopped runner), but it covers the moment between the
command's start and the watchdog learning its process group. When both act, the child
may get SIGTERM twice (commonly merged into one by the kernel); SIGKILL would have
denied it its grace.

The pipe, one ASCII line per message, runner to watchdog::

    g PGID      guard this process group
    d T         end the group at time.monotonic() == T, unless told a later T
    s           end the group now: the claim was lost
    x           the command has ended: exit (after finishing an ending under way)
    (EOF)       the runner is gone: end the group now
"""

from __future__ import annotations

import math
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = [
    "ENDED_AT_DEADLINE",
    "ENDED_RUNNER_GONE",
    "ENDED_WHEN_ASKED",
    "Watchdog",
    "dies_with_runner",
    "ending",
    "main",
    "signame",
]

#: Exit statuses of the watchdog: what it did.
IDLE = 0
USAGE = 2
ENDED_AT_DEADLINE = 3
ENDED_WHEN_ASKED = 4
ENDED_RUNNER_GONE = 5
#: How often an ending looks whether the group is gone, to exit before the grace ends.
LOOK_EVERY = 0.05
#: Watchdogs started in place of one that died, per run: a watchdog that cannot live is
#: not restarted forever.
MAX_RESTARTS = 3
#: A new deadline is sent only when it moved by more than this: the runner reads it off
#: two clock readings, which differ by microseconds from one look to the next.
RESEND_AFTER = 0.01
#: How long the runner waits for a watchdog with nothing to do to exit.
WAIT_IDLE = 5.0
PR_SET_PDEATHSIG = 1


# -- the runner's side ----------------------------------------------------------------------


class Watchdog:
    """The runner's handle on its watchdog: start it, tell it, take its report.

    Nothing here raises: a watchdog that cannot be started or told is reported through
    ``say`` once, and the run goes on as it would without one.
    """

    def __init__(self, name: str, grace: float, say: Callable[[str], None]) -> None:
        self.name = name
        self.grace = grace
        self.say = say
        self.proc: subprocess.Popen[bytes] | None = None
        self.pipe: int | None = None
        self.group: int | None = None
        self.deadline: float | None = None
        self.restarts = 0
        self.finished = False
        self.ending = False

    def start(self) -> bool:
        """Start the process; before the command, so that it holds its pipe from the start.

        False (said through ``say``) when it cannot be started.
        """
        read_end, write_end = os.pipe()  # neither is inherited, but for pass_fds below
        try:
            script = [__file__, str(read_end), repr(self.grace), self.name]
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", *script],
                pass_fds=(read_end,),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # a reader of our stdout must not wait for it
            )
        except OSError as exc:
            os.close(write_end)
            self.proc = None
            self.say(
                f"fenced: cannot start the watchdog of {self.name!r} ({exc}); the command "
                "is not stopped if fenced run dies"
            )
            return False
        finally:
            os.close(read_end)
        # The runner never waits on its watchdog: if the pipe is full, the watchdog is
        # not reading, and the message can be dropped.
        os.set_blocking(write_end, False)
        self.pipe = write_end
        return True

    def guard(self, group: int, deadline: float | None) -> None:
        """Watch the command's process group; end it at ``deadline`` unless told later."""
        self.group = group
        self.deadline = deadline
        self._tell(self._greeting())

    def _greeting(self) -> str:
        lines = f"g {self.group}\n" if self.group is not None else ""
        if self.deadline is not None:
            lines += f"d {self.deadline!r}\n"
        return lines

    def tend(self, deadline: float | None) -> None:
        """Pass on a later deadline; replace a watchdog that died. Called every poll."""
        if self.finished:
            return
        # Once the runner has asked for the ending, a replacement would only repeat it.
        if not self.ending and self.proc is not None and self.proc.poll() is not None:
            self._replace(f"exited {ending(self.proc.returncode, 'with status')}")
        if deadline is not None and (
            self.deadline is None or deadline > self.deadline + RESEND_AFTER
        ):
            self.deadline = deadline
            self._tell(f"d {deadline!r}\n")

    def _replace(self, why: str) -> None:
        self._close_pipe()
        self.proc = None
        if self.restarts >= MAX_RESTARTS:
            self.say(
                f"fenced: the watchdog of {self.name!r} {why}, {self.restarts} times; "
                "going on without one: the command is not stopped if fenced run dies"
            )
            self.finished = True
            return
        self.restarts += 1
        if self.start():
            self.say(f"fenced: the watchdog of {self.name!r} {why}; started another")
            self._tell(self._greeting())

    def end_now(self) -> bool:
        """Ask the watchdog to end the group now; False if it could not be told."""
        self.ending = True
        return self._tell("s\n")

    def finish(self, timeout: float) -> int | None:
        """The command has ended: tell the watchdog, and return its exit status.

        None when there was no watchdog, or it did not exit within ``timeout``.
        """
        if self.finished or self.proc is None:
            self.close()
            return None
        self._tell("x\n")
        self._close_pipe()
        self.finished = True
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        """Let go of the pipe. Unless ``finish`` was called, the watchdog ends the group."""
        self.finished = True
        self._close_pipe()
        if self.proc is None:
            return
        if self.group is None:
            # Nothing to end (the command did not start): it exits at once; reap it.
            try:
                self.proc.wait(timeout=WAIT_IDLE)
            except subprocess.TimeoutExpired:
                pass
        else:
            self.proc.poll()  # reaped if it has exited; else it ends the group, then exits

    def _tell(self, message: str) -> bool:
        if self.pipe is None or not message:
            return False
        try:
            os.write(self.pipe, message.encode())
        except BlockingIOError:
            # Alive, but 64 KiB behind: stopped for a long while. It acts on older
            # news (an earlier deadline, or the end of the pipe for "x"), which errs
            # towards ending the command.
            return True
        except OSError:
            return False  # gone: tend() replaces it
        return True

    def _close_pipe(self) -> None:
        if self.pipe is not None:
            os.close(self.pipe)
            self.pipe = None


def dies_with_runner(
    runner: int | None = None, tell: int | None = None
) -> Callable[[], None] | None:
    """A ``preexec_fn`` giving the command SIGTERM when its runner dies (Linux), or None.

    ``runner`` is the pid the command's parent must be (default: this process). A runner
    already gone when the child looks ends the child before the exec. Until the exec the
    child still has the runner's signal handlers, and Python's only notes a signal for
    later: the child sets SIGTERM's default action first (the exec would reset a caught
    signal to it anyway), so that the death signal, arriving between the two, ends it.

    ``tell`` is the write end of the watchdog's pipe: the child, the leader of its own
    process group, tells the watchdog that group itself before the exec, so a runner
    that dies before it could say it (a command that ignores SIGTERM outlives the
    death signal) still leaves a watchdog that knows what to end.

    Everything is looked up before the fork: the child of a process with threads must
    not load libraries or take locks between fork and exec.
    """
    greet = None if tell is None else _greeter(tell)
    if not sys.platform.startswith("linux"):
        return greet
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        prctl, set_action = libc.prctl, libc.signal
    except (ImportError, OSError, AttributeError):  # pragma: no cover - a libc without it
        return greet
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    set_action.argtypes = [ctypes.c_int, ctypes.c_void_p]
    set_action.restype = ctypes.c_void_p
    parent = os.getpid() if runner is None else runner
    term = int(signal.SIGTERM)
    # Only a caught SIGTERM is reset: one the runner inherited as ignored stays ignored
    # for the command, as the exec would leave it.
    caught = callable(signal.getsignal(signal.SIGTERM))

    def set_parent_death_signal() -> None:
        if caught:
            set_action(term, None)  # SIG_DFL
        prctl(PR_SET_PDEATHSIG, term, 0, 0, 0)
        if greet is not None:
            greet()
        if os.getppid() != parent:  # the runner died before the signal was set
            os._exit(128 + term)

    return set_parent_death_signal


def _greeter(pipe: int) -> Callable[[], None]:
    """The child's part of a ``preexec_fn``: ``g PID`` on the watchdog's pipe (the child
    leads its own group; the pipe's end is closed by the exec)."""

    def greet() -> None:
        try:
            os.write(pipe, b"g %d\n" % os.getpid())
        except OSError:  # a watchdog gone: the runner's own greeting is all there is
            pass

    return greet


def signame(signum: int) -> str:
    """``SIGTERM``, or ``signal N`` for a number that names no signal."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def ending(returncode: int | None, exited: str = "exit") -> str:
    """How a process ended: ``killed by SIGTERM``, or ``exit 3`` (``exited`` and its status)."""
    if returncode is not None and returncode < 0:
        return f"killed by {signame(-returncode)}"
    return f"{exited} {returncode}"


# -- the watchdog's side --------------------------------------------------------------------


class _Watch:
    """The watchdog process: reads the runner's pipe, ends the group when it must."""

    def __init__(self, pipe: int, grace: float, name: str) -> None:
        self.pipe = pipe
        self.grace = grace
        self.name = name
        self.group: int | None = None
        self.deadline: float | None = None
        self.ended = False  # the runner said the command has ended
        self.status = IDLE
        self.kill_at: float | None = None  # set while an ending is under way
        self.done = False  # the ending is complete: the group is gone, or was killed

    def run(self) -> int:
        buffer = b""
        # poll, not select: the pipe keeps the runner's descriptor number, which can be
        # above select's limit of 1024 in a process with many files open.
        poller = select.poll()
        poller.register(self.pipe, select.POLLIN)
        while True:
            if self.ended and (self.kill_at is None or self.done):
                return self.status
            timeout = self._timeout()
            if poller.poll(None if timeout is None else math.ceil(timeout * 1000)):
                chunk = os.read(self.pipe, 4096)
                if not chunk:
                    return self._runner_gone()
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    self._handle(line.decode("ascii", "replace").split())
            self._act(time.monotonic())

    def _timeout(self) -> float | None:
        if self.kill_at is not None:
            return None if self.done else LOOK_EVERY
        if self.group is not None and self.deadline is not None:
            return max(0.0, self.deadline - time.monotonic())
        return None

    def _handle(self, words: list[str]) -> None:
        match words:
            case ["g", group]:
                self.group = int(group)
            case ["d", deadline]:
                self.deadline = float(deadline)
            case ["s", *_]:
                self._end(ENDED_WHEN_ASKED)
            case ["x", *_]:
                self.ended = True

    def _act(self, now: float) -> None:
        if self.kill_at is None:
            if self.deadline is not None and now >= self.deadline and not self.ended:
                self._end(ENDED_AT_DEADLINE)
            return
        if self.done:
            return
        if not self._signal(0):
            self.done = True
        elif now >= self.kill_at:
            self._signal(signal.SIGKILL)
            self.done = True

    def _end(self, status: int) -> None:
        if self.kill_at is not None or self.group is None:
            return
        self.status = status
        self.kill_at = time.monotonic() + self.grace
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)

    def _runner_gone(self) -> int:
        # A group the command's child named before an exec that failed is no one's.
        guarding = self.group is not None and not self.ended and self.kill_at is None
        if guarding and self._signal(0):
            self._end(ENDED_RUNNER_GONE)
            _say(
                f"fenced: fenced run of {self.name!r} is gone and left its command "
                f"running; sent SIGTERM, SIGKILL after {self.grace:g}s"
            )
        while self.kill_at is not None and not self.done:
            self._act(time.monotonic())
            if not self.done:
                time.sleep(LOOK_EVERY)
        return self.status

    def _signal(self, signum: int) -> bool:
        """Send ``signum`` to the group (0: none); False when the group is gone."""
        assert self.group is not None
        try:
            os.killpg(self.group, signum)
        except (ProcessLookupError, PermissionError):  # gone, or the id is somebody else's
            return False
        return True


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass  # nobody reads our stderr any more: the group is ended all the same


def main(argv: list[str]) -> int:
    """The watchdog process: ``_watchdog.py PIPE_FD GRACE NAME``, started by fenced run."""
    try:
        pipe, grace, name = int(argv[0]), float(argv[1]), argv[2]
    except (IndexError, ValueError):
        _say("fenced watchdog: started by fenced run, not by hand")
        return USAGE
    return _Watch(pipe, grace, name).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run a command under a claim: a distributed ``flock`` for cron and shell scripts.

The command runs as a child process in its own process group while the claim is held
and renewed by the heartbeat. What can happen, and the exit status of each::

    claim taken, command runs       the command's own status (killed by signal N: 128+N)
    busy, on_busy="skip"            0 and one line naming the holder (cron: not an error)
    busy, on_busy="raise"           75  (EX_TEMPFAIL; "fail" is accepted as another name)
    busy, waited past wait_timeout  75
    claim lost while it ran         76  the group got SIGTERM, then SIGKILL after grace
    Redis unreachable               69  (EX_UNAVAILABLE), the command never started
    command not found / not exec.   127 / 126, as a shell reports them

Signals sent to the runner are forwarded: SIGTERM, SIGINT, SIGHUP and SIGQUIT to the
command's whole process group (what a terminal does, so a shell's children stop too),
SIGUSR1 and SIGUSR2 to the command alone (they mean "reopen logs" or "report" to one
program and would kill helpers that do not handle them). The claim is released when
the command ends, with the outcome ``ok``, ``failed``, ``lost`` or ``aborted``
recorded beside the command line.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ._claim import Claim
from ._errors import ClaimHeld, ClaimUnavailable, ConfigError
from ._guard import Guard, Skipped, check_on_busy

__all__ = [
    "EXIT_BUSY",
    "EXIT_LOST",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "ON_BUSY",
    "ON_BUSY_ALIASES",
    "RunOptions",
    "run_command",
]

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 69  # sysexits.h EX_UNAVAILABLE
EXIT_BUSY = 75  # sysexits.h EX_TEMPFAIL: "try again later" is what a busy claim means
EXIT_LOST = 76
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

#: The busy policies a command can carry out (see fenced._guard); "fail" is "raise".
ON_BUSY = ("skip", "wait", "raise")
ON_BUSY_ALIASES = {"fail": "raise"}
TO_GROUP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
TO_CHILD = (signal.SIGUSR1, signal.SIGUSR2)
#: How often the runner looks at the child and the claim while the command runs.
POLL = 0.1


@dataclass
class RunOptions:
    """What ``fenced run`` was asked to do."""

    name: str
    argv: Sequence[str]
    ttl: float = 30.0
    namespace: str = "fenced"
    on_busy: str = "skip"
    wait_timeout: float | None = None
    grace: float = 10.0
    quiet: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        """Raise ConfigError for options that cannot work together."""
        if not self.argv:
            raise ConfigError("no command given: put it after '--', e.g. fenced run NAME -- CMD")
        self.on_busy = check_on_busy(
            self.on_busy, ON_BUSY, option="--on-busy", aliases=ON_BUSY_ALIASES
        )
        if self.wait_timeout is not None:
            if self.on_busy != "wait":
                raise ConfigError(
                    "a wait timeout only applies when waiting: add --on-busy wait",
                    name=self.name,
                )
            if self.wait_timeout < 0:
                raise ConfigError(f"wait timeout {self.wait_timeout} must be >= 0")
        if self.grace < 0:
            raise ConfigError(f"grace {self.grace} must be >= 0 seconds")


class _Interrupted(Exception):
    """A forwarded-to-nobody signal arrived before the command started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _status(returncode: int) -> int:
    """Shell convention: a child killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class _Runner:
    def __init__(
        self, client: Any, opts: RunOptions, say: Callable[[str], None], clock: Callable[[], float]
    ) -> None:
        self.opts = opts
        self.say = say
        self.clock = clock
        self.lost = threading.Event()
        self.proc: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []
        self.claim = Claim(
            client,
            opts.name,
            ttl=opts.ttl,
            namespace=opts.namespace,
            on_lost=lambda _claim: self.lost.set(),
            records=True,
            record_extra={"command": shlex.join(opts.argv), **opts.extra},
            sleep=self._sleep,
        )

    # -- signals ----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.proc is None or self.proc.returncode is not None:
            self.pending.append(signum)
            return
        self._send(signum, group=signum not in TO_CHILD)

    def _send(self, signum: int, group: bool) -> None:
        proc = self.proc
        # Only while the child is not yet reaped: its pid, and so its group id, cannot
        # have been reused by then.
        if proc is None or proc.returncode is not None:
            return
        try:
            if group:
                os.killpg(proc.pid, signum)
            else:
                proc.send_signal(signum)
        except ProcessLookupError:
            pass

    def _sleep(self, seconds: float) -> None:
        # The claim's wait loop sleeps here: a signal ends the wait before any start.
        if self.pending:
            raise _Interrupted(self.pending[0])
        time.sleep(seconds)
        if self.pending:
            raise _Interrupted(self.pending[0])

    # -- the run ----------------------------------------------------------------------

    def run(self) -> int:
        opts = self.opts
        guard = Guard(self.claim, opts.on_busy, opts.wait_timeout)
        try:
            skipped = guard.enter()
        except _Interrupted as stop:
            self.say(f"fenced: {_signame(stop.signum)} while waiting for {opts.name!r}; not run")
            return 128 + stop.signum
        except ClaimUnavailable as exc:
            self.say(f"fenced: {exc}")
            return EXIT_UNAVAILABLE
        except ClaimHeld as busy:
            self.say(
                f"fenced: gave up waiting: {busy}" if opts.on_busy == "wait" else f"fenced: {busy}"
            )
            return EXIT_BUSY
        if skipped is not None:
            return self._skipped(skipped)
        outcome, reason, code = "failed", None, 1
        try:
            outcome, reason, code = self._run_child()
        finally:
            self.claim.release(outcome=outcome, reason=reason)
        return code

    def _skipped(self, skipped: Skipped) -> int:
        if not self.opts.quiet:
            self.say(f"fenced: {skipped}")
        return 0

    def _run_child(self) -> tuple[str, str | None, int]:
        opts = self.opts
        if self.pending:
            signum = self.pending[0]
            self.say(f"fenced: {_signame(signum)} before {opts.name!r} started; not run")
            return "aborted", f"{_signame(signum)} before the command started", 128 + signum
        try:
            self.proc = subprocess.Popen(list(opts.argv), **_own_group())
        except FileNotFoundError as exc:
            self.say(f"fenced: cannot run {opts.argv[0]!r}: {exc.strerror}")
            return "failed", f"command not found: {opts.argv[0]}", EXIT_NOT_FOUND
        except OSError as exc:
            # Permission denied, no "#!" line (ENOEXEC), a directory...: the command's
            # fault, and not an unreachable Redis, which an OSError escaping would mean.
            self.say(f"fenced: cannot run {opts.argv[0]!r}: {exc.strerror or exc}")
            return "failed", f"command not executable: {opts.argv[0]}", EXIT_NOT_EXECUTABLE
        # Signals that came while the child was being started belong to it.
        for signum in self.pending:
            self._send(signum, group=signum not in TO_CHILD)
        self.pending.clear()
        returncode = self._wait(stop_on_loss=True)
        if returncode is None:
            return self._stop_lost()
        if self.lost.is_set() or self.claim.lost:
            # It ended, but the claim had already gone: its work was not protected.
            self.say(f"fenced: claim {opts.name!r} was lost before the command ended")
            return "lost", self._lost_reason(returncode), EXIT_LOST
        status = _status(returncode)
        if returncode == 0:
            return "ok", None, 0
        if returncode < 0:
            return "failed", f"killed by {_signame(-returncode)}", status
        return "failed", f"exit status {returncode}", status

    def _wait(self, stop_on_loss: bool, until: float | None = None) -> int | None:
        """The child's return code; None when the claim was lost or ``until`` passed."""
        assert self.proc is not None
        while True:
            try:
                return self.proc.wait(timeout=POLL)
            except subprocess.TimeoutExpired:
                pass
            if stop_on_loss and (self.lost.is_set() or self.claim.lost):
                return None
            if until is not None and self.clock() >= until:
                return None

    def _stop_lost(self) -> tuple[str, str | None, int]:
        opts = self.opts
        why = self.claim.lost_reason or "the lease is gone"
        self.say(
            f"fenced: claim {opts.name!r} lost while the command ran ({why}); "
            f"sending SIGTERM, SIGKILL after {opts.grace:g}s"
        )
        self._send(signal.SIGTERM, group=True)
        returncode = self._wait(stop_on_loss=False, until=self.clock() + opts.grace)
        if returncode is None:
            self._send(signal.SIGKILL, group=True)
            assert self.proc is not None
            returncode = self.proc.wait()
        return "lost", self._lost_reason(returncode), EXIT_LOST

    def _lost_reason(self, returncode: int) -> str:
        why = self.claim.lost_reason or "the lease is gone"
        end = f"killed by {_signame(-returncode)}" if returncode < 0 else f"exit {returncode}"
        return f"{why}; command {end}"


def _own_group() -> dict[str, Any]:
    # Its own process group, so that stopping the command also stops what it started,
    # and a terminal's Ctrl-C reaches it once (through the runner), not twice.
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}  # pragma: no cover - Python 3.10


def run_command(
    client: Any,
    opts: RunOptions,
    *,
    say: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run ``opts.argv`` under the claim ``opts.name``; return the exit status to use."""
    opts.check()
    if say is None:
        say = _stderr
    runner = _Runner(client, opts, say, clock)
    in_main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if in_main:
        for sig in (*TO_GROUP, *TO_CHILD):
            previous[sig] = signal.signal(sig, runner._on_signal)
    try:
        return runner.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

"""Run a command under a claim: a distributed ``flock`` for cron and shell scripts.

The command runs as a child in its own process group while the heartbeat renews the
claim. What can happen, and the exit status of each::

    claim taken, command runs       the command's own status (killed by signal N: 128+N)
    busy, on_busy="skip"            0 and one line naming the holder (cron: not an error)
    busy, on_busy="raise"           75  (EX_TEMPFAIL; "fail" is accepted as another name)
    busy, waited past wait_timeout  75
    ran recently (--cooldown)       as busy (0 or 75); a window is never waited out
    claim lost while it ran         76  the group got SIGTERM, then SIGKILL after grace
    Redis unreachable               69  (EX_UNAVAILABLE), the command never started
    command not found / not exec.   127 / 126, as a shell reports them

SIGTERM, SIGINT, SIGHUP and SIGQUIT are forwarded to the command's group (as a terminal
does), SIGUSR1 and SIGUSR2 to the command alone (they would kill helpers that do not
handle them). The run is recorded as ``ok``, ``failed``, ``lost`` or ``aborted`` with
the program and a digest of the command line (the line itself only with
``record_command``: arguments may hold passwords). The command's environment lacks
fenced's own settings (:data:`FENCED_ENV`) unless ``pass_fenced_env``.

A watchdog process (:mod:`fenced._watchdog`), told of each renewal, ends the command's
group when the runner dies however it dies, or is stopped or starved until its claim
runs out. SIGTSTP (Ctrl-Z) stops the group, then the runner, as a terminal user
expects; resumed within the lease the run goes on, after it the run reports the loss
(76). Ignoring SIGTSTP would leave a job that will not stop; stopping only the runner
would leave the command working on a claim nobody renews.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from ._claim import Claim
from ._errors import ClaimUnavailable, ConfigError
from ._guard import BusyPolicy, Run, Skip, accepted, busy_policy, check_replace
from ._lease import IDLE_TTL
from ._naming import SECRET_KEY_ENV, check_secret_key, hash_value, secret_digest
from ._options import DEFAULT, ClaimOptions, refuse_unknown
from ._watchdog import ENDED_AT_DEADLINE, Watchdog, dies_with_runner, ending, signame

__all__ = [
    "EXIT_BUSY",
    "EXIT_LOST",
    "EXIT_NOT_EXECUTABLE",
    "EXIT_NOT_FOUND",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "FENCED_ENV",
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
#: The shortest lease ``fenced run`` takes, in seconds (renewals come every ttl/3).
MIN_TTL = 0.05

#: The busy policies a command refuses (see fenced._guard): it has no queue to retry
#: from. "fail" is another name for "raise".
REFUSES = ("retry", "rerun")
#: The claim's options ``fenced run`` takes as flags (``--ttl``, ``--replica-timeout``...).
RUN_CLAIM_OPTIONS = (
    "ttl",
    "refresh_every",
    "namespace",
    "replicas",
    "replica_timeout",
    "cooldown",
    "limit",
    "rate",
    "rate_spread",
    "label",
    "max_records",
)
ON_BUSY = accepted(REFUSES)
ON_BUSY_ALIASES = {"fail": "raise"}
TO_GROUP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
TO_CHILD = (signal.SIGUSR1, signal.SIGUSR2)
#: fenced's own settings, kept from the command's environment unless passed on purpose.
FENCED_ENV = ("FENCED_REDIS_URL", "FENCED_REDIS_CLIENT", SECRET_KEY_ENV)
#: How often the runner looks at the child and the claim while the command runs.
POLL = 0.1
#: The watchdog ends the command this much before the claim's local deadline (at most;
#: a tenth of the ttl for short ones): time for the signal to take effect before another
#: holder can start, on a machine too busy to run the watchdog the moment it is due.
WATCH_MARGIN = 0.1
#: How long a finished run waits for its watchdog to report (beyond the grace of an
#: ending under way).
WATCH_REPORT = 5.0
#: Stopping the command on SIGTSTP: a process group in a session of its own (Python
#: 3.10) is orphaned, and the kernel discards SIGTSTP sent to it.
STOP_SIGNAL = signal.SIGTSTP if sys.version_info >= (3, 11) else signal.SIGSTOP
#: The command's own process group, so that stopping it also stops what it started, and
#: a terminal's Ctrl-C reaches it once (through the runner), not twice.
OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
)


@dataclass
class RunOptions:
    """What ``fenced run`` was asked to do."""

    name: str
    argv: Sequence[str]
    #: The claim's options given (RUN_CLAIM_OPTIONS, by name); :meth:`check` makes
    #: :attr:`options` of them.
    claim: Mapping[str, Any] = field(default_factory=dict)
    on_busy: str = "skip"
    wait_timeout: float | None = None
    grace: float = 10.0
    quiet: bool = False
    #: Record the whole command line, not only the program and the line's digest.
    record_command: bool = False
    #: Give the command fenced's own settings (FENCED_ENV) from this environment.
    pass_fenced_env: bool = False
    #: The claim's options, checked.
    options: ClaimOptions = field(init=False, repr=False, default=DEFAULT)

    @property
    def policy(self) -> BusyPolicy:
        """The busy policy ``on_busy`` names (a ConfigError if a command cannot have it)."""
        return busy_policy(
            self.on_busy,
            REFUSES,
            option="--on-busy",
            aliases=ON_BUSY_ALIASES,
            wait_timeout=self.wait_timeout,
        )

    def check(self) -> None:
        """Raise ConfigError for options that cannot work together."""
        if not self.argv:
            raise ConfigError("no command given: put it after '--', e.g. fenced run NAME -- CMD")
        refuse_unknown(self.claim, RUN_CLAIM_OPTIONS, "fenced run", "option")
        self.on_busy = self.policy.name
        if self.wait_timeout is not None:
            if not self.policy.blocks:
                raise ConfigError(
                    "a wait timeout only applies when waiting: add --on-busy wait",
                    name=self.name,
                )
            if self.wait_timeout < 0:
                raise ConfigError(f"wait timeout {self.wait_timeout} must be >= 0")
        if self.grace < 0:
            raise ConfigError(f"grace {self.grace} must be >= 0 seconds")
        ttl = self.claim.get("ttl", DEFAULT.ttl)
        # No option for it here: a long lease keeps its name's keys twice as long.
        idle = max(IDLE_TTL, 2 * ttl) if isinstance(ttl, (int, float)) else IDLE_TTL
        base = DEFAULT.replace(records=True, idle_ttl=idle)
        self.options = ClaimOptions.of(self.claim, base=base, prefix="--")
        if self.options.ttl < MIN_TTL:
            # The watchdog must hear of renewals well inside the lease.
            raise ConfigError(
                f"--ttl {self.options.ttl!r} must be at least {MIN_TTL}s, e.g. --ttl 30 or "
                "--ttl 10m"
            )
        check_replace(self.policy, self.options.limit, option="--on-busy", rate=self.options.rate)


class _Interrupted(Exception):
    """A forwarded-to-nobody signal arrived before the command started (its number)."""


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
        self.watch = Watchdog(opts.name, opts.grace, say)
        self.stop_asked = False
        #: Popen of the command has not returned: its child may already run.
        self.starting = False
        self.looked = time.monotonic()
        self.stalled = 0.0
        # Short leases are looked at more often: the watchdog must hear of a renewal
        # well before the margin ahead of the old deadline.
        ttl = opts.options.ttl
        self.poll = min(POLL, ttl / 10)
        self.margin = min(WATCH_MARGIN, ttl / 10)
        #: What happened, for ``fenced run --json``: filled in as the run goes.
        self.result: dict[str, Any] = {
            "name": opts.name,
            "ran": False,
            **dict.fromkeys(("outcome", "reason", "exit", "fence", "holder")),
            "label": opts.options.label or opts.name,
        }
        self.claim = Claim(
            client,
            opts.name,
            options=opts.options,
            on_lost=lambda _claim: self.lost.set(),
            record_extra=command_record(opts.argv, opts.record_command),
            sleep=self._sleep,
        )
        self.claim._front_end("run")

    # -- signals ----------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.proc is None or self.proc.returncode is not None:
            self.pending.append(signum)
            return
        self._send(signum, group=signum not in TO_CHILD)

    def _on_stop(self, _signum: int, _frame: FrameType | None) -> None:
        if not self.starting and (self.proc is None or self.proc.returncode is not None):
            # Nothing runs under the claim: stop at once, as without a handler.
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        # The poll loop stops the group, then the runner: a handler that prints could
        # interrupt the main thread's own printing. A command being started may be forked
        # already: it is stopped too, once Popen returns.
        self.stop_asked = True

    def _stop(self) -> None:
        """SIGTSTP while the command runs: stop its group, then the runner; continue both."""
        self.stop_asked = False
        self._send(STOP_SIGNAL, group=True)
        left = self.claim.expires_in
        self.say(
            f"fenced: stopped; claim {self.opts.name!r} is not renewed while fenced run is "
            f"stopped: if it is not continued within {left:.0f}s, the claim runs out and "
            "the command is ended"
        )
        os.kill(os.getpid(), signal.SIGSTOP)
        # Continued (fg, bg, SIGCONT): so is the command, if the watchdog left it.
        self._send(signal.SIGCONT, group=True)

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

    def _busy(self, outcome: str, reason: str) -> None:
        holder = self.claim.holder
        self.result.update(
            outcome=outcome, reason=reason, holder=holder.as_dict() if holder else None
        )

    def run(self) -> int:
        opts = self.opts
        try:
            action = self.claim.enter(opts.policy)
        except _Interrupted as stop:
            signum: int = stop.args[0]
            self.say(f"fenced: {signame(signum)} while waiting for {opts.name!r}; not run")
            self.result.update(outcome="aborted", reason=f"{signame(signum)} while waiting")
            return 128 + signum
        except ClaimUnavailable as exc:
            self.say(f"fenced: {exc}")
            self.result.update(outcome="unavailable", reason=str(exc))
            return EXIT_UNAVAILABLE
        if isinstance(action, Skip):
            self._busy("skipped", action.reason)
            if not opts.quiet:
                self.say(f"fenced: {action.skipped}")
            return 0
        if not isinstance(action, Run):  # raise, a wait that gave up (a command never retries)
            waited = "gave up waiting: " if opts.policy.blocks else ""
            self.say(f"fenced: {waited}{action.error}")
            self._busy("busy", getattr(action, "reason", "already running"))
            return EXIT_BUSY
        self.result["fence"] = self.claim.fence
        outcome, reason, code = "failed", None, 1
        try:
            outcome, reason, code = self._run_child()
        finally:
            ended = self.claim.end(
                None, "the command", outcome=outcome, reason=reason, raise_lost=False
            )
            self.result.update(outcome=outcome, reason=reason)
        if ended != outcome:
            # It ended well, but the lease was gone (or unconfirmed) at the end: the
            # command may have run beside another.
            self.say(
                f"fenced: claim {opts.name!r} was not held when the command ended "
                f"({self.claim.lost_reason})"
            )
            self.result.update(outcome="lost", reason=self.claim.lost_reason)
            return EXIT_LOST
        return code

    def _run_child(self) -> tuple[str, str | None, int]:
        opts = self.opts
        if self.pending:
            signum = self.pending[0]
            self.say(f"fenced: {signame(signum)} before {opts.name!r} started; not run")
            return "aborted", f"{signame(signum)} before the command started", 128 + signum
        # Before the command: from the moment it runs, the watchdog holds its pipe.
        self.watch.start()
        try:
            return self._run_watched()
        finally:
            # Normally finished already; if not (an exception), the watchdog sees the
            # pipe close and ends the command: its claim is being released.
            self.watch.close()

    def _run_watched(self) -> tuple[str, str | None, int]:
        opts = self.opts
        self.starting = True
        try:
            self.proc = subprocess.Popen(
                list(opts.argv),
                preexec_fn=dies_with_runner(tell=self.watch.pipe),
                env=None if opts.pass_fenced_env else child_env(),
                **OWN_GROUP,
            )
        except FileNotFoundError as exc:
            self.say(f"fenced: cannot run {opts.argv[0]!r}: {exc.strerror}")
            return "failed", f"command not found: {opts.argv[0]}", EXIT_NOT_FOUND
        except OSError as exc:
            # Permission denied, no "#!" line (ENOEXEC), a directory...: the command's
            # fault, and not an unreachable Redis, which an OSError escaping would mean.
            self.say(f"fenced: cannot run {opts.argv[0]!r}: {exc.strerror or exc}")
            return "failed", f"command not executable: {opts.argv[0]}", EXIT_NOT_EXECUTABLE
        finally:
            self.starting = False
            if self.proc is None and self.stop_asked:
                # Ctrl-Z while a command that never started was being started.
                self.stop_asked = False
                os.kill(os.getpid(), signal.SIGSTOP)
        self.result["ran"] = True
        self.watch.guard(self.proc.pid, self._watch_deadline())
        self.looked = time.monotonic()
        # Signals that came while the child was being started belong to it.
        for signum in self.pending:
            self._send(signum, group=signum not in TO_CHILD)
        self.pending.clear()
        returncode = self._wait(stop_on_loss=True)
        if returncode is None:
            return self._stop_lost()
        if self.watch.finish(timeout=opts.grace + WATCH_REPORT) == ENDED_AT_DEADLINE:
            # No renewal reached the watchdog before the lease's end.
            if self.stalled > 3 * self.poll:
                why = "fenced run was stopped (or starved) until its lease ran out"
            else:
                why = self.claim.lost_reason or "no renewal was confirmed before the lease's end"
            self.say(
                f"fenced: claim {opts.name!r} lost: {why}; the watchdog ended the command "
                f"({ending(returncode)})"
            )
            return self._lost(returncode, why)
        if self.lost.is_set() or self.claim.lost:
            # It ended, but the claim had already gone: its work was not protected.
            self.say(f"fenced: claim {opts.name!r} was lost before the command ended")
            return self._lost(returncode)
        if returncode == 0:
            return "ok", None, 0
        status = 128 - returncode if returncode < 0 else returncode  # killed by N: 128+N
        return "failed", ending(returncode, "exit status"), status

    def _wait(self, stop_on_loss: bool, until: float | None = None) -> int | None:
        """The child's return code; None when the claim was lost or ``until`` passed."""
        assert self.proc is not None
        while True:
            try:
                returncode: int | None = self.proc.wait(timeout=self.poll)
            except subprocess.TimeoutExpired:
                returncode = None
            # The longest the runner went without looking: it was stopped, or starved.
            now = time.monotonic()
            self.stalled = max(self.stalled, now - self.looked)
            self.looked = now
            if returncode is not None:
                return returncode
            if self.stop_asked:
                self._stop()
            self.watch.tend(self._watch_deadline())
            if stop_on_loss and (self.lost.is_set() or self.claim.lost):
                return None
            if until is not None and self.clock() >= until:
                return None

    def _watch_deadline(self) -> float | None:
        """When the watchdog is to end the command unless told later: None once lost."""
        left = self.claim.expires_in
        if left <= 0:
            return None
        # The watchdog reads time.monotonic(), whatever clock the runner was given.
        return time.monotonic() + left - self.margin

    def _stop_lost(self) -> tuple[str, str | None, int]:
        opts = self.opts
        why = self.claim.lost_reason or "the lease is gone"
        self.say(
            f"fenced: claim {opts.name!r} lost while the command ran ({why}); "
            f"sending SIGTERM, SIGKILL after {opts.grace:g}s"
        )
        # One process sends the signals (the watchdog may have begun already, at the
        # deadline); the runner only when the watchdog cannot be told.
        if not self.watch.end_now():
            self._send(signal.SIGTERM, group=True)
            self._send(signal.SIGCONT, group=True)  # a stopped command acts on it
        returncode = self._wait(stop_on_loss=False, until=self.clock() + opts.grace)
        if returncode is None:
            self._send(signal.SIGKILL, group=True)
            assert self.proc is not None
            returncode = self.proc.wait()
        # What the command started may still be ending: the watchdog sees to it.
        self.watch.finish(timeout=opts.grace + WATCH_REPORT)
        return self._lost(returncode)

    def _lost(self, returncode: int, why: str | None = None) -> tuple[str, str | None, int]:
        why = why or self.claim.lost_reason or "the lease is gone"
        return "lost", f"{why}; command {ending(returncode)}", EXIT_LOST


def command_record(argv: Sequence[str], whole: bool = False) -> dict[str, str]:
    """What a run record keeps of a command: the program and the line's digest.

    The digest tells two runs' command lines apart without showing them: keyed
    (``k1-``) when ``FENCED_SECRET_KEY`` is set, else unkeyed (``h1-``), which lets
    whoever guesses the whole line confirm the guess. ``whole`` keeps the line itself
    instead, as ``command``.
    """
    line = shlex.join(argv)
    if whole:
        return {"command": line}
    key = os.environ.get(SECRET_KEY_ENV)
    digest = (
        secret_digest(line, check_secret_key(key, setting=SECRET_KEY_ENV))
        if key
        else hash_value(line)
    )
    return {"program": argv[0], "command_digest": digest}


def child_env() -> dict[str, str]:
    """This process's environment without fenced's own settings (:data:`FENCED_ENV`)."""
    return {k: v for k, v in os.environ.items() if k not in FENCED_ENV}


def run_command(
    client: Any,
    opts: RunOptions,
    *,
    say: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Run ``opts.argv`` under the claim ``opts.name``; return the exit status to use.

    ``on_result`` receives what happened, once it is over: ``name``, ``ran`` (the
    command was started), ``outcome`` (``ok``, ``failed``, ``lost``, ``aborted``,
    ``skipped``, ``busy`` or ``unavailable``), ``reason``, ``exit``, ``fence``,
    ``holder`` (the other holder, when busy) and ``label`` (the claim's label).
    """
    opts.check()
    runner = _Runner(client, opts, say or _stderr, clock)
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (*TO_GROUP, *TO_CHILD, signal.SIGTSTP):
            handler = runner._on_stop if sig == signal.SIGTSTP else runner._on_signal
            previous[sig] = signal.signal(sig, handler)
    try:
        code = runner.result["exit"] = runner.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if on_result is not None:
        on_result(runner.result)
    return code


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

"""Stopping work whose claim was lost, when the work never checks.

Work that calls ``claim.check()`` or iterates ``claim.steps()`` stops itself. Work that
does not (a long library call, a sleep) is stopped from outside, by the heartbeat's
``on_lost`` callback:

- in a **main thread** (Celery's prefork and solo pools, a script) a signal
  (``SIGUSR2``) is sent to it, whose handler raises :class:`ClaimInterrupted`; a signal
  also wakes a thread that sleeps or waits in C;
- in **another thread** (the threads pool) ``ClaimInterrupted`` is raised
  asynchronously, at the thread's next bytecode.

Under gevent or eventlet there is no interrupt (an asynchronous exception could land
in another task); checks still raise. ::

    interrupter = Interrupter()
    claim = Claim(client, name, on_lost=interrupter.on_lost)
    if claim.acquire():
        with interrupter:
            work()            # ClaimInterrupted here once the claim is lost
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import threading
from types import FrameType
from typing import TYPE_CHECKING, Any

from ._errors import ClaimInterrupted
from ._lease import current_pid

if TYPE_CHECKING:
    from ._claim import Claim

__all__ = ["INTERRUPT_SIGNAL", "Interrupter", "available"]

log = logging.getLogger("fenced")

#: The signal that wakes work in a main thread when its claim is lost.
INTERRUPT_SIGNAL = getattr(signal, "SIGUSR2", None)

# Interrupters running in a main thread, innermost last: the signal handler looks here.
_main_runs: list[Interrupter] = []
_handler_pid: int | None = None
_previous_handler: Any = None


def available() -> bool:
    """False when gevent or eventlet replaced threads: an interrupt could hit other work."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return False
    eventlet = sys.modules.get("eventlet.patcher")
    return not (eventlet is not None and eventlet.is_monkey_patched("thread"))


class Interrupter:
    """Interrupts the work of one thread, between ``with`` and its end, once its claim is lost."""

    __slots__ = ("active", "lock", "main", "raised", "sent", "thread")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.main = self.thread == threading.main_thread().ident
        self.lock = threading.Lock()
        self.active = False
        self.sent = False
        self.raised = False

    def on_lost(self, claim: Claim) -> None:
        """The claim's ``on_lost``: interrupt the work if it is running."""
        if threading.get_ident() == self.thread:
            return  # the work's own thread noticed: check() raises there
        with self.lock:
            if not self.active or self.sent:
                return
            self.sent = True
            log.warning(
                "fenced: claim %r lost while its work ran (%s); interrupting it",
                claim.name,
                claim.lost_reason,
                extra=claim.log_fields("lost", "lost"),
            )
            if self.main and INTERRUPT_SIGNAL is not None:
                # A signal also wakes a main thread that sleeps or waits in C.
                signal.pthread_kill(self.thread, INTERRUPT_SIGNAL)
            else:
                _async_raise(self.thread, ClaimInterrupted)

    def __enter__(self) -> Interrupter:
        # (the handler's pid read here first: installed once per process)
        if self.main and _handler_pid != current_pid() and not _install_signal_handler():
            self.main = False  # fall back to an asynchronous exception
        if self.main:
            _main_runs.append(self)  # before active: the signal handler looks here
        self.active = True
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self.lock:
            if self.active:
                self.active = False
                if self.sent and not self.main:
                    _async_raise(self.thread, None)  # withdraw it if not yet delivered
        if self.main:
            try:
                _main_runs.remove(self)
            except ValueError:  # not there (never entered)
                pass


def _async_raise(thread: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in another thread at its next bytecode (None cancels a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread), ctypes.py_object(exc) if exc is not None else None
    )


def _on_interrupt_signal(signum: int, frame: FrameType | None) -> None:
    for run in reversed(_main_runs):
        if run.active and run.sent and not run.raised:
            run.raised = True
            raise ClaimInterrupted()
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)


def _install_signal_handler() -> bool:
    """Install the interrupt handler once per process; only a main thread can."""
    global _handler_pid, _previous_handler
    if INTERRUPT_SIGNAL is None:
        return False
    if _handler_pid == current_pid():  # kept current across fork, without a system call
        return True
    try:
        previous = signal.signal(INTERRUPT_SIGNAL, _on_interrupt_signal)
    except ValueError:  # not the main thread of the main interpreter
        return False
    if previous is not _on_interrupt_signal:
        _previous_handler = previous
    _handler_pid = current_pid()
    return True

"""Waiting in tests: poll a condition until it holds, with a deadline and a message."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Generous: the machine is shared and busy; a test that waits this long has failed.
WAIT = 60.0


def wait_for(
    what: str,
    check: Callable[[], T | None],
    timeout: float = WAIT,
    every: float = 0.02,
    *,
    proc: subprocess.Popen[Any] | None = None,
) -> T:
    """Poll ``check`` until it returns something truthy, and return that; fail naming ``what``.

    With ``proc``, fail as soon as that process exits without the condition holding
    (with its output), and kill it on timeout.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = check()  # it may have made the condition true on its way out
            if value:
                return value
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {what}: {out} {err}")
        if time.monotonic() > deadline:
            if proc is not None:
                proc.kill()
                proc.wait()
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)

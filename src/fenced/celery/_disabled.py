"""fenced switched off, for test suites that run tasks eagerly with no Redis at all.

``app.conf.fenced_enabled = False`` (or ``FENCED_ENABLED=0`` in the environment, when
the setting is not given) makes every :class:`~fenced.celery.ClaimedTask` run its body
under a :class:`LocalClaim`: ``self.claim`` works as in production (``check()`` and
``steps()`` pass, a fence is issued, ``held`` is true), but nothing is exclusive and no
Redis connection is made. Never the default; ``fenced doctor --app`` warns about an app
that has it off (``celery.fenced-disabled``), and so does a worker when it starts.

A worker started with claims on pings their Redis once instead (when the app has a
claimed task), and warns when it does not answer: its tasks would not start.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery import signals as celery_signals

from .._claim import Claim
from .._errors import ConfigError
from .._held import HELD, RELEASED
from ._options import PerApp, ping_claims, switch

__all__ = ["SETTING", "LocalClaim", "enabled"]

log = logging.getLogger("fenced.celery")

#: The Celery setting; ``FENCED_ENABLED`` is read when it is not given.
SETTING = "fenced_enabled"


# Each app's answer, read again when its settings change: every run asks.
_answers = PerApp((SETTING,))


def enabled(app: Any) -> bool:
    """Whether claimed tasks of ``app`` take real claims (True unless switched off)."""
    return bool(_answers(app, _enabled))


def _enabled(app: Any) -> bool:
    return switch(
        app,
        SETTING,
        "FENCED_ENABLED",
        True,
        "0 (claims off, for tests without Redis) or 1 (the default)",
        " (False: claims off, for tests without Redis)",
    )


_fence_lock = threading.Lock()
_last_fence = 0


def _next_fence() -> int:
    """A fence above every one issued before in this process (µs since the epoch, or +1)."""
    global _last_fence
    with _fence_lock:
        _last_fence = max(_last_fence + 1, time.time_ns() // 1000)
        return _last_fence


class LocalClaim(Claim):
    """A claim that talks to no Redis: always granted, never lost, renewals do nothing.

    What ``self.claim`` is in a task run with fenced switched off. Each acquire issues
    a fence from a local increasing counter.
    """

    def __init__(self, name: str, **options: Any) -> None:
        super().__init__(None, name, heartbeat=False, **options)

    def _connect(self, redis: Any) -> Any:
        return None

    def _bind_store(self) -> None:
        pass

    def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        *,
        request_rerun: bool | str = False,
    ) -> bool:
        """Take the claim: always granted, with a new local fence."""
        self._check_acquire(timeout)
        with self._mutex:
            self.token = f"local:{self.task_id or ''}"
            self.fence = _next_fence()
            self._state = HELD
            self._started_at = self._clock()
            self._deadline = float("inf")
        return True

    take_over = acquire  # nothing was kept: a new local claim

    def refresh(self) -> bool:
        """Nothing to renew: True while held."""
        return self.held

    def release(self, outcome: str | None = None, reason: str | None = None) -> bool:
        """Give the claim back (nothing is sent anywhere)."""
        with self._mutex:
            was_held, self._state = self._state == HELD, RELEASED
        return was_held

    def hand_over(self, keep_for: float, reason: str | None = None) -> str:
        """Nothing is kept: the retry takes a new local claim."""
        self.release()
        return ""

    def finished_ok(self) -> bool:
        """Nothing is remembered."""
        return False


#: How long a worker's start waits for the claims' Redis to answer its PING (seconds;
#: a URL's client waits this long to connect, and as long for the answer); a PING still
#: unanswered then goes on beside the worker and warns when it fails.
READY_PING_TIMEOUT = 1.0


@celery_signals.worker_ready.connect(weak=False)
def _warn_when_disabled(sender: Any = None, **_: Any) -> None:
    """A worker started with fenced switched off says so, loudly, once; switched on, it
    pings its claims' Redis once and warns when that does not answer."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        on = enabled(app)
    except ConfigError as exc:
        log.error("fenced: %s", exc)
        return
    if not on:
        log.warning(
            "fenced: claims are switched off for this worker (%s=False or FENCED_ENABLED=0): "
            "claimed tasks run with a local stand-in claim, with no exclusion at all. "
            "This setting is for test suites without Redis; remove it in production",
            SETTING,
        )
        return
    from ._task import ClaimedTask  # it imports this module

    if any(isinstance(task, ClaimedTask) for task in list(app.tasks.values())):
        ping = threading.Thread(
            target=_warn_when_unreachable, args=(app,), name="fenced-ready-ping", daemon=True
        )
        ping.start()
        ping.join(2 * READY_PING_TIMEOUT)  # never holds the start up for longer


def _warn_when_unreachable(app: Any) -> None:
    """One PING of the app's claims' Redis; a WARNING when it does not answer."""
    where, why = ping_claims(app, READY_PING_TIMEOUT)
    if why is None:
        return
    log.warning(
        "fenced: the claims' Redis at %s did not answer a PING (%s): no claimed task "
        "starts until it does. Each call fails closed, after the client's own connection "
        "attempts, and is retried with backoff (claim_unavailable_backoff, at most "
        "claim_unavailable_retries times). Check fenced_redis_url (or FENCED_REDIS_URL, "
        "fenced_redis_client) and that the server runs; `fenced doctor --app` checks it",
        where,
        why,
    )

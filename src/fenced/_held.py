"""What a held lease knows and decides, with no I/O: the state a Claim and a Lock share.

A lease is granted by a request sent at ``sent`` for ``ttl`` seconds. Redis set the
expiry no earlier than the request was sent, so the lease lasts at least until
``sent + ttl`` by Redis's clock; clock drift between this host and Redis, and the time
a PEXPIRE takes to apply, eat into that, so it is trusted slightly less long: until
the *local deadline*, ``sent + ttl - drift`` on ``time.monotonic()`` (drift: 1% of the
ttl, plus 2 ms). A renewal confirmed before the deadline moves it to the renewal's
``sent + ttl - drift``; one confirmed after it changes nothing.

A lease is *lost* when a renewal finds it gone or held under another token, or when
its deadline passes with no renewal confirmed (``lost`` reads true from that moment;
the loss is declared, and reported, by whoever sees it first: the heartbeat, a check,
a release). A lost lease never comes back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from ._heartbeat import RETRY_SHARE
from ._lease import current_pid

__all__ = ["HELD", "IDLE", "LOST", "RELEASED", "LeaseState", "Snapshot"]

IDLE, HELD, LOST, RELEASED = "idle", "held", "lost", "released"


class Snapshot(NamedTuple):
    """A held lease as it was at one moment (what a report of its loss names)."""

    token: str | None
    fence: int | None
    slot: int | None
    started_at: float


class LeaseState:
    """One lease's token, fence, local deadline and state (idle, held, lost, released).

    Claims keep one for their whole life and hold it again on each acquire; a Lock
    makes one per acquire. The heartbeat and the asyncio renewer talk to it through
    ``fenced._heartbeat.Renewable``: this class answers what they tell (``renewed``,
    ``retry_soon``, ``renewal_refused``, ``expired``); a front end adds ``renewal``,
    ``renewal_event`` and what a loss does (``_report_lost``).
    """

    #: Why a lease was lost, in the words of its front end.
    expired_reason = "no refresh was confirmed before the local deadline"
    taken_reason = "the lease is gone or held under another token"

    def __init__(
        self, ttl: float, refresh_every: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self.refresh_every = refresh_every
        self._ttl_ms = max(1, int(ttl * 1000))
        self._drift = ttl * 0.01 + 0.002
        self._clock = clock
        self._mutex = threading.Lock()
        self._state = IDLE
        self._pid = current_pid()
        self._deadline = 0.0
        self._next_refresh = 0.0
        self._started_at = 0.0
        # A renewal sent before this says nothing (a Lock's extend shortened the lease).
        self._shortened_at = float("-inf")
        self.token: str | None = None
        self.fence: int | None = None
        self._lost_reason: str | None = None

    def _deadline_from(self, sent: float, ttl: float | None = None) -> float:
        """The local deadline of a lease given ``ttl`` (default its own) by a request sent
        at ``sent``."""
        return sent + (self.ttl if ttl is None else ttl) - self._drift

    def _hold(self, token: str, fence: int, sent: float) -> None:
        """Held under ``token`` from a grant sent at ``sent`` (a shared object: under the
        mutex)."""
        self.token = token
        self.fence = fence
        self._lost_reason = None
        self._pid = current_pid()
        self._state = HELD
        self._started_at = sent
        self._shortened_at = float("-inf")
        self._deadline = self._deadline_from(sent)
        self._next_refresh = sent + self.refresh_every

    # -- state (reading it never acts) ------------------------------------------------

    def _mine(self) -> bool:
        """Held by this object in this process (a forked child holds none of it)."""
        return self._state == HELD and self._pid == current_pid()

    @property
    def held(self) -> bool:
        """True while this process holds the lease and its local deadline has not passed."""
        return self._mine() and self._clock() < self._deadline

    @property
    def lost(self) -> bool:
        """True once the lease was lost (or its local deadline passed); it never comes back."""
        return self._state == LOST or (self._mine() and self._clock() >= self._deadline)

    @property
    def lost_reason(self) -> str | None:
        """Why the lease was lost (None while it is not)."""
        if self._lost_reason is None and self.lost:
            return self.expired_reason  # lost by the clock, not declared yet
        return self._lost_reason

    @property
    def expires_in(self) -> float:
        """Seconds until the local deadline (0 when not held)."""
        if not self._mine():
            return 0.0
        return max(0.0, self._deadline - self._clock())

    def schedule(self) -> tuple[float, float] | None:
        """(the refresh interval, when the next renewal is due) while this process holds
        the lease, else None: what the heartbeat reads as it starts renewing it."""
        if not self._mine() or self.token is None:
            return None
        return self.refresh_every, self._next_refresh

    # -- what the heartbeat tells (fenced._heartbeat.Renewable) ------------------------

    def renewed(self, sent: float, token: str) -> None:
        """Redis extended the lease of ``token`` by a request sent at ``sent``."""
        with self._mutex:
            if self._state != HELD or token != self.token:
                return
            if self._clock() < self._deadline:
                # The server applied PEXPIRE no earlier than we sent it, so the lease
                # runs at least until sent + ttl.
                if sent >= self._shortened_at:
                    self._deadline = max(self._deadline, self._deadline_from(sent))
                    self._next_refresh = sent + self.refresh_every
                return
        # Confirmed only after the local deadline: the lease was lost at the deadline
        # (it may have been seen as not held meanwhile) and does not come back.
        self._declare_lost(self.expired_reason, token)

    def retry_soon(self) -> None:
        """No confirmed answer yet (a renewal on its way, or none came): look again soon."""
        with self._mutex:
            if self._state == HELD:
                self._next_refresh = self._clock() + self.refresh_every * RETRY_SHARE

    def renewal_refused(self, token: str, why: str | None = None) -> None:
        """The lease of ``token`` is gone or held under another token (``why``: what
        the run that took it over noted, e.g. "replaced by ...")."""
        self._declare_lost(why or self.taken_reason, token)

    def expired(self, token: str) -> None:
        """The local deadline of ``token``'s lease passed with no renewal confirmed."""
        self._declare_lost(self.expired_reason, token)

    # -- the transitions ---------------------------------------------------------------

    def _declare_lost(self, reason: str, token: str | None = None) -> None:
        """Held to lost, once: for the lease of ``token`` (None: the one held now)."""
        with self._mutex:
            if self._state != HELD or (token is not None and token != self.token):
                return
            self._state = LOST
            self._lost_reason = reason
            # The lease lost, as it was: this may be the heartbeat's thread, and the
            # owner may release and acquire again before the loss is reported.
            lease = self._snapshot()
        self._report_lost(reason, lease)

    def _snapshot(self) -> Snapshot:
        """The lease held now (read under the mutex)."""
        return Snapshot(self.token, self.fence, None, self._started_at)

    def _report_lost(self, reason: str, lease: Snapshot) -> None:
        """The lease was just declared lost: the front end logs it, tells its callbacks."""

    def _expire_if_due(self, now: float | None = None) -> None:
        """Declare the lease lost if its local deadline passed while it was held (by
        ``now``, a reading of its clock the caller has; else the clock is read)."""
        if self._state == HELD and (self._clock() if now is None else now) >= self._deadline:
            self._declare_lost(self.expired_reason)

    def _end_hold(self, stay_lost: bool = False) -> str:
        """Mark the lease given back; the state it was in. From here on a renewal in
        flight that reaches Redis after the lease is deleted finds it gone, and that is
        not a loss. With ``stay_lost``, a lost lease keeps saying so."""
        with self._mutex:
            before = self._state
            self._state = LOST if stay_lost and before == LOST else RELEASED
        return before

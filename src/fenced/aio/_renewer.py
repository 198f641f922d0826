"""One renewer per event loop: a task that renews every claim held on that loop.

The asyncio counterpart of ``fenced._heartbeat``, with the same rules: the renewer
task never awaits Redis itself. On each wake it declares lost every claim whose local
deadline passed, and hands the claims that are due, or nearly due (so renewals
coalesce into a few pipelined round trips per interval even for thousands of claims),
to one *round* per client: a task that sends them in pipelined batches of REFRESH,
bounded by a timeout below the refresh interval. A client whose previous round is still
waiting gets no new one, so a stuck server holds up only its own claims, and a claim
is declared lost no later than its local deadline plus one refresh interval.

Claims are held weakly and told what came of a renewal through the same
:class:`fenced._heartbeat.Renewable` interface as the thread heartbeat. The task ends
a second after the last claim left (one that comes sooner is renewed by it), and
starts again with the next one.

Its time is a seam, as the thread heartbeat's: a :class:`Renewer` made with another
``clock`` and ``wait`` (tests drive time with one) reads that clock for every deadline
and ``sent``, and sleeps through ``wait``; the claims it renews must read the same clock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import weakref
from collections.abc import Awaitable, Callable

from .. import events
from .._heartbeat import (
    BATCH,
    COALESCE,
    IDLE_WAIT,
    MIN_NAP,
    Renewable,
    Renewal,
    _tell,
    failed,
    refresh_call,
    refresh_failed,
    refused_why,
)
from .._lease import UNREACHABLE
from .._scripts import Call
from ._send import call_pipeline, keep

__all__ = ["Renewer", "renewer"]

log = logging.getLogger("fenced.heartbeat")

#: How long the task waits for a claim once none is left, before it ends (seconds).
LINGER = 1.0

Batch = list[tuple[Renewable, Renewal]]
#: A round that ends in one of these got no answer: its claims are tried again soon.
_NO_ANSWER: tuple[type[BaseException], ...] = (*UNREACHABLE, asyncio.TimeoutError)


async def wait_or_wake(wake: asyncio.Event, timeout: float) -> None:
    """Sleep until ``wake`` is set or ``timeout`` seconds have passed (the timeout sets
    ``wake``, which the caller clears: no task of its own, unlike ``wait_for``)."""
    if wake.is_set():
        return
    timer = asyncio.get_running_loop().call_later(timeout, wake.set)
    try:
        await wake.wait()
    finally:
        timer.cancel()


def round_timeout(refresh_every: float) -> float:
    """How long one renewal round may wait for its server: below the interval."""
    return min(5.0, max(0.05, refresh_every / 2))


def quiet(idle: bool) -> None:
    """Whether asyncio may drop the current task unlogged when its loop is closed."""
    task = asyncio.current_task()
    if task is not None and hasattr(task, "_log_destroy_pending"):
        task._log_destroy_pending = not idle


class Renewer:
    """Renews every claim held on one event loop: one task, pipelined rounds per client.

    ``clock`` is what every deadline is read on, and ``wait(event, timeout)`` how the
    task sleeps until ``event`` is set or the timeout passes: seams for tests, which
    drive time instead of sleeping it. The claims renewed must read the same clock.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[asyncio.Event, float], Awaitable[None]] = wait_or_wake,
    ) -> None:
        self._clock = clock
        self._wait = wait
        # Weak: a claim nobody references stops being renewed and expires by its ttl.
        self._claims: dict[int, weakref.ref[Renewable]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._wake_at = math.inf
        # Clients (by id) with a round still waiting for its server.
        self._busy: set[int] = set()
        #: Pipelined round trips sent so far.
        self.round_trips = 0

    def add(self, claim: Renewable) -> None:
        """Start renewing a claim (starts the task on first use)."""
        lease = claim.renewal()
        if lease is None:
            return
        self._claims[id(claim)] = weakref.ref(claim)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="fenced-renewer")
        elif min(lease.next_refresh, lease.deadline) < self._wake_at:
            self._wake.set()

    def discard(self, claim: Renewable) -> None:
        """Stop renewing a claim."""
        ref = self._claims.get(id(claim))
        if ref is not None and ref() in (claim, None):
            del self._claims[id(claim)]

    def claims(self) -> list[Renewable]:
        """The claims being renewed now."""
        return [c for ref in self._claims.values() if (c := ref()) is not None]

    def __len__(self) -> int:
        return len(self.claims())

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The renewer task, while it runs."""
        return self._task

    async def _run(self) -> None:
        lingered = False
        while self._claims or not lingered:
            if self._claims:
                lingered = False
                try:
                    wake = self._tick()
                except Exception:  # a renewer that dies silently is the bug to avoid
                    log.exception("fenced: renewer tick failed; retrying")
                    wake = self._clock() + 0.05
            if not self._claims:
                # None left: wait a little for the next before ending, so that claims
                # taken and given back in turn do not start a task each.
                lingered = True
                wake = self._clock() + LINGER
            self._wake_at = wake
            # A loop closed while the task lingers with nothing to renew loses nothing:
            # no "Task was destroyed but it is pending" for it.
            quiet(lingered)
            await self._wait(self._wake, max(0.0, wake - self._clock()))
            quiet(False)
            self._wake.clear()
            self._wake_at = math.inf
        self._task = None

    def _tick(self) -> float:
        """Declare expired claims lost, start the rounds that are due; the next wake."""
        now = self._clock()
        wake = now + IDLE_WAIT
        due: Batch = []
        expired: list[tuple[Renewable, str]] = []
        any_due = False
        for key, ref in list(self._claims.items()):
            c = ref()
            lease = c.renewal() if c is not None else None
            if c is None or lease is None:
                del self._claims[key]  # collected, or no longer held
                continue
            if now >= lease.deadline:
                expired.append((c, lease.token))
                del self._claims[key]
                continue
            if lease.next_refresh <= now:
                any_due = True
            else:
                wake = min(wake, lease.next_refresh, lease.deadline)
            if lease.next_refresh - lease.refresh_every * COALESCE <= now:
                due.append((c, lease))
        for c, token in expired:
            _tell(c.expired, token)
        if any_due:
            by_client: dict[int, Batch] = {}
            for c, lease in due:
                by_client.setdefault(id(lease.client), []).append((c, lease))
            for client_id, batch in by_client.items():
                # Sent, or the client's last round still waits: no answer yet either
                # way, so each claim looks again a little later.
                for c, _lease in batch:
                    _tell(c.retry_soon)
                if client_id in self._busy:
                    continue
                self._busy.add(client_id)
                task = asyncio.get_running_loop().create_task(self._round(client_id, batch))
                task.add_done_callback(functools.partial(self._round_done, client_id))
                keep(task)  # the loop holds tasks weakly
            # The claims just told to retry soon are due again within the nap.
            wake = min(
                wake, now + max(MIN_NAP, min(lease.refresh_every for _c, lease in due) * 0.35)
            )
        return wake

    def _round_done(self, client_id: int, _task: asyncio.Task[None]) -> None:
        self._busy.discard(client_id)

    async def _round(self, client_id: int, batch: Batch) -> None:
        client = batch[0][1].client
        timeout = round_timeout(min(lease.refresh_every for _c, lease in batch))
        for start in range(0, len(batch), BATCH):
            # Each lease is judged under the token it was read with: a claim released
            # and acquired again meanwhile has a new lease.
            part = batch[start : start + BATCH]
            calls: list[Call] = [refresh_call(lease) for _c, lease in part]
            sent = self._clock()
            self.round_trips += 1
            try:
                results = await asyncio.wait_for(call_pipeline(client, calls), timeout)
            except _NO_ANSWER as exc:
                # Not confirmed: each claim keeps its deadline and is retried soon.
                log.warning(
                    "fenced: renewer could not reach Redis: %s",
                    exc or "timed out",
                    extra={"fenced_event": "renewal_failed"},
                )
                failed(part, self._clock() - sent, exc or TimeoutError("renewal round timed out"))
                continue
            except Exception as exc:
                log.exception(
                    "fenced: renewal round failed", extra={"fenced_event": "renewal_failed"}
                )
                failed(part, self._clock() - sent, exc)
                continue
            took = self._clock() - sent
            report = events.enabled()
            for (c, lease), res in zip(part, results):
                if isinstance(res, Exception):
                    refresh_failed(c, res)
                    if report:
                        _tell(c.renewal_event, took, res)
                elif res == 1:
                    _tell(c.renewed, sent, lease.token)
                    if report:
                        _tell(c.renewal_event, took)
                else:
                    _tell(c.renewal_refused, lease.token, refused_why(res))
        del batch  # the claims are referenced only while their round runs


_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Renewer] = (
    weakref.WeakKeyDictionary()
)


def renewer() -> Renewer:
    """The running event loop's renewer (created on first use)."""
    loop = asyncio.get_running_loop()
    found = _renewers.get(loop)
    if found is None:
        found = _renewers[loop] = Renewer()
    return found

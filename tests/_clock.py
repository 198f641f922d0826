"""Time that moves only when a test says so, for the heartbeat and the asyncio renewer.

A test that waits for renewals or a local deadline drives time instead of sleeping it:
the heartbeat (or renewer) and the claims read one :class:`ManualClock`, and
:meth:`ManualClock.run` moves it on in steps, letting every renewal round that falls
due reach the real Redis and come back before the next step. Redis itself keeps real
time: a lease's key still expires after its ttl in real seconds. So a lease must
outlast the real time a test spends between two steps (taking a thousand claims takes
a while on a loaded machine), and while something else takes real seconds (a failover,
a child process) the clock keeps pace with real time (:meth:`ManualClock.keep_pace`).

    def test_x(fake_time: ManualClock, r: Any) -> None:   # the fixture, in conftest
        c = Claim(r, "x", ttl=0.6, clock=fake_time)
        assert c.acquire()
        fake_time.run(3.0)                                 # five ttls, in a few ms
        assert c.held                                      # only renewals keep it
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

from _wait import WAIT, wait_for
from fenced._heartbeat import Heartbeat
from fenced.aio._renewer import Renewer, _renewers

#: How often (real seconds) a sleeper looks at the clock: the code's own wakes (a claim
#: due sooner, added) still come at once, by its notify.
LOOK_EVERY = 0.001


class ManualClock:
    """A monotonic clock that moves on :meth:`advance`, and the sleeps that go with it.

    ``wait`` stands in for ``Condition.wait`` (a :class:`Heartbeat`'s ``wait``) and
    ``wait_async`` for the asyncio renewer's: each sleeps until its timeout has passed
    on this clock, or the code wakes it (``notify``, the renewer's event), as the real
    ones do. Moving the clock wakes nobody early: a sleeper sees the new time when it
    looks (every :data:`LOOK_EVERY` real seconds), so a wake the code forgot to give is
    still missed here.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._mutex = threading.Lock()
        #: How many sleepers sleep now, and the latest time one of them looked at.
        self.asleep = 0
        self.seen = start
        self.heartbeat: Heartbeat | None = None
        self.renewer: Renewer | None = None
        self.closed = False

    def __call__(self) -> float:
        return self.now

    # -- the seams ------------------------------------------------------------------

    def wait(self, cond: threading.Condition, timeout: float) -> bool:
        """``Condition.wait`` in this time (called holding ``cond``)."""
        deadline = self.now + timeout
        with self._mutex:
            self.asleep += 1
        try:
            while True:
                now = self.now
                if now >= deadline:
                    return False
                self.seen = now
                if self.closed:
                    cond.wait()  # the test is over: sleep till the code wakes it
                    return True
                # Condition.wait(timeout) answers False when a notify lands as its
                # timeout runs out, which these 1 ms looks make common: the heartbeat's
                # own flag of a wake given by add() is read too.
                if cond.wait(LOOK_EVERY) or getattr(self.heartbeat, "_added", False):
                    return True
        finally:
            with self._mutex:
                self.asleep -= 1

    async def wait_async(self, event: asyncio.Event, timeout: float) -> None:
        """The asyncio renewer's sleep in this time: until ``timeout`` or ``event``."""
        deadline = self.now + timeout
        self.asleep += 1
        try:
            while not event.is_set():
                now = self.now
                if now >= deadline:
                    return
                self.seen = now
                await asyncio.sleep(LOOK_EVERY)
        finally:
            self.asleep -= 1

    # -- driving it -----------------------------------------------------------------

    def new_heartbeat(self) -> Heartbeat:
        """A heartbeat on this clock (the ``fake_time`` fixture makes it the process's)."""
        self.heartbeat = Heartbeat(clock=self, wait=self.wait)
        return self.heartbeat

    def renewer_for_this_loop(self) -> Renewer:
        """A renewer on this clock, made the running event loop's (``renewer()``)."""
        self.renewer = Renewer(clock=self, wait=self.wait_async)
        _renewers[asyncio.get_running_loop()] = self.renewer
        return self.renewer

    def advance(self, seconds: float) -> None:
        """Move time on by ``seconds`` (:meth:`step` also waits for what fell due)."""
        self.now += seconds

    def _idle(self) -> bool:
        """The heartbeat sleeps, has seen the time it is, and no round is out."""
        hb = self.heartbeat
        if hb is None or hb.thread is None:
            return True  # not started: no claim was ever added
        if not self.asleep or self.seen != self.now:
            return False
        return not any(lane.busy for lane in list(hb._lanes.values()))

    def settle(self, timeout: float = WAIT) -> None:
        """Until the heartbeat has done all that falls due by now, and sleeps."""
        wait_for("the heartbeat to settle", self._idle, timeout, 0.001)

    def step(self, seconds: float) -> None:
        """Move time on by ``seconds``, then wait for what fell due to be done."""
        self.settle()
        self.advance(seconds)
        self.settle()

    def run(self, seconds: float, every: float = 0.05) -> None:
        """Let ``seconds`` pass in steps of ``every``, each settled before the next."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.step(min(every, end - self.now))

    def run_until(
        self, what: str, done: Callable[[], object], limit: float, every: float = 0.05
    ) -> float:
        """Steps of ``every`` until ``done()``; the time that took (fails past ``limit``)."""
        start = self.now
        self.settle()
        while not done():
            if self.now - start > limit:
                raise AssertionError(f"{what}: not within {limit:g} s of this clock")
            self.step(every)
        return self.now - start

    def keep_pace(self, what: str, done: Callable[[], object], timeout: float = WAIT) -> None:
        """Move on with real time (each step as long as the last took) until ``done()``:
        for what takes real seconds, as a failover does, while leases count on this clock."""
        start = last = time.monotonic()
        self.settle()
        while not done():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
            time.sleep(0.02)
            now = time.monotonic()
            self.step(now - last)  # the next step counts this one's settling too
            last = now

    # -- the same, for the asyncio renewer ------------------------------------------

    def _idle_async(self) -> bool:
        rn = self.renewer
        if rn is not None and rn._busy:
            return False  # a round is out
        if rn is None or rn.task is None:
            return True  # no task: it ends when no claim is left
        return self.asleep > 0 and self.seen == self.now

    async def settle_async(self, timeout: float = WAIT) -> None:
        """Until the renewer has done all that falls due by now, and sleeps."""
        deadline = time.monotonic() + timeout
        while not self._idle_async():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g}s: the renewer never settled")
            await asyncio.sleep(0.001)

    async def step_async(self, seconds: float) -> None:
        await self.settle_async()
        self.advance(seconds)
        await self.settle_async()

    async def run_async(self, seconds: float, every: float = 0.05) -> None:
        """:meth:`run` for claims on the running loop's renewer."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            await self.step_async(min(every, end - self.now))

    def close(self) -> None:
        """The test is over: its sleepers sleep on till the code wakes them, looking no
        more, and the heartbeat's lanes close their connections."""
        self.closed = True
        hb = self.heartbeat
        if hb is not None:
            for lane in list(hb._lanes.values()):
                lane.close()

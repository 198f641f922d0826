"""The asyncio Claim: the same lease, scripts, keys and records as ``fenced.Claim``.

::

    async with fenced.aio.Claim(client, "rebuild:acme:roads", ttl=60) as claim:
        await rebuild(fence=claim.fence)      # cancelled if the claim is lost

Every decision is :class:`fenced._claim.ClaimState`'s, shared with the thread
front end; this class only awaits the scripts. What it adds is asyncio's:

- one renewer task per event loop renews every claim held on it (``_renewer``);
- when the claim is lost, the task running the ``async with`` block is cancelled, as
  ``asyncio.timeout`` does, and the block ends in ``ClaimLost`` (on Python 3.10,
  which has no ``Task.uncancel``, a cancellation that arrives from elsewhere at the
  same moment is taken for the loss);
- a cancelled caller never leaves its lease behind: an acquire cancelled once it was
  sent has its reply read by a task of its own, and a grant in it is given back (no
  task is started unless the caller is cancelled); a release cut short is sent again
  (RELEASE is safe to repeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from types import TracebackType
from typing import Any

import redis

from .. import events
from .._claim import _LATE, _UNCONFIRMABLE, RELEASE_RETRY, ClaimState
from .._client import require_async
from .._errors import ConfigError
from .._guard import RAISE, RUN, Action, BusyPolicy, Run, busy_error, lost_error, settle
from .._held import HELD
from .._lease import UNREACHABLE, LeaseCalls, granted_reply, new_token, refreshed, released
from .._scripts import Call
from ._renewer import renewer
from ._send import call, keep, run_to_end

__all__ = ["Claim"]

log = logging.getLogger("fenced")


class Claim(ClaimState):
    """An exclusive, self-renewing lease on one named resource, for ``redis.asyncio``.

    Takes the parameters of :class:`fenced.Claim` (``redis`` is a ``redis.asyncio``
    client); ``acquire``, ``refresh``, ``release`` and ``finished_ok`` are awaited.
    ``async with claim:`` raises ``ClaimHeld`` when busy, and ends in ``ClaimLost``
    (the block cancelled) when the claim is lost while it runs.
    """

    _store: LeaseCalls
    _SOURCE = "aio"

    def _connect(self, redis: Any) -> Any:
        return require_async(redis, "fenced.aio.Claim", "fenced.Claim")

    def _bind_store(self) -> None:
        if self.replicas:
            raise ConfigError(
                f"replicas={self.replicas}: fenced.aio does not wait for replicas; use "
                "fenced.Claim for claims that must be acknowledged by replicas",
                name=self.name,
            )
        self._store = LeaseCalls(self.keys, self.options)
        self._block: asyncio.Task[Any] | None = None
        self._block_cancelling = 0
        self._cancelled_block = False

    # -- acquire ----------------------------------------------------------------------

    async def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        *,
        request_rerun: bool | str = False,
    ) -> bool:
        """Take the claim; non-blocking by default. Raises ClaimUnavailable if Redis is down."""
        self._check_acquire(timeout)
        give_up = None if timeout is None else self._clock() + timeout
        record_skip = not blocking
        while True:
            if await self._try_acquire(record_skip, request_rerun):
                return True
            # A window is not waited out: it is a skip.
            if not blocking or self.ran_recently is not None or self._gave_up(give_up):
                if events.enabled():
                    self._busy_event(request_rerun)
                return False
            await asyncio.sleep(self._retry_wait(self._clock(), give_up))

    async def replace(self) -> bool:
        """Take the claim now, from whoever holds it, as :meth:`fenced.Claim.replace`."""
        self._check_acquire(None)
        self._check_replace()
        return await self._try_acquire(False, False, replace=True)

    async def _try_acquire(
        self, record_skip: bool, mark_rerun: bool | str, replace: bool = False
    ) -> bool:
        token = new_token(self.task_id)
        if replace:
            request = self._replace_call(token)
        else:
            request = self._acquire_call(token, record_skip, mark_rerun)
        sent = self._clock()
        try:
            res = granted_reply(await call(self.redis, request, lambda f: self._abandon(f, token)))
        except UNREACHABLE as exc:
            if isinstance(exc, redis.TimeoutError):
                # Only a request that was sent can have landed.
                keep(asyncio.ensure_future(self._give_back(token)))
            raise self._unavailable(exc) from exc
        except redis.ResponseError as exc:
            # A script stopped at a key it could not use may have set the lease first.
            with contextlib.suppress(Exception):  # best effort: it expires with its ttl
                for request in self._store.abandon_calls(token):
                    await call(self.redis, request)
            raise self._refused(exc, await self._corrupt_key()) from exc
        except UnicodeDecodeError:  # a client that decodes replies: only a holder is text
            return self._held_unreadably()
        late = self._late(res, sent)
        if late is not None:
            try:
                await run_to_end(call(self.redis, self._give_back_call(token, res, _LATE, late)))
            except Exception:  # best effort: the lease expires within its ttl anyway
                log.warning(
                    "fenced: could not give back the late grant of %r",
                    self.name,
                    extra=self.log_fields("unavailable"),
                )
            raise self._late_error(late)
        if not self._took(token, res, sent, replace=replace):
            return False
        if self.heartbeat:
            renewer().add(self)
        return True

    async def _abandon(self, request: asyncio.Future[Any], token: str) -> None:
        """The caller of an ACQUIRE was cancelled: give back what it may have granted."""
        if request.cancelled():
            return
        exc = request.exception()
        if (exc is None and int(granted_reply(request.result())[0]) == 1) or isinstance(
            exc, redis.TimeoutError
        ):
            await self._give_back(token)

    async def _corrupt_key(self) -> tuple[str, str] | None:
        """After a failed ACQUIRE: the key whose value stopped it, if one did."""
        try:
            pipe = self.redis.pipeline(transaction=False)
            for command in self._store.inspect_commands():
                pipe.execute_command(*command)
            return self._store.corrupt_key(await pipe.execute(raise_on_error=False))
        except Exception:  # a diagnosis only: the error it explains is raised anyway
            return None

    async def _give_back(self, token: str) -> None:
        try:
            for request in self._store.abandon_calls(token):
                await call(self.redis, request)
        except Exception:  # best effort; the lease expires within its ttl anyway
            log.warning(
                "fenced: could not give back an abandoned grant of %r",
                self.name,
                extra=self.log_fields("unavailable"),
            )

    # -- refresh ----------------------------------------------------------------------

    async def refresh(self) -> bool:
        """Extend the lease now; False (and the claim is lost) if another token holds it."""
        if not self._mine() or self.token is None:
            return False
        token = self.token
        sent = self._clock()
        try:
            ok = await call(
                self.redis,
                self._store.refresh_call(token, self.slot or 0, self._marker()),
            )
        except UNREACHABLE as exc:
            self.retry_soon()
            raise self._refresh_unavailable(exc) from exc
        ok = refreshed(ok)
        if ok is True:
            self.renewed(sent, token)
            self.renewal_event(self._clock() - sent)
            return self.held
        self.renewal_refused(token, ok or None)
        return False

    # -- release ----------------------------------------------------------------------

    async def release(self, outcome: str | None = None, reason: str | None = None) -> bool:
        """Give the claim back; True only if our token still held it (then it is deleted).

        Goes on to its end when the caller is cancelled meanwhile.
        """
        if not self._releasable():
            return False
        if self.heartbeat:
            renewer().discard(self)
        before, outcome, record = self._begin_release(outcome, reason)
        request = self._release_call(outcome, record)
        try:
            return await self._send_release(before, outcome, request)
        except asyncio.CancelledError:
            # Sent or not, it is sent again from a task of its own: a RELEASE is safe to
            # repeat (one that landed answers from its note and records nothing twice),
            # and this costs a cycle no task, where shielding every release would.
            keep(asyncio.ensure_future(self._send_release(before, outcome, request)))
            raise

    async def _send_release(self, before: str, outcome: str, request: Call) -> bool:
        give_up = self._release_give_up(before)
        while True:
            try:
                answer = released(await call(self.redis, request))
                break
            except _UNCONFIRMABLE as exc:
                if isinstance(exc, UNREACHABLE) and time.monotonic() + RELEASE_RETRY < give_up:
                    await asyncio.sleep(RELEASE_RETRY)
                    continue
                self._release_unconfirmed(exc, outcome)
                return False
            except asyncio.CancelledError:
                raise  # not undone: the caller sends it again
            except BaseException:
                self._release_undone(before)
                if self.heartbeat and before == HELD:
                    renewer().add(self)
                raise
        return self._ended(before, outcome, *answer)

    async def finished_ok(self) -> bool:
        """Whether a run of this claim's task id ended ``ok`` within its redelivery window."""
        if self.task_id is None:
            return False
        return bool(await self.redis.exists(self.keys.done(self.task_id)))

    # -- work under the claim: the drivers of fenced._guard -----------------------------

    async def enter(self, policy: BusyPolicy = RAISE, trigger: bool | str = True) -> Action:
        """Take the claim under a busy ``policy``: ``RUN`` when held, else its action
        (``fenced.Claim.enter``; no lease is taken over: asyncio claims keep none)."""
        blocking, timeout = self._acquire_as(policy)
        rerun = trigger if policy.asks_rerun else False
        if policy.replaces:
            if await self.replace():
                return RUN
        elif await self.acquire(blocking, timeout, request_rerun=rerun):
            return RUN
        return policy.on_busy(self)

    async def end(
        self,
        exc: BaseException | None,
        what: str = "the work",
        *,
        outcome: str | None = None,
        reason: str | None = None,
        raise_lost: bool = True,
    ) -> str:
        """Release with the outcome of how the work ended (``fenced.Claim.end``)."""
        outcome, reason = self._ending(exc, outcome, reason)
        try:
            await self.release(outcome=outcome, reason=reason)
        except Exception:
            self._release_failed()
        return settle(self, outcome, exc, what, raise_lost)

    # -- the block ----------------------------------------------------------------------

    def _stop_work(self) -> None:
        # Cancel the block's task, as asyncio.timeout does; a loss found by the block's
        # own task (check(), release) is raised there instead.
        task = self._block
        if task is None or task.done() or task is _current_task():
            return
        self._cancelled_block = True
        task.cancel(f"fenced: claim {self.name!r} was lost")

    async def __aenter__(self) -> Claim:
        if self._mine():
            # Acquired before the block (the skip idiom): enter only while still ours.
            self.check()
        elif not isinstance(await self.enter(), Run):
            raise busy_error(self)
        task = asyncio.current_task()
        self._block = task
        self._cancelled_block = False
        if task is not None and sys.version_info >= (3, 11):
            self._block_cancelling = task.cancelling()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._block = self._block, None
        interrupted = False
        if self._cancelled_block and task is not None:
            self._cancelled_block = False
            others = False  # 3.10 cannot tell our cancellation from another one
            if sys.version_info >= (3, 11):
                others = task.uncancel() > self._block_cancelling
            if not others:
                interrupted = isinstance(exc, asyncio.CancelledError)
                if not interrupted:
                    # Requested but not delivered (the block ended first): take it here,
                    # so the release below is not cut short.
                    try:
                        await asyncio.sleep(0)
                    except asyncio.CancelledError:
                        pass
        if not self._releasable():
            return
        await self.end(exc, self._what, raise_lost=not interrupted)
        if interrupted:
            raise lost_error(self, self._what, interrupted=True) from exc


def _current_task() -> asyncio.Task[Any] | None:
    try:
        return asyncio.current_task()
    except RuntimeError:  # no running loop
        return None

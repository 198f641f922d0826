"""Celery integration: a task base class whose every run holds a fenced claim.

::

    from fenced.celery import ClaimedTask

    @app.task(base=ClaimedTask, bind=True, acks_late=True,
              claim="rebuild:{tenant}:{layer}", claim_ttl=60)
    def rebuild_map(self, tenant, layer):
        for step in self.claim.steps(build_steps(tenant, layer)):
            step.run(fence=self.claim.fence)

What one run does:

1. It names its claim from the task's arguments and acquires it: one round trip, which
   also writes the ``started`` run record (or the ``skipped`` one, counting the skip).
2. If another holder has the claim: a holder carrying *this* task id is an earlier
   attempt that died holding it (the message was redelivered), so the task retries when
   that lease ends; anyone else makes the claim busy, handled by ``claim_on_busy``:
   ``skip`` returns a ``Skipped`` result as a dict (no retry, no failure), ``rerun``
   also asks the holder for one more run, ``retry`` retries after the holder's lease,
   ``raise`` fails with ``ClaimHeld``.
   A retried or redelivered message whose task id already ran to the end (its run
   record says ``ok``) does not run again: it is ignored, keeping the stored result.
3. The body runs with ``self.claim``. The process's heartbeat renews the lease; once it is
   lost, ``self.claim.check()`` and ``steps()`` raise ``ClaimLost``, and a task that never
   checks is interrupted (``claim_interrupt``): ``ClaimInterrupted`` is raised in the
   thread running it at its next bytecode, and a task in a main thread (prefork, solo)
   is also woken from a sleep or a blocking call by ``SIGUSR2`` (``fenced._interrupt``).
   The run fails with ``ClaimLost`` and its record says ``lost``; the loser never deletes the new
   holder's lease. (Under gevent or eventlet there is no interrupt; checks still raise.)
   A run a newer call took the claim from (``claim_on_busy="replace"``) is not a failure:
   it returns the replaced result (``Skipped.replaced``), its record ``lost`` all the same.
4. In ``finally`` the claim is released with the run's outcome (one round trip, which
   also ends the run record), and if a rerun was asked meanwhile the task is sent once
   more per distinct call (each trigger stays in Redis until its rerun is published,
   ``_rerun``). A run that asked for a retry (``self.retry()``,
   ``autoretry_for``) instead keeps its lease, unrenewed, for the countdown plus the
   claim's ttl (record ``retried``); the retried message takes it over with a new fence
   (``TAKEOVER``), so a duplicate arriving during the countdown is skipped.

With ``claim_enqueue``, ``apply_async`` (and so ``delay``, signatures and beat) publishes
nothing while a message for the call's claim name is queued (``until_started``) or
queued or running (``until_finished``): see ``fenced.celery._enqueue``. With
``claim_debounce``, the calls of one claim name coalesce into one message and one run
with the last call's arguments: see ``fenced.celery._debounce``.

A call over ``claim_rate`` (``delay``) is put back: its message is published again for
its start and this delivery ignored, which is no retry (``_put_back``). A message put
back keeps its ``expires`` (the same absolute time); one whose start would come after it
is not put back but ends as Celery ends an expired message, ``REVOKED``, its booking let
go (``_expire``).

Redis unreachable at acquire: the task retries with exponential backoff; it never runs
unclaimed. A prefork child killed mid-run: the worker's main process releases that
child's claim (``ClaimedRequest``), so the redelivered message runs at once instead of
waiting for the lease to expire.

Options and settings: see ``fenced.celery._options``. The Redis client is made on
first use, one per app and process.
"""

from __future__ import annotations

import inspect
import logging
import random
import threading
import time
import warnings
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import redis
from kombu.utils.uuid import uuid

try:
    from celery import Task
    from celery.exceptions import Ignore, Retry, SoftTimeLimitExceeded
    from celery.signals import task_revoked
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"fenced.celery needs Celery: pip install 'fenced[celery]' ({exc})") from exc

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult

from .. import _interrupt, records
from .._audit import claim_fields
from .._claim import Claim
from .._errors import ClaimInterrupted, ClaimLost, ClaimUnavailable, ConfigError, NotOwner
from .._guard import RetryAfter, Run, Skip, Skipped, busy_error, lost_error
from .._inspect import force_release
from .._lease import HOST, ClaimKeys, Holder, short_token
from .._naming import Namer, bounded_label
from .._options import refuse_unknown
from .._redact import exception_text
from .._scripts import RERUN_SENT
from . import _debounce, _enqueue, _rerun, signals
from ._disabled import SETTING as ENABLED_SETTING
from ._disabled import LocalClaim, enabled
from ._options import (
    OPTIONS,
    RENAMED,
    PerApp,
    TaskOptions,
    as_attribute,
    lock_redis,
    resolve,
    validate,
)

__all__ = ["ClaimedTask", "metrics"]

log = logging.getLogger("fenced.celery")

#: Longest wait between retries while Redis is unreachable.
UNAVAILABLE_MAX_DELAY = 60.0
#: Retries a redelivered task makes while an earlier attempt's lease runs out. Each
#: waits for the lease, so this bounds only an attempt that keeps renewing (alive).
REDELIVERY_MAX_RETRIES = 100
#: How long past its start a start booked for a call over ``claim_rate`` (``delay``)
#: waits for the call's message, seconds (one interval, when that is longer): a message
#: later than that is a new call, and a booking nobody used is gone by then.
BOOKING_HOLD = 2.0
#: A booked start at most this far off (seconds) is waited for in the worker, not sent
#: back to the broker; and how many such waits one delivery makes at most.
BOOKED_WAIT = 1.0
BOOKED_WAITS = 3

#: In-process counters: runs, ok, failed, lost, replaced (lost runs a newer call took the
#: claim from: ``claim_on_busy="replace"``), skipped, skips_exceeded, reruns,
#: reruns_dropped (triggers refused: unsigned, forged, another name's, malformed),
#: conflict_retries, redelivery_retries, unavailable, duplicates, retried, takeovers,
#: aborted, enqueue_skipped (calls not sent: ``claim_enqueue``), throttled (calls put
#: back until the start ``claim_rate`` allows), debounced (calls that joined a burst:
#: ``claim_debounce``), debounce_deferred (a burst's message published again),
#: debounce_dropped (a stored call refused), expired (messages that would have been put
#: back, or waited for, past their ``expires``: ended ``REVOKED``). Per process: a
#: prefork child counts its own runs, the main process counts ``aborted``, the sending
#: process ``enqueue_skipped`` and ``debounced``.
metrics: Counter[str] = Counter()
_metrics_lock = threading.Lock()


def count(key: str) -> None:
    """Add one to an in-process counter."""
    with _metrics_lock:
        metrics[key] += 1


_unsigned_warned = False


def _warn_unsigned(name: str) -> None:
    """Once per process: reruns are taken on trust, with no key to check them by."""
    global _unsigned_warned
    if _unsigned_warned:
        return
    _unsigned_warned = True
    log.warning(
        "fenced: rerun triggers of claim %r are not signed (no fenced_secret_key or "
        "FENCED_SECRET_KEY): anyone who can write the claims' Redis can choose the "
        "arguments of a rerun, within the claim's name. Set a secret key to have "
        "triggers signed and checked",
        name,
        extra=claim_fields(name),
    )


# Whether an app's claims are on, and the client they are taken on: both hang on these
# settings, so each run looks at them once.
_claims = PerApp(
    (ENABLED_SETTING, "fenced_redis_client", "fenced_redis_url", "fenced_redis_options")
)


def _claims_client(app: Any) -> Any:
    """The client an app's claims are taken on; None when claims are switched off."""
    return _claims(app, _client_if_enabled)


def _client_if_enabled(app: Any) -> Any:
    return lock_redis(app) if enabled(app) else None


_local = threading.local()


def _stack() -> list[tuple[Task[Any, Any], Claim]]:
    stack: list[tuple[Task[Any, Any], Claim]] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _signature_of(run: Any) -> inspect.Signature | None:
    """The task's own parameters (without ``self`` for a bound ``run``)."""
    func = run.__func__ if isinstance(run, staticmethod) else run
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if not isinstance(run, staticmethod):
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


class ClaimedTask(Task[Any, Any]):
    """A Celery task base whose runs hold a fenced claim; ``self.claim`` inside the task."""

    #: The custom request releases a killed pool child's claim in the main process.
    Request = "fenced.celery:ClaimedRequest"

    #: A template over the task's arguments, or a callable(args, kwargs) -> claim name
    #: (given as ``claim=`` in the decorator). Inside a run, ``self.claim`` is the held
    #: :class:`fenced.Claim`.
    claim_template: Any = None
    claim_ttl: float | None = None
    claim_refresh_every: float | None = None
    claim_on_busy: str | None = None
    claim_alert_after_skips: int | None = None
    claim_on_skips_exceeded: Any = None
    claim_interrupt: bool | None = None
    claim_namespace: str | None = None
    claim_unavailable_backoff: float | None = None
    claim_unavailable_retries: int | None = None
    claim_redelivery_window: float | None = None
    claim_idle_ttl: float | None = None
    claim_replicas: int | None = None
    claim_replica_timeout: float | None = None
    claim_enqueue: str | None = None
    claim_enqueue_ttl: float | None = None
    claim_cooldown: float | None = None
    claim_limit: int | None = None
    claim_label: str | None = None
    claim_rate: str | None = None
    claim_rate_spread: bool | None = None
    claim_rate_policy: str | None = None
    claim_debounce: float | str | None = None
    claim_debounce_max: float | str | None = None

    _fenced_namer: Namer | None = None
    _fenced_options: TaskOptions | None = None
    # Whether Task.__call__ is the next __call__ after ours (see _traced); per class.
    _fenced_plain_call: bool | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ns = cls.__dict__
        where = f"task {ns.get('name') or cls.__module__ + '.' + cls.__qualname__}"
        for old, new in RENAMED.items():
            if old in ns:
                value = ns[old]
                delattr(cls, old)
                if value is not None:
                    warnings.warn(
                        f"{where}: {old} is now {new}; rename it (the values are the same)",
                        DeprecationWarning,
                        stacklevel=3,
                    )
                if new not in ns:
                    setattr(cls, new, value)
        refuse_unknown(
            [k for k in ns if k.startswith(("claim_", "fenced_")) and not hasattr(ClaimedTask, k)],
            (*OPTIONS, *RENAMED),
            where,
            "option",
        )
        given = {k: ns[k] for k in OPTIONS if k in ns}
        if "claim_ttl" not in given:
            given["claim_ttl"] = getattr(cls, "claim_ttl", None)  # to check refresh_every
        validate(given, where)
        if "claim" in ns and not isinstance(ns["claim"], property):
            # The decorator's claim= option arrives as a class attribute; inside a run
            # self.claim is the held Claim, so the option moves to claim_template.
            source = ns["claim"]
            delattr(cls, "claim")
            cls.claim_template = as_attribute(source)
        callback = ns.get("claim_on_skips_exceeded")
        if inspect.isfunction(callback):
            cls.claim_on_skips_exceeded = as_attribute(callback)
        if "run" in ns or "claim_template" in ns:
            run = _raw_run(cls)
            if run is not None:  # a concrete task, not an abstract base
                if cls.claim_template is None:
                    raise _no_claim(where)
                cls._fenced_namer = Namer(
                    cls.claim_template,
                    _signature_of(run),
                    where,
                    style="pair",
                    key_setting="app.conf.fenced_secret_key",
                )

    @classmethod
    def bind(cls, app: Celery) -> Celery:
        """Bind to an app: options the task does not give come from its settings."""
        bound = super().bind(app)
        if cls._fenced_namer is None:
            return bound  # an abstract base: its tasks resolve their own options
        # As Celery does for its own options; settings checked here fail when the task
        # is built (at the latest when a worker starts), not at its first run.
        options = cls._fenced_options = cls._resolve(app)
        if cls._fenced_namer.secret:  # no key: fail when the task is built
            cls._fenced_namer.key(app.conf.get("fenced_secret_key"))
        if options.policy.asks_rerun:  # a key that signs no trigger: fail here too
            _rerun.rerun_key(app.conf.get("fenced_secret_key"))
        for option, value in options.values.items():
            setattr(cls, option, as_attribute(value))
        return bound

    # -- the claim of the current run --------------------------------------------------

    @property
    def claim(self) -> Claim:
        """The claim this run holds; NotOwner outside a run (the option: claim_template)."""
        for entry in reversed(_stack()):
            if entry[0] is self:
                held: Claim = entry[1]
                return held
        raise NotOwner(
            f"task {self.name} holds no claim outside a run: self.claim is the claim of "
            "the running task; the claim option is task.claim_template, and "
            "task.claim_name_for(args, kwargs) names the claim a call would take"
        )

    def claim_name_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The claim name one call with these arguments takes."""
        namer = self._namer()
        return namer(args, kwargs, self._secret_key(namer))[0]

    def _secret_key(self, namer: Namer) -> Any:
        """The app's key for a template's secret fields (None: the Namer looks further)."""
        return self.app.conf.get("fenced_secret_key") if namer.secret else None

    def _namer(self) -> Namer:
        namer = type(self)._fenced_namer
        if namer is None:
            raise _no_claim(f"task {self.name}")
        return namer

    @classmethod
    def _resolve(cls, app: Celery) -> TaskOptions:
        """The task's options (its claims labelled by its template unless it gives a
        label), resolved once per task class."""
        namer = cls._fenced_namer
        label = bounded_label(namer.label) if namer is not None else None
        return resolve({k: getattr(cls, k) for k in OPTIONS}, app.conf, f"task {cls.name}", label)

    def _options(self) -> TaskOptions:
        options = type(self)._fenced_options
        if options is None:  # a task used before it was bound to its app
            options = type(self)._fenced_options = self._resolve(self.app)
        return options

    # -- deduplication at enqueue (claim_enqueue) ---------------------------------------

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *more: Any,
        **options: Any,
    ) -> AsyncResult[Any]:
        """Send the task; with ``claim_enqueue``, not while a call of its claim is queued.

        A call whose claim name already has a message queued publishes nothing and
        returns that message's result (its task id), unless the call is a canvas's part
        (:data:`CANVAS_OPTIONS`). Marked and published in this order: a publish that
        fails clears the mark it made, then raises.
        """
        opts = self._options()
        if opts.values["claim_debounce"] is not None and _debounced(self, task_id, more, options):
            sent: AsyncResult[Any] = _debounce.send(
                self, args, kwargs, options, super().apply_async, count
            )
            return sent
        if opts.enqueue is None or self.app.conf.task_always_eager or not enabled(self.app):
            # Claims switched off (tests without Redis): nothing is marked either.
            return super().apply_async(args, kwargs, task_id, *more, **options)
        name = self.claim_name_for(args or (), kwargs or {})
        keys = ClaimKeys(opts.claim.namespace, name)
        task_id = task_id or uuid()
        request = self.request
        running = None if request.called_directly else request.id
        client = lock_redis(self.app)
        try:
            expiry = _enqueue.expiry_ms(opts.enqueue_ttl, options)
            queued = _enqueue.mark(client, keys, task_id, expiry, running)
        except (redis.RedisError, OSError) as exc:
            # The run's claim still keeps a second run out: sending beats dropping.
            log.warning(
                "fenced: could not mark %r as queued (%s): sending %s[%s] unmarked",
                name,
                exc,
                self.name,
                task_id,
                extra=claim_fields(name),
            )
            return super().apply_async(args, kwargs, task_id, *more, **options)
        if queued is not None and task_id != running and not _in_canvas(options):
            count("enqueue_skipped")
            log.info(
                "fenced: %s not sent: %s[%s] is queued for claim %r (claim_enqueue=%s)",
                self.name,
                self.name,
                queued,
                name,
                opts.enqueue,
                extra=claim_fields(name),
            )
            return self.AsyncResult(queued)
        # A retry of the running message is sent even when another call is queued, and so
        # is a canvas's part: its chord, chain or callbacks wait for this very task id.
        try:
            return super().apply_async(args, kwargs, task_id, *more, **options)
        except BaseException:
            if queued is None:
                self._clear_queued(keys, task_id, "after a failed send")
            raise

    def _started_queued(self, opts: TaskOptions, task_id: str, args: Any, kwargs: Any) -> None:
        keys = ClaimKeys(opts.claim.namespace, self.claim_name_for(args, kwargs))
        # until_finished: the marker's expiry counts from the start of the run it covers
        until_started = opts.enqueue == "until_started"
        expiry = None if until_started else _enqueue.expiry_ms(opts.enqueue_ttl, {})
        self._clear_queued(keys, task_id, "as its run starts", expiry)

    def _enqueue_marker(self, claim: Claim, opts: TaskOptions) -> None:
        """With ``claim_enqueue``: the run's ACQUIRE handles the marker as its message
        leaves the queue (``until_started`` deletes it with the grant). With ``until_finished`` the
        marker then lives as the lease does: ACQUIRE gives it the lease's ttl, each
        renewal extends it, and RELEASE deletes it; a release a failover lost (or a run
        that died unreleased) leaves a marker that ends within one ttl, as the lease."""
        if opts.enqueue is None:
            return
        request = self.request
        if not request.id or request.called_directly:
            return
        until_started = opts.enqueue == "until_started"
        # until_started: deleted by the grant only (a call refused keeps it, _refused)
        expiry = "~" if until_started else str(claim.options.ttl_ms)
        claim.handle_enqueue_marker(expiry, not until_started)

    def _unqueue_after(self, claim: Claim, exc: BaseException | None) -> None:
        """With ``until_finished`` (the caller checks): the run ended (not by a retry) and
        released its claim.

        Cleared before Celery stores the result (by the release itself, or here when it
        did not answer), so a caller that waited for the result and sends again is not
        handed the finished run's result back.
        """
        request = self.request
        if not request.id:
            return
        if isinstance(exc, Retry) and self._retried_as(exc, claim) == claim.name:
            return  # its message is queued again, under the same id and name
        # A retry under another name marked that name as it was sent: this one is free.
        setattr(request, "fenced_unqueued", True)  # noqa: B010 - Context takes any field
        if not claim.unqueued:
            self._clear_queued(claim.keys, request.id, "as its run ends")

    def after_return(
        self, status: str, retval: Any, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        """With ``claim_enqueue="until_finished"``: a run that ended before its body ran."""
        opts = self._options()
        if opts.enqueue != "until_finished" or task_id is None or not enabled(self.app):
            return
        if getattr(self.request, "fenced_unqueued", False):
            return  # cleared as the body's run ended
        keys = ClaimKeys(opts.claim.namespace, self.claim_name_for(args, kwargs))
        self._clear_queued(keys, task_id, "as its run ends")

    def _clear_queued(
        self, keys: ClaimKeys, task_id: str, when: str, expiry: int | None = None
    ) -> None:
        try:
            _enqueue.clear(lock_redis(self.app), keys, task_id, expiry)
        except Exception:  # it expires by itself; the run goes on
            log.warning(
                "fenced: could not clear the queued mark of %r %s",
                keys.name,
                when,
                exc_info=True,
                extra=claim_fields(keys.name),
            )

    # -- a run -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        client = _claims_client(self.app)
        if client is None:
            return self._run_unclaimed(args, kwargs)
        opts = self._options()
        request = self.request
        if opts.values["claim_debounce"] is not None and _delivered(request):
            try:
                args, kwargs = _debounce.delivered(self, args, kwargs, count, _warn_unsigned)
            except ClaimUnavailable as exc:
                raise self._unavailable(exc, opts) from None
        namer = self._namer()
        name, shown = namer(args, kwargs, self._secret_key(namer))
        extra: dict[str, Any] = {}
        if shown is not None:
            extra["args"] = shown
            readable = namer.readable(args, kwargs, shown)
            if readable:
                extra["arg_text"] = readable
        interrupter = (
            _interrupt.Interrupter() if opts.interrupt and _interrupt.available() else None
        )
        claim = self._claim_template(client, opts, name).for_call(
            name,
            request.id,
            extra,
            interrupter.on_lost if interrupter is not None else None,
            self._record_fields(request.hostname),
        )
        rate_us = opts.claim.rate_us
        if rate_us and opts.values["claim_rate_policy"] == "delay" and _delivered(request):
            # Over the rate, the call's start is booked: its message comes back for it.
            claim.booking = max(BOOKING_HOLD, rate_us / 1e6)
        self._enqueue_marker(claim, opts)
        policy = opts.policy
        # Only the rerun policy takes the name's triggers: any other would send calls
        # that nobody asked it for.
        claim.takes_reruns = policy.asks_rerun
        claim.keeps_reruns = True  # until each rerun is published
        try:
            trigger = self._rerun_trigger(name, args, kwargs) if policy.asks_rerun else False
            action = claim.enter(policy, trigger)
            for _ in range(BOOKED_WAITS):
                # A start of its own this close is waited for here, not sent back; but
                # not past the message's expires (then it ends expired, _throttled).
                if isinstance(action, Run) or claim.booked is None or claim.booked > BOOKED_WAIT:
                    break
                if _debounce.expired_by(self, claim.booked) is not None:
                    break
                time.sleep(claim.booked)
                action = claim.enter(policy, trigger)
        except ClaimUnavailable as exc:
            if opts.enqueue is not None and request.id:
                self._started_queued(opts, request.id, args, kwargs)  # as ACQUIRE would
            raise self._unavailable(exc, opts) from None
        except BaseException as exc:  # e.g. a soft time limit: never leave a lease renewed
            claim.release(
                outcome="failed", reason=f"interrupted while acquiring: {exception_text(exc)}"
            )
            raise
        if not isinstance(action, Run):
            return self._refused(claim, action, opts)
        if action.taken_over:
            count("takeovers")
            log.info(
                "fenced: %s[%s] took over claim %r from its earlier attempt (fence %s)",
                self.name,
                claim.task_id,
                claim.name,
                claim.fence,
                extra=claim.log_fields("acquired"),
            )
        # A delivery of a task id whose run already ended ok: the grant says so, whatever
        # the broker's flags (SQS never sets one; a publish retried, a caller's own
        # task_id sent twice, a rerun published again by a sender that died: none flagged).
        if request.id and (
            claim.completed_before
            or request.retries
            or (request.delivery_info or {}).get("redelivered")
        ):
            try:
                self._settle_earlier_attempts(claim, request.id, args, kwargs)
            except Ignore:
                raise
            except BaseException as exc:
                self._end(claim, None, args, kwargs, exception_text(exc), "failed")
                raise
        return self._run(claim, interrupter, request, args, kwargs)

    def _lock_client(self) -> Any:
        """The Redis client that holds this task's claims (its app's)."""
        return lock_redis(self.app)

    _fenced_template: tuple[Any, TaskOptions, Claim] | None = None

    def _claim_template(self, client: Any, opts: TaskOptions, name: str) -> Claim:
        """The claim (never acquired) each run's own is copied from (``Claim.for_call``):
        made once per task, client and options, not once per run."""
        kept = self._fenced_template
        if kept is not None and kept[0] is client and kept[1] is opts:
            return kept[2]
        template = Claim(client, name, options=opts.claim)
        template._front_end("task", self)
        self._fenced_template = (client, opts, template)
        return template

    _fenced_record_fields: tuple[Any, str] | None = None

    def _record_fields(self, worker: Any) -> str:
        """The fields every run record of this task on ``worker`` carries (its name,
        template and worker), encoded once, not once per run."""
        kept = self._fenced_record_fields
        if kept is not None and kept[0] == worker:
            return kept[1]
        fields = {"task": self.name, "template": self._namer().label}
        if worker:
            fields["worker"] = worker
        text = records.encode_fields(fields)
        self._fenced_record_fields = (worker, text)
        return text

    def _run_unclaimed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """fenced switched off (tests without Redis): the body runs under a LocalClaim."""
        opts = self._options()
        claim = LocalClaim(
            self.claim_name_for(args, kwargs),
            options=opts.claim,
            task_id=self.request.id,
        )
        claim.acquire()
        stack = _stack()
        stack.append((self, claim))
        try:
            return super().__call__(*args, **kwargs)
        finally:
            stack.pop()
            claim.release()

    def _settle_earlier_attempts(
        self, claim: Claim, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Before a retried or redelivered message runs, look at its task id's earlier runs.

        A run of this task id that ended ``ok`` within ``claim_redelivery_window`` means
        this delivery is a duplicate: it does not run again (e.g. a Redis broker's
        visibility timeout shorter than the run handed the message to a second worker,
        which waited for the first attempt's lease). That is one key per task id, read
        in O(1) however many other runs the claim had. An earlier run among the recent
        records with no end recorded died with its worker: it is recorded as
        ``aborted``. We hold the claim, so no attempt of this task id is running. This
        costs two round trips, on this path only.
        """
        client, namespace = claim.redis, claim.namespace
        try:
            done = claim.finished_ok()
            runs = records.history(client, claim.name, limit=20, namespace=namespace)
            for run in runs:
                if run.task_id == task_id and run.outcome == "running" and run.token:
                    if run.token == short_token(claim.token):
                        continue
                    records.record(
                        client,
                        claim.name,
                        "aborted",
                        namespace=namespace,
                        token=run.token,
                        reason="its worker died mid-run (found by a later delivery)",
                        task_id=task_id,
                        idle_ttl=self._options().claim.idle_ttl,
                    )
        except (redis.RedisError, OSError):  # cannot tell: running again is safe under the claim
            log.warning(
                "fenced: could not read the run records of %r",
                claim.name,
                exc_info=True,
                extra=claim.log_fields(),
            )
            return
        if not done:
            return
        self._end(claim, None, args, kwargs, DUPLICATE, "skipped")
        self._duplicate(claim, task_id)

    def _duplicate(self, claim: Claim, task_id: str) -> NoReturn:
        """This delivery's task id already ran to the end: it does not run again."""
        count("duplicates")
        log.info(
            "fenced: %s[%s] already completed under claim %r: this delivery does not run again",
            self.name,
            task_id,
            claim.name,
            extra=claim.log_fields("released", "skipped"),
        )
        # Ignore keeps the first run's stored result and fires neither failure nor retry.
        raise Ignore()

    def _run(
        self,
        claim: Claim,
        interrupter: _interrupt.Interrupter | None,
        request: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        count("runs")
        stack = _stack()
        stack.append((self, claim))
        try:
            with interrupter or nullcontext():
                if claim.lost:  # lost before it could be interrupted: do not start
                    raise ClaimInterrupted()
                if _traced(self, request, args, kwargs):
                    result = self.run(*args, **kwargs)
                else:
                    result = super().__call__(*args, **kwargs)
        except ClaimInterrupted as exc:
            ended = self._end(claim, exc, args, kwargs)
            if self._was_replaced(claim, ended):
                return self._replaced(claim)
            raise lost_error(claim, "the task", interrupted=True) from None
        except SoftTimeLimitExceeded as exc:
            self._end(claim, exc, args, kwargs, reason="soft time limit exceeded")
            raise
        except BaseException as exc:
            ended = self._end(claim, exc, args, kwargs)
            if isinstance(exc, ClaimLost) and self._was_replaced(claim, ended):
                return self._replaced(claim)  # check() or steps() found it replaced
            raise
        finally:
            stack.pop()
        ended = self._end(claim, None, args, kwargs)
        if ended == "lost":
            if self._was_replaced(claim, ended):
                return self._replaced(claim)
            # The body finished, but not under the claim: its writes were not protected.
            raise lost_error(claim, "the task")
        return result

    @staticmethod
    def _was_replaced(claim: Claim, ended: str) -> bool:
        """Whether a run ended ``lost`` because a newer call took its claim over
        (``claim_on_busy="replace"``), as the loss's cause says."""
        return ended == "lost" and claim.lost_cause == "replaced"

    def _replaced(self, claim: Claim) -> dict[str, Any]:
        """The result of a run a newer call replaced: intended, not an error. Its record
        says ``lost``, "replaced by ..." (REPLACE wrote it); it returns the replaced
        result, so Celery stores SUCCESS and sends no failure, and logs one line."""
        count("replaced")
        replaced = Skipped.replaced(claim)
        if claim.superseded is not None:
            # A retry or redelivery of a call a newer one replaced: it does not run again.
            log.info(
                "fenced: %s[%s] not run: a newer call replaced it before: %s",
                self.name,
                claim.task_id,
                replaced,
                extra=claim.log_fields("skipped", "skipped"),
            )
            return replaced.as_dict()
        log.info(
            "fenced: %s[%s] ended as replaced (its fence %s): %s",
            self.name,
            claim.task_id,
            claim.fence,
            replaced,
            extra=claim.log_fields("released", "lost"),
        )
        return replaced.as_dict()

    def _end(
        self,
        claim: Claim,
        exc: BaseException | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reason: str | None = None,
        outcome: str | None = None,
    ) -> str:
        """Release with the run's outcome, send the reruns asked for; the outcome.

        ``outcome``: one decided before the body ran (a duplicate, a failure), not
        counted as a run's."""
        if isinstance(exc, Retry):
            kept = self._keep_for_retry(claim, exc)
            if kept:
                return kept
            claim.handle_enqueue_marker("", False)  # its message is queued again
        ended = claim.end(exc, "the task", outcome=outcome, reason=reason, raise_lost=False)
        if outcome is None:
            count(ended)
            if self._options().enqueue == "until_finished":
                self._unqueue_after(claim, exc)
        if claim.rerun_triggers:
            self._send_reruns(claim, args, kwargs)
        return ended

    def _rerun_key(self) -> bytes | None:
        """The MAC key of this app's rerun triggers (None: no secret key is set)."""
        return _rerun.rerun_key(self.app.conf.get("fenced_secret_key"))

    def _rerun_trigger(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The trigger a call skipped on claim ``name`` leaves for the holder."""
        return _rerun.encode(args, kwargs, name, self._rerun_key(), self.name)

    def _rerun_call(
        self,
        claim: Claim,
        trigger: str,
        key: bytes | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | str | None:
        """The call one trigger asks for; None for one dropped (logged, counted); the
        task's name for a valid trigger another task sharing the name left (its own)."""
        try:  # OWN: the holder's own call
            task, _ = _rerun.decode(trigger, claim.name, key)
            if task not in (self.name, ""):
                return task
            call = _rerun.checked(
                trigger, claim.name, key, self.claim_name_for, (args, kwargs), self.name
            )
        except Exception as exc:  # this trigger alone: the run's outcome stands
            count("reruns_dropped")
            # Its text is not logged: a genuine call's arguments may be secret.
            log.warning(
                "fenced: dropped a rerun trigger of claim %r (%s; %d characters)",
                claim.name,
                _rerun.why(exc),
                len(trigger),
                extra=claim.log_fields(),
            )
            return None
        if key is None:
            _warn_unsigned(claim.name)
        return call

    def _send_reruns(self, claim: Claim, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Send the task once more for each distinct trigger that arrived during the run."""
        try:
            self._send_each_rerun(claim, args, kwargs)
        except Exception:  # never turn a run's outcome into a failure
            log.exception(
                "fenced: could not send the reruns asked for during a run of %r",
                claim.name,
                extra=claim.log_fields(),
            )

    def _send_each_rerun(self, claim: Claim, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """One rerun per distinct call of a release's triggers; each trigger leaves the
        name's sending set only once its rerun is published (a holder that dies first
        leaves it to the name's next release, which publishes it under the same id)."""
        options: dict[str, Any] = {}
        info = self.request.delivery_info or {}
        exchange, routing_key = info.get("exchange"), info.get("routing_key")
        if exchange == "" and routing_key:
            options["queue"] = routing_key
        elif routing_key:
            options.update(exchange=exchange, routing_key=routing_key)
        if info.get("priority") is not None:
            options["priority"] = info["priority"]
        # (task, call) -> (the task, the call, its triggers' fields); "" for a trigger
        # kept nowhere
        Call = tuple[tuple[Any, ...], dict[str, Any]]
        calls: dict[tuple[str, str], tuple[ClaimedTask, Call, list[str]]] = {}
        dropped: list[str] = []
        key = self._rerun_key()
        for field, trigger in claim.rerun_sending:
            task: ClaimedTask = self
            call = self._rerun_call(claim, trigger, key, args, kwargs)
            if isinstance(call, str):  # another task's on the name: sent as that task
                other = self.app.tasks.get(call)
                if not isinstance(other, ClaimedTask):  # not known here: for its release
                    if self._leave_rerun(claim, call, trigger):
                        dropped.append(field)
                    continue
                task, call = other, other._rerun_call(claim, trigger, key, args, kwargs)
                if isinstance(call, str):  # cannot be: the trigger names that task
                    continue
            if call is None:
                dropped.append(field)
                continue
            slot = (task.name, _rerun.call_text(*call))
            calls.setdefault(slot, (task, call, []))[2].append(field)
        self._sent(claim, dropped)
        ours = f"{(claim.token or '').split(':', 1)[0]}:"
        for task, (rerun_args, rerun_kwargs), fields in calls.values():
            kept = sorted(f for f in fields if f)
            # Named by this release's trigger when it took one (a rerun that runs after
            # now answers every earlier request for the call too), else by what an
            # earlier release left: the id it may have published under already.
            named = [f for f in kept if f.startswith(ours)] or kept
            try:
                sent = task.apply_async(
                    rerun_args,
                    rerun_kwargs,
                    task_id=_rerun.task_id(named[0]) if named else None,
                    headers={_rerun.HEADER: "1"},
                    **(options if task is self else {}),  # another task: its own route
                )
            except Exception:
                log.exception(
                    "fenced: could not send a rerun of %s asked for during a run of %r; "
                    "the request stays for the claim's next run",
                    task.name,
                    claim.name,
                    extra=claim.log_fields(),
                )
                if not kept:  # kept nowhere: hand it back, so the next holder runs it
                    try:
                        trigger = _rerun.encode(
                            rerun_args, rerun_kwargs, claim.name, key, task.name
                        )
                        claim.redis.sadd(claim.keys.rerun, trigger)
                    except Exception:
                        pass
                continue
            self._sent(claim, kept)
            count("reruns")
            log.info(
                "fenced: %s ran while a trigger asked for %s of %r: sent %s",
                self.name,
                "another run" if task is self else f"a run of {task.name}",
                claim.name,
                sent.id,
                extra=claim.log_fields(),
            )

    def _leave_rerun(self, claim: Claim, task: str, trigger: str) -> bool:
        """Put back in the name's rerun set a trigger another task sharing the name left,
        one this worker does not know: that task's next release of the name takes it.
        Whether it is back."""
        try:
            claim.redis.sadd(claim.keys.rerun, trigger)
            if claim.options.idle_ms:  # kept as a skip's trigger is: the idle expiry
                claim.redis.pexpire(claim.keys.rerun, claim.options.idle_ms)
        except Exception:  # kept in the sending set: the next release tries again
            log.warning(
                "fenced: could not leave a rerun of %s for its own release of %r",
                task,
                claim.name,
                exc_info=True,
            )
            return False
        log.info(
            "fenced: %s left a rerun asked for by %s on %r to that task's own release",
            self.name,
            task,
            claim.name,
            extra=claim.log_fields(),
        )
        return True

    def _sent(self, claim: Claim, fields: list[str]) -> None:
        """Delete triggers whose rerun is published (or that ask for none)."""
        fields = [f for f in fields if f]
        if not fields:
            return
        try:
            RERUN_SENT(claim.redis, [claim.keys.rerun_sending], fields)
        except Exception:  # left for the next release: published again, it runs once
            log.warning(
                "fenced: could not clear %d sent rerun trigger(s) of %r",
                len(fields),
                claim.name,
                exc_info=True,
                extra=claim.log_fields(),
            )

    # -- a retry keeps the claim ---------------------------------------------------------

    def _keep_for_retry(self, claim: Claim, retry: Retry) -> str:
        """The body asked for a retry (``self.retry()``, ``autoretry_for``): keep the lease.

        The retried message (same task id, same claim name) takes it over with a new
        fence (:meth:`_took_over`), so no duplicate runs during the countdown. The lease
        is kept, unrenewed, for the countdown plus the claim's ttl: if the retried
        message never comes, the name frees then. Returns the outcome recorded
        (``retried``, or ``lost`` when the lease was already gone); ``""`` when the lease
        is not kept (the claim was lost, an eager retry, a retry under another name):
        then it is released as any run's.
        """
        # An eager retry runs at once, inside this run: there is nothing to keep it for.
        # A name held by several at once (claim_limit) hands over no slot: its retry
        # queues for a free slot like any other run.
        if getattr(retry, "is_eager", False) or not claim.held or claim.limit > 1:
            return ""
        if self._retried_as(retry, claim) != claim.name:
            return ""  # retried with other arguments: another claim
        countdown = _seconds_until(self.app, retry.when)
        try:
            outcome = claim.hand_over(
                countdown + self._options().claim.ttl, reason=f"retrying in {countdown:.1f}s"
            )
        except Exception:
            log.exception(
                "fenced: could not keep claim %r for the retry",
                claim.name,
                extra=claim.log_fields("released", "retried"),
            )
            return ""
        if outcome:
            count(outcome)
        return outcome

    def _retried_as(self, retry: Retry, claim: Claim) -> str | None:
        """The claim name the retried message takes (its arguments may differ): the
        run's own when the retry carries no signature, None when it cannot be named."""
        sig: Any = getattr(retry, "sig", None)
        if sig is None:
            return claim.name
        try:
            return self.claim_name_for(sig.args or (), sig.kwargs or {})
        except Exception:
            return None

    # -- when the claim is not ours -----------------------------------------------------

    def _refused(self, claim: Claim, action: Skip | RetryAfter | Any, opts: TaskOptions) -> Any:
        """The call did not get its claim: a duplicate of a run that ended, or the busy
        policy's action (:meth:`_busy`). With ``until_started`` its ACQUIRE kept the
        name's queued mark (``"~"``): kept while its message is queued again (put back,
        or retried under the same name), so no duplicate is published meanwhile, and
        cleared here as the call ends unrun."""
        request = self.request
        try:
            if claim.completed_before and request.id:
                # Another run holds the name, and this task id already ran to the end:
                # a duplicate delivery, ignored as when the name is free.
                self._duplicate(claim, request.id)
            result = self._busy(claim, action, opts)
        except Retry as exc:
            if self._retried_as(exc, claim) != claim.name:
                self._unqueue_refused(claim, opts)
            raise
        except Ignore:
            if not getattr(request, "fenced_put_back", False):
                self._unqueue_refused(claim, opts)
            raise
        except BaseException:
            self._unqueue_refused(claim, opts)
            raise
        self._unqueue_refused(claim, opts)
        return result

    def _unqueue_refused(self, claim: Claim, opts: TaskOptions) -> None:
        """With ``until_started``: a call refused its claim ends unrun, its message gone
        from the queue; the name's queued mark goes with it while it holds its task id."""
        request = self.request
        if opts.enqueue == "until_started" and request.id and not request.called_directly:
            self._clear_queued(claim.keys, request.id, "as its call ends unrun")

    def _busy(self, claim: Claim, action: Skip | RetryAfter | Any, opts: TaskOptions) -> Any:
        """Carry out the busy policy's action: a skipped result, a retry, or ClaimHeld."""
        if claim.throttled is not None:
            return self._throttled(claim, opts)
        if claim.superseded is not None:
            return self._replaced(claim)  # a newer call replaced this task id before
        holder = claim.holder
        if isinstance(action, RetryAfter) and action.redelivered:
            # An earlier attempt of this very task died holding the claim and its
            # message came back: not a duplicate. Run once that lease has ended.
            count("redelivery_retries")
            log.info(
                "fenced: %s[%s] was redelivered while an earlier attempt's lease on %r "
                "runs (%.1fs left): retrying after it",
                self.name,
                claim.task_id,
                claim.name,
                holder.expires_in if holder and holder.expires_in else 0.0,
                extra=claim.log_fields(),
            )
            raise self.retry(
                countdown=action.seconds, max_retries=REDELIVERY_MAX_RETRIES, exc=action.error
            )
        # A window's skips are expected: they raise no alert.
        if claim.ran_recently is None:
            self._after_skip(claim, opts)
        if isinstance(action, RetryAfter):
            count("conflict_retries")
            if opts.values["claim_debounce"] is not None and _delivered(self.request):
                # its burst is taken: wait (not past its expires)
                raise _debounce.defer(self, action.seconds, claim.keys, str(action.error))
            raise self.retry(countdown=action.seconds, exc=action.error)
        if not isinstance(action, Skip):
            raise action.error
        count("skipped")
        skipped = action.skipped
        log.info(
            "fenced: %s skipped: %r %s%s",
            self.name,
            claim.name,
            skipped if claim.ran_recently is not None else skipped.reason,
            f" (held by {holder})" if claim.ran_recently is None else "",
            extra=claim.log_fields("skipped", "skipped"),
        )
        # A plain dict: what every result backend can store.
        return skipped.as_dict()

    def _throttled(self, claim: Claim, opts: TaskOptions) -> Any:
        """A call over ``claim_rate``: put back until the start booked for it (``delay``:
        not a retry, see :meth:`_put_back`), or skipped (``skip``)."""
        left = claim.throttled or 0.0
        if opts.values["claim_rate_policy"] == "skip":
            skipped = Skipped.of(claim)
            count("skipped")
            log.info("fenced: %s %s", self.name, skipped, extra=claim.log_fields("skipped"))
            return skipped.as_dict()
        count("throttled")
        if claim.booked is not None:
            countdown = claim.booked  # the start booked for it: its own, nobody else's
        else:
            # Calls put back together come back spread over one interval, not all at once.
            countdown = left + random.uniform(0.0, opts.claim.rate_us / 1e6)
        why = busy_error(claim)
        request = self.request
        if _delivered(request):
            expires = _debounce.expired_by(self, countdown)
            if expires is not None:  # put back, it would be discarded when it comes
                self._expire("its rate-limited start", countdown, expires, why, claim.keys, claim)
        log.info(
            "fenced: %s[%s] put back for %.3fs%s by claim_rate=%r: %s",
            self.name,
            claim.task_id,
            countdown,
            " (its booked start)" if claim.booked is not None else "",
            opts.values["claim_rate"],
            why,
            extra=claim.log_fields("throttled"),
        )
        if request.called_directly or request.is_eager:
            raise self.retry(countdown=countdown, exc=why)  # runs inline: nothing to put back
        self._put_back(countdown, why)

    def _put_back(self, countdown: float, why: Exception) -> NoReturn:
        """Send the running message back to the broker, due in ``countdown`` seconds,
        under its task id with its retry count unchanged, and end this delivery.

        Not a retry: it raises ``Ignore`` (the delivery is acknowledged; Celery logs
        "ignored" at INFO, not "retry: Retry in ..."), so ``max_retries``, ``on_retry``,
        the ``task_retry`` signal and the ``task-retried`` event never see it. While the
        message waits, its result reads ``RETRY`` (Celery's state for a task due to run
        again, as a countdown shows it) with ``why`` as its info: stored first, so a
        message that comes back and ends at once is never stored over, and a send that
        fails is stored over as the FAILURE it is. A result backend that cannot store
        that state (it is only shown) does not keep the message from being sent.
        """
        request = self.request
        ignored = request.ignore_result or self.ignore_result
        if request.id and (not ignored or self.store_errors_even_if_ignored):
            try:
                self.backend.mark_as_retry(request.id, why, request=request)
            except Exception as exc:
                log.warning(
                    "fenced: %s[%s] could not store its RETRY state (%s): put back all the same",
                    self.name,
                    request.id,
                    exception_text(exc),
                )
        _debounce.send_again(self, countdown)
        # queued again under its task id: its queued mark stays (_refused)
        setattr(request, "fenced_put_back", True)  # noqa: B010 - Context takes any field
        raise Ignore()

    def _expire(
        self,
        start: str,
        countdown: float,
        expires: datetime,
        why: Any,
        keys: ClaimKeys,
        claim: Claim | None = None,
    ) -> NoReturn:
        """End this delivery as Celery ends an expired message: its ``start`` (what it
        waits for, ``countdown`` seconds from now) comes after its ``expires``, so it is
        not published again only to be discarded then, and it never starts after it.

        What the call held goes first, so a caller that sees the result and calls again
        finds the name free of it: its rate booking (``claim``), with ``claim_enqueue``
        the name's queued mark while it holds this task id (with a debounce, the caller
        cleared its burst). Then, as Celery does for a message delivered past its
        expiry: its result reads ``REVOKED`` (``TaskRevokedError('expired')``), the
        ``task_revoked`` signal is sent with ``expired=True``, and the delivery ends with
        ``Ignore`` (acknowledged, logged "ignored" after fenced's line).
        """
        request = self.request
        opts = self._options()
        count("expired")
        log.info(
            "fenced: %s[%s] expired before %s: due in %.3fs, after its expires (%s): %s",
            self.name,
            request.id,
            start,
            countdown,
            expires.isoformat(),
            why if why else "it waits",
            extra=claim_fields(keys.name),
        )
        if claim is not None and claim.booked is not None:
            self._release_booking(claim, keys)
        if opts.enqueue is not None and request.id:  # (only while it holds its task id)
            self._clear_queued(keys, request.id, "as its message expired")
        ignored = request.ignore_result or self.ignore_result
        try:
            self.backend.mark_as_revoked(
                request.id or "",
                "expired",
                request=request,
                store_result=not ignored or self.store_errors_even_if_ignored,
            )
        except Exception as exc:
            log.warning(
                "fenced: %s[%s] could not store its REVOKED state (%s)",
                self.name,
                request.id,
                exception_text(exc),
            )
        task_revoked.send(sender=self, request=request, terminated=False, signum=None, expired=True)
        raise Ignore()

    def _release_booking(self, claim: Claim, keys: ClaimKeys) -> None:
        """Let go of the start booked for this call over the rate: it will never come
        for it. A failure is logged: the booking is void once its hold is over."""
        try:
            claim.unbook()
        except Exception:
            log.warning(
                "fenced: could not let go of the start booked for %s[%s] on %r; it is void "
                "after its hold",
                self.name,
                claim.task_id,
                keys.name,
                exc_info=True,
                extra=claim_fields(keys.name),
            )

    def _after_skip(self, claim: Claim, opts: TaskOptions) -> None:
        """Alert when the consecutive skips reach the threshold, and at each multiple."""
        skips, every = claim.skips, opts.alert_after
        if not every or skips < every or skips % every:
            return
        count("skips_exceeded")
        log.warning(
            "fenced: claim %r was skipped %d times in a row; held by %s. A run this long, "
            "or a stale claim? `fenced` can show its run records",
            claim.name,
            skips,
            claim.holder,
            extra=claim.log_fields("skipped", "skipped"),
        )
        signals.claim_skips_exceeded.send(
            sender=self, name=claim.name, skips=skips, holder=claim.holder
        )
        callback = opts.on_skips_exceeded
        if callback is not None:
            try:
                callback(sender=self, name=claim.name, skips=skips, holder=claim.holder)
            except Exception:
                log.exception(
                    "fenced: claim_on_skips_exceeded callback failed",
                    extra=claim.log_fields("skipped", "skipped"),
                )

    def _unavailable(self, exc: ClaimUnavailable, opts: TaskOptions) -> NoReturn:
        count("unavailable")
        retries = self.request.retries or 0
        delay = min(UNAVAILABLE_MAX_DELAY, opts.backoff * (2**retries))
        delay *= random.uniform(0.8, 1.2)  # spread the herd of tasks waiting for Redis
        log.warning(
            "fenced: %s; retrying %s in %.1fs",
            exc,
            self.name,
            delay,
            extra=claim_fields(exc.name or "", outcome="unavailable", event="unavailable"),
        )
        raise self.retry(exc=exc, countdown=delay, max_retries=opts.unavailable_retries)

    # -- a killed pool child ------------------------------------------------------------

    def release_dead_holder(
        self,
        task_id: str,
        pid: int,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        why: str,
        requeued: bool = False,
    ) -> Holder | None:
        """Release the claim that process ``pid`` held for ``task_id`` (it is dead).

        With ``claim_enqueue="until_finished"``, a message that is not ``requeued``
        (no ``acks_late`` with ``reject_on_worker_lost``) never runs again: its queued
        marker is cleared too, so the name takes a new message at once; a requeued one
        marks its name again for ``claim_enqueue_ttl``.
        """
        if not enabled(self.app):
            return None  # it held a local claim only
        opts = self._options()
        name = self.claim_name_for(args, kwargs)
        holder = None
        for slot in range(opts.claim.limit):  # the dead process's slot: its task id and pid say
            holder = force_release(
                lock_redis(self.app),
                name,
                namespace=opts.claim.namespace,
                task_id=task_id,
                pid=pid,
                host=HOST,
                outcome="aborted",
                reason=why,
                task=self.name,
                slot=slot,
            )
            if holder is not None:
                break
        if holder is not None:
            count("aborted")
            log.warning(
                "fenced: released claim %r of %s[%s]: %s",
                name,
                self.name,
                task_id,
                why,
                extra=claim_fields(name, holder.fence, holder.text, "aborted", event="released"),
            )
        if opts.enqueue == "until_finished":
            keys = ClaimKeys(opts.claim.namespace, name)
            if requeued:
                self._mark_requeued(keys, task_id, opts)
            else:
                self._clear_queued(keys, task_id, "as its process died")
        return holder

    def _mark_requeued(self, keys: ClaimKeys, task_id: str, opts: TaskOptions) -> None:
        """The dead run's message is queued again: its name is marked for it again,
        for claim_enqueue_ttl (the run kept the marker one lease ttl only, so it may be
        gone by now), unless another message's marker took its place."""
        try:
            expiry = _enqueue.expiry_ms(opts.enqueue_ttl, {})
            _enqueue.mark(lock_redis(self.app), keys, task_id, expiry, None)
        except Exception:  # the run's claim still keeps a second run out
            log.warning(
                "fenced: could not mark %r as queued again as its process died",
                keys.name,
                exc_info=True,
                extra=claim_fields(keys.name),
            )


#: The reason recorded for a delivery of a task id that already ran to the end.
DUPLICATE = "duplicate delivery of a completed task"
#: The publish options of a canvas's part (a group or chord member, a chord body, a chain
#: step, a call with callbacks): dropped in favour of another message, its canvas would
#: wait forever for its task id.
CANVAS_OPTIONS = ("chain", "chord", "group_id", "link", "link_error")


def _in_canvas(options: Mapping[str, Any]) -> bool:
    return any(options.get(k) is not None for k in CANVAS_OPTIONS)


def _debounced(task: ClaimedTask, task_id: Any, more: Any, options: Mapping[str, Any]) -> bool:
    """Whether a call of a debounced task joins a burst: not a canvas's part, nor one
    with its own task id (a retry, a deferred burst), due time or expiry; published as
    it is."""
    return not (
        task_id is not None
        or more
        or _in_canvas(options)
        or options.get("countdown") is not None
        or options.get("eta") is not None
        or options.get("expires") is not None
        or task.app.conf.task_always_eager
        or not enabled(task.app)
    )


def _delivered(request: Any) -> bool:
    """Whether a run is a delivered message's (not ``apply()``, nor a direct call)."""
    return bool(request.id) and not request.called_directly and not request.is_eager


def _seconds_until(app: Any, when: Any) -> float:
    """A retry's countdown in seconds, from its ``when`` (seconds, or an eta datetime)."""
    if isinstance(when, datetime):
        now: datetime = app.now()
        if when.tzinfo is None:
            now = now.replace(tzinfo=None)
        return max(0.0, (when - now).total_seconds())
    try:
        return max(0.0, float(when or 0))
    except (TypeError, ValueError):
        return 0.0


def _traced(task: ClaimedTask, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether Celery's tracer pushed this very call's request (a worker, ``apply()``).

    ``Task.__call__`` would then push a copy of it and call ``run``: the body runs as a
    plain task's does, with the tracer's request. Only when ``Task.__call__`` is the next
    ``__call__`` in the class's MRO (a mixin's own is never skipped).
    """
    cls = type(task)
    plain = cls.__dict__.get("_fenced_plain_call")
    if plain is None:
        after = cls.__mro__[cls.__mro__.index(ClaimedTask) + 1 :]
        plain = next((k.__dict__["__call__"] for k in after if "__call__" in k.__dict__), None)
        plain = plain is Task.__call__
        cls._fenced_plain_call = plain
    if not plain or request.called_directly:
        return False
    pushed_args, pushed_kwargs = request.args, request.kwargs or {}
    # The tracer calls ``task(*args, **kwargs)`` with the request's own objects.
    if pushed_args is None or len(pushed_args) != len(args):
        return False
    for pushed, given in zip(pushed_args, args):
        if pushed is not given:
            return False
    if not kwargs:
        return not pushed_kwargs
    return pushed_kwargs.keys() == kwargs.keys() and all(
        pushed_kwargs[k] is v for k, v in kwargs.items()
    )


def _no_claim(where: str) -> ConfigError:
    return ConfigError(
        f"{where} uses ClaimedTask but has no claim: name the resource two runs would "
        "collide on, e.g. claim='rebuild:{tenant}:{layer}'"
    )


def _raw_run(cls: type) -> Any:
    """The task's ``run`` as defined (function or staticmethod), None if abstract."""
    for klass in cls.__mro__:
        if "run" in klass.__dict__:
            run = klass.__dict__["run"]
            return None if klass is Task or run is Task.__dict__.get("run") else run
    return None

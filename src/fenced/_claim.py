"""Claim: an exclusive, self-renewing, fenced lease on a named resource in Redis.

A timeline of the race the claim exists for, and what each part does about it::

    t0      worker A acquires "rebuild:incidents"        fence 1001, lease 30 s
    t0+10   heartbeat renews A's lease (one pipelined EVALSHA for every claim of A)
    t0+12   A is paused (swap, a throttled container) ... no renewals
    t0+30   A's local deadline passes: A's claim is *lost* (A cannot know yet)
    t0+30   the lease expires in Redis; worker B acquires  fence 1002
    t0+41   A resumes: check() raises ClaimLost before A's next step; if A was mid-step
            and publishes anyway, the pointer has accepted 1002 and rejects 1001;
            A's release compares tokens and leaves B's lease alone.

Acquire is one atomic script (``SET NX PX`` plus minting the fence): never
check-then-set. Release and refresh compare the owner token first. Deadlines are on
``time.monotonic()``, measured from when a request was *sent*, minus a drift margin.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import redis

from . import events
from . import records as _records
from ._audit import claim_fields
from ._client import connect
from ._errors import ClaimLost, ClaimUnavailable, ConfigError, FencedError, NotOwner
from ._guard import (
    COOLDOWN_REASON,
    RAISE,
    RATE_REASON,
    REPLACED,
    RUN,
    SKIP_REASON,
    SKIP_RERUN_REASON,
    TAKEN_OVER,
    Action,
    BusyPolicy,
    Run,
    busy_error,
    ended_as,
    outcome_of,
    replaced_note,
    settle,
)
from ._heartbeat import Renewal
from ._heartbeat import heartbeat as _heartbeat
from ._held import HELD, IDLE, LOST, RELEASED, LeaseState, Snapshot
from ._lease import (
    UNREACHABLE,
    ClaimKeys,
    Holder,
    LeaseCalls,
    LeaseStore,
    NotReplicated,
    corrupt_key_error,
    current_pid,
    describe_client,
    fence_or_none,
    int_or_none,
    new_token,
    why_unreachable,
)
from ._options import ClaimOptions
from ._redact import SHORT_MAX, exception_text
from ._scripts import Call, as_text

__all__ = ["Claim", "ClaimState"]

log = logging.getLogger("fenced")
T = TypeVar("T")
_C = TypeVar("_C", bound="ClaimState")

#: How often a blocking acquire looks again while the holder's lease runs.
RETRY_INTERVAL = 0.05
_LATE = "granted after its own deadline; given back"
_UNREPLICATED = "not acknowledged by the replicas asked for; given back"
_VANISHED = "the lease was gone before release (evicted, failed over, or cleared)"
_UNCONFIRMED = "Redis could not be reached to confirm the lease at release"
#: How long a release keeps trying to reach Redis (never past the lease's deadline).
RELEASE_PATIENCE = 5.0
#: A release that gets one of these does not know whether the lease lasted.
_UNCONFIRMABLE: tuple[type[BaseException], ...] = (*UNREACHABLE, redis.ResponseError)
RELEASE_RETRY = 0.1
#: The cause a "lost" event gives (a short word, fit for a metrics label) for each reason.
_CAUSES = {
    LeaseState.expired_reason: "expired",
    LeaseState.taken_reason: "taken",
    _VANISHED: "vanished",
}


def loss_cause(reason: str) -> str:
    """The cause a loss's ``reason`` names, in a word: ``replaced`` (a newer run took the
    claim over: REPLACE's note), ``expired``, ``taken``, ``vanished``; any other
    reason is its own cause."""
    return "replaced" if reason.startswith(REPLACED) else _CAUSES.get(reason, reason)


class ClaimState(LeaseState):
    """The state of one lease and every decision about it that needs no I/O.

    :class:`Claim` (threads) and :class:`fenced.aio.Claim` (asyncio) are thin shells
    around it: they send the scripts, and hand what came back to the methods here.
    """

    def __init__(
        self,
        redis: Any,
        name: str,
        *,
        options: ClaimOptions | None = None,
        heartbeat: bool = True,
        on_lost: Callable[[Any], object] | None = None,
        task_id: str | None = None,
        record_extra: Mapping[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Any] = time.sleep,
        **given: Any,
    ) -> None:
        try:
            # A front end passes the options it checked once; a caller gives keywords.
            opts = ClaimOptions.of(given, base=options) if given or options is None else options
            redis = self._connect(redis)
        except ConfigError as exc:
            raise ConfigError(exc.message, name=name) from None
        super().__init__(opts.ttl, opts.refresh, clock)
        self.options = opts
        self.redis = redis
        # What events say of the front end (see fenced.events): set by _front_end().
        self._source = self._SOURCE
        self._task: Any = None
        #: How many holders the name may have at once, each in a slot of its own.
        self.limit = opts.limit
        self.replicas = opts.replicas
        self._bind_name(ClaimKeys.of(name, opts.namespace))
        self.namespace = opts.namespace
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        self.task_id = task_id
        self.records = opts.records
        # Written into every run record of this claim (e.g. the command a run executes).
        self.record_extra = dict(record_extra or {})
        #: More fields of every run record, encoded once (``records.encode_fields``).
        self.record_encoded = ""
        self.max_records = opts.max_records
        #: Seconds after a run that ended ``ok`` during which triggers skip (None: none).
        self.cooldown = opts.cooldown_seconds
        self._sleep = sleep
        #: The slot held (0 .. limit-1; always 0 for a limit of 1), None before a grant.
        self.slot: int | None = None
        self.holder: Holder | None = None
        self.skips = 0
        #: Seconds left of the cooldown window when the last acquire found the name ran
        #: recently (it is then not held by anyone), else None.
        self.ran_recently: float | None = None
        #: When the last replace found this claim's task id replaced by a newer call
        #: (``on_busy="replace"``: its retry or redelivery never takes the name again),
        #: the note that call left ("replaced by ..."), else None.
        self.superseded: str | None = None
        # Whether this claim takes its name under ``on_busy="replace"`` (set by ``enter``):
        # its takeover of a kept lease then refuses a task id a newer call replaced.
        self._replacing = False
        #: Seconds until the name's next start is allowed when the last acquire found it
        #: free but rate limited (``rate``), else None.
        self.throttled: float | None = None
        #: With a task id and a rate: how long (seconds) a start booked for a call over
        #: the rate holds past it; None books nothing (fenced.celery's
        #: ``claim_rate_policy="delay"`` books). See :attr:`booked`.
        self.booking: float | None = None
        #: Seconds until the start booked for this claim's task id, when the last acquire
        #: found the name rate limited and booked that start (or found it booked and not
        #: due yet); else None. That start is the task id's own: an acquire at it is
        #: granted, counted once, whoever else calls.
        self.booked: float | None = None
        #: Distinct triggers that asked for one more run: seen by a loser after its
        #: acquire (how many are waiting), taken by the holder at release.
        self.rerun_requested = 0
        self.rerun_triggers: list[str] = []
        #: Whether release takes the rerun triggers; a front end whose busy policy asks
        #: for no reruns leaves them (it would run calls nobody asked it for).
        self.takes_reruns = True
        #: What the last grant said of this claim's task id: True when a run of it had
        #: already ended ok (a duplicate delivery, flagged by its broker or not), False
        #: when not, None when the grant did not look (no task id, no redelivery window).
        self.completed_before: bool | None = None
        #: Whether the triggers taken stay in Redis (``keys.rerun_sending``) until the
        #: front end forgets each once its rerun is sent (``RERUN_SENT``);
        #: ``rerun_sending`` then pairs each trigger's field there ("" when it could not
        #: be kept) with the trigger.
        self.keeps_reruns = False
        self.rerun_sending: list[tuple[str, str]] = []
        #: True when release() found the lease already gone (evicted, failed over,
        #: cleared by an operator), or could not reach Redis to find out before the
        #: lease would have run out: the run is not known to have ended under the claim.
        self.vanished = False
        # The name's enqueue marker (Celery's ``claim_enqueue``), handled by the lease's
        # own scripts: what ACQUIRE does to it ("-" deletes, ms re-expire, "" nothing),
        # and whether RELEASE deletes it; ``unqueued`` once a RELEASE answered that did.
        self._queued_op = ""
        self._unqueue = False
        self.unqueued = False
        self._bind_store()

    def for_call(
        self: _C,
        name: str,
        task_id: str | None,
        record_extra: dict[str, Any],
        on_lost: Callable[[Any], object] | None = None,
        record_encoded: str = "",
    ) -> _C:
        """A new claim as this one was made, for another ``name`` (checked already: a
        name a :class:`fenced._naming.Namer` gave), ``task_id``, ``record_extra`` (taken
        as it is, not copied), ``on_lost`` and ``record_encoded`` (fields every call's
        records share, as ``records.encode_fields`` made them once).

        A front end that takes a claim per call (a Celery task's runs) keeps one claim,
        never acquired, made with its client and options, and copies it for each call:
        what every call shares (the client, the options, what they derive) is not worked
        out again, and only what differs per call is made anew.
        """
        new = object.__new__(type(self))
        fields = new.__dict__
        fields.update(self.__dict__)
        fields.pop("_holder_text", None)
        new._bind_name(ClaimKeys(self.namespace, name))
        new._bind_store()
        new.task_id = task_id
        new.record_extra = record_extra
        new.record_encoded = record_encoded
        new.on_lost = on_lost
        new._mutex = threading.Lock()
        new._pid = current_pid()
        new.rerun_triggers = []
        new.rerun_sending = []
        return new

    def _bind_name(self, keys: ClaimKeys) -> None:
        """What the claim derives from its name's keys (``limit`` and ``options`` set)."""
        self.keys = keys
        self.name: str = keys.name
        self.key: str = keys.lock
        self._lease_key = self.key
        #: The bounded name of this kind of claim in events and log fields: the label
        #: given, else the name (a front end passes its template or callable's name).
        self.label: str = self.options.label if self.options.label is not None else self.name
        # What each renewal keeps from expiring while the name is held.
        self._lasting = keys.lasting(self.limit) if self.options.idle_ms else ()

    _SOURCE = "claim"
    #: What runs under the claim, as loss messages name it.
    _what = "the block"

    def _connect(self, redis: Any) -> Any:
        """The client this front end talks through (a URL becomes one)."""
        raise NotImplementedError

    def _front_end(self, source: str, task: Any = None) -> None:
        """Name the front end this claim's events come from (``ClaimEvent.source``), and
        for a Celery task, the task instance (``ClaimEvent.task``)."""
        self._source = source
        self._task = task

    # -- events and log fields --------------------------------------------------------

    # (the token, the token after its random part, its holder text): the part after the
    # random one is the same for every token of one claim in one process, so an event
    # per acquire and release parses it once; the events of one lease reuse the text.
    _holder_text: tuple[str, str, str] | None = None

    def _own_holder(self) -> str | None:
        token = self.token
        if not token:
            return None
        known = self._holder_text
        if known is not None and known[0] is token:
            return known[2]
        who = token.partition(":")[2]
        text = known[2] if known is not None and known[1] == who else Holder.parse(token).text
        self._holder_text = (token, who, text)
        return text

    def log_fields(self, event: str | None = None, outcome: str | None = None) -> dict[str, Any]:
        """The ``fenced_*`` fields of a log line about this claim, for ``extra=``: its
        name, label, fence and holder (this process, once it acquired; before, the
        holder that made it busy), and the ``event`` and ``outcome`` given."""
        if self.token is not None:
            fence, holder = self.fence, self._own_holder()
        else:
            other = self.holder
            fence, holder = (other.fence, other.text) if other else (None, None)
        return claim_fields(self.name, fence, holder, outcome, self.label, event)

    # ClaimEvent's fields in order: kind, name, label, source, fence, holder, outcome,
    # reason, duration, slot, task, time.

    def _emit(
        self,
        kind: str,
        fence: int | None = None,
        holder: str | None = None,
        outcome: str | None = None,
        reason: str | None = None,
        duration: float | None = None,
        slot: int | None = None,
    ) -> None:
        """Send one event (callers check ``events.enabled()`` first: building costs)."""
        events.emit(
            events.ClaimEvent(
                kind,
                self.name,
                self.label,
                self._source,
                fence,
                holder,
                outcome,
                reason,
                duration,
                slot,
                self._task,
                time.time(),
            )
        )

    def _emit_held(
        self,
        kind: str,
        outcome: str | None = None,
        reason: str | None = None,
        duration: float | None = None,
        lease: tuple[str | None, int | None, int | None] | None = None,
    ) -> None:
        """An event about the lease this process holds (its fence, slot and holder), or
        about ``lease`` (its token, fence and slot) when given."""
        if lease is None:
            token, fence, slot = self.token, self.fence, self.slot
        else:
            token, fence, slot = lease
        known = self._holder_text
        holder = known[2] if known is not None and known[0] is token else self._own_holder()
        self._emit(kind, fence, holder, outcome, reason, duration, slot if self.limit > 1 else None)

    def renewal_event(self, duration: float, error: BaseException | None = None) -> None:
        """A renewal round trip of ``duration`` seconds ended (``error``: it failed)."""
        if not events.enabled():
            return
        if error is not None:
            reason = exception_text(error, SHORT_MAX)
            self._emit_held("renewal_failed", None, reason, duration)
        elif self._mine():
            self._emit_held("renewed", None, None, duration)

    def _busy_event(self, rerun: bool | str) -> None:
        """An acquire found the name busy (or run recently) and gave up: "skipped"; or
        rate limited: "throttled"."""
        if self.throttled is not None:
            self._emit("throttled", reason=RATE_REASON, duration=self.throttled)
            return
        holder = self.holder
        if holder is not None and self.task_id and holder.task_id == self.task_id:
            return  # an earlier attempt of this very task: not a competitor (see ACQUIRE)
        if self.ran_recently is not None:
            reason = COOLDOWN_REASON
        else:
            reason = SKIP_RERUN_REASON if rerun else SKIP_REASON
        if holder is None:
            self._emit("skipped", reason=reason)
        else:
            self._emit("skipped", holder.fence, holder.text, reason=reason)

    def _released_event(self, outcome: str) -> None:
        outcome = ended_as(outcome, self.vanished)
        held_for = self._clock() - self._started_at
        self._emit_held("released", outcome, None, held_for if held_for > 0.0 else 0.0)

    def handle_enqueue_marker(self, on_acquire: str, on_release: bool) -> None:
        """Let the lease's own scripts handle the name's enqueue marker while it holds
        this claim's ``task_id`` (``fenced.celery``'s ``claim_enqueue``), sparing the
        run a round trip for each: on each acquire, ``"-"`` deletes it, ``"~"`` deletes
        it only when the acquire is granted (a call refused keeps it for the message it
        puts back), and a number of ms gives it that expiry (``""``: nothing); with
        ``on_release``, each renewal
        keeps it alive one ttl and the release deletes it (``unqueued`` then says it
        was done)."""
        self._queued_op = on_acquire
        self._unqueue = on_release

    _store: LeaseCalls

    def _bind_store(self) -> None:
        """Make the store this claim sends its scripts through."""
        raise NotImplementedError

    # -- state (reading it never acts: LeaseState's held, lost, lost_reason, expires_in) --

    def __bool__(self) -> bool:
        return self.held

    def __repr__(self) -> str:
        return f"<Claim {self.name!r} {self._state} fence={self.fence}>"

    @property
    def lost_cause(self) -> str | None:
        """Why the lease was lost, in a word (:func:`loss_cause`: ``replaced`` when a newer
        run took it over); None while it was not. Kept after the release, as
        ``lost_reason`` is."""
        reason = self.lost_reason
        return None if reason is None else loss_cause(reason)

    # -- check -------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ClaimLost once the claim is lost; NotOwner if it is not held at all."""
        if self._mine():
            if self._clock() < self._deadline:
                return
            self._declare_lost(self.expired_reason)
        if self._state == LOST:
            raise ClaimLost.about(
                self,
                f"claim {self.name!r} was lost ({self.lost_reason}); stop writing: another "
                "holder may be working on the same resource",
            )
        raise NotOwner.about(
            self,
            f"claim {self.name!r} is not held here ({self._state}"
            + (", inherited across fork" if self._pid != current_pid() else "")
            + "): acquire it first",
        )

    def steps(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield each item after checking the claim; check once more after the last."""
        for item in iterable:
            self.check()
            yield item
        self.check()

    # -- what the heartbeat asks and tells (fenced._heartbeat.Renewable) -------------------

    def renewal(self) -> Renewal | None:
        """The lease to renew now, or None when this process does not hold it."""
        with self._mutex:
            if not self._mine() or self.token is None:
                return None
            return Renewal(
                self.redis,
                self._lease_key,
                self.token,
                self._ttl_ms,
                self.refresh_every,
                self._next_refresh,
                self._deadline,
                self._lasting,
                self.options.idle_ms,
                self.replicas,
                self.options.replica_ms,  # the heartbeat keeps it below its socket timeout
                self.keys.replaced if self.limit == 1 else "",
                self._marker(),
            )

    def _marker(self) -> tuple[str, str] | None:
        """The enqueue marker each renewal keeps alive (``until_finished``), if any."""
        if self._unqueue and self.task_id:
            return self.keys.queued, self.task_id
        return None

    def _snapshot(self) -> Snapshot:
        return Snapshot(self.token, self.fence, self.slot, self._started_at)

    def _report_lost(self, reason: str, lease: Snapshot) -> None:
        # Not discarded from the heartbeat here: it drops claims no longer held by
        # itself, and a discard from this (maybe another) thread could remove the entry
        # of a lease this object acquired again meanwhile.
        log.warning(
            "fenced: claim %r (fence %s) lost: %s",
            self.name,
            lease.fence,
            reason,
            extra=self.log_fields("lost", "lost"),
        )
        if events.enabled():
            self._emit_lost(reason, lease)
        self._stop_work()
        if self.on_lost is not None:
            try:
                self.on_lost(self)
            except Exception:
                log.exception(
                    "fenced: on_lost callback for %r failed",
                    self.name,
                    extra=self.log_fields("lost", "lost"),
                )

    def _emit_lost(self, reason: str, lease: Snapshot | None = None) -> None:
        if lease is None:
            lease = self._snapshot()
        held_for = self._clock() - lease.started_at
        cause = loss_cause(reason)
        self._emit_held("lost", None, cause, held_for if held_for > 0.0 else 0.0, lease[:3])

    def _stop_work(self) -> None:
        """The claim was just declared lost: a front end's hook to stop the work under it."""

    # -- what acquire decides (no I/O) ---------------------------------------------------

    def _check_acquire(self, timeout: float | None) -> None:
        if self._mine():
            raise FencedError.about(
                self,
                f"claim {self.name!r} is already held by this object: release it first, "
                "or use a second Claim",
            )
        if timeout is not None and timeout < 0:
            raise ConfigError(f"timeout={timeout!r} must be >= 0 or None", name=self.name)

    def _gave_up(self, give_up: float | None) -> bool:
        """Whether a blocking acquire's timeout has passed."""
        return give_up is not None and self._clock() >= give_up

    def _retry_wait(self, now: float, give_up: float | None) -> float:
        """How long a blocking acquire waits before it looks again."""
        if self.booked is not None:
            wait = self.booked  # a start of our own: nobody else takes it
        elif self.throttled is not None:
            # Rate limited: the next start is allowed then (spread: others wait for it too).
            wait = self.throttled * random.uniform(1.0, 1.1)
        else:
            left = self.holder.expires_in if self.holder and self.holder.expires_in else 0.0
            wait = min(RETRY_INTERVAL, left) if left > 0 else RETRY_INTERVAL
            wait *= random.uniform(0.5, 1.0)  # spread contenders so they do not stampede
        if give_up is not None:
            wait = min(wait, give_up - now)
        return max(wait, 0.001)

    def _started(self) -> str:
        """The "started" record of a grant (it serves as the "skipped" one when busy)."""
        if not self.records:
            return ""
        return _records.encode_started(self.task_id, self.record_extra, self.record_encoded)

    def _acquire_call(self, token: str, record_skip: bool, mark_rerun: bool | str) -> Call:
        """ACQUIRE for one try under ``token``."""
        trigger = mark_rerun if isinstance(mark_rerun, str) else ("*" if mark_rerun else "")
        skip = (SKIP_RERUN_REASON if mark_rerun else SKIP_REASON) if record_skip else ""
        # A lease held under our own task id is an earlier attempt of this task (a
        # redelivery), not a competitor: no skip, no rerun request.
        booking = max(1, round(self.booking * 1000)) if self.booking is not None else 0
        return self._store.acquire_call(
            token,
            self._started(),
            skip,
            trigger,
            self.task_id,
            COOLDOWN_REASON,
            self._queued_op,
            booking,
        )

    def _replace_call(self, token: str) -> Call:
        """REPLACE for one try under ``token``: its note names this run to the holder."""
        why = replaced_note(token)
        return self._store.replace_call(
            token, self._started(), self.task_id or "", why, COOLDOWN_REASON, self._queued_op
        )

    def _check_replace(self) -> None:
        if self.options.rate_us:
            raise ConfigError(
                f"replace does not take a rate (this claim has rate={self.options.rate!r}): "
                "a replacing run starts whenever it is called. Use another busy policy "
                "with a rate",
                name=self.name,
            )
        # REPLACE takes the plain lease key: which of several slots to take is not known.
        if self.limit > 1:
            raise ConfigError(
                f"replace works on a claim of limit 1 only (this one has limit={self.limit}): "
                "which of the running holders a new run would replace is ambiguous",
                name=self.name,
            )

    def _takeover_call(self, token: str) -> Call:
        """TAKEOVER for one try under ``token`` (a free name within the cooldown window is
        not taken; a kept lease is)."""
        return self._store.takeover_call(
            token,
            self._started(),
            self.task_id or "",
            COOLDOWN_REASON,
            self._queued_op,
            self._replacing,
        )

    def _unavailable(self, exc: BaseException) -> ClaimUnavailable:
        """ClaimUnavailable for an acquire that could not reach Redis, or that it refused
        (and its "unavailable" event)."""
        if events.enabled():
            self._emit("unavailable", reason=exception_text(exc, SHORT_MAX))
        if isinstance(exc, redis.ResponseError):
            # A replica after a failover (READONLY), a full server (OOM), a busy script:
            # the store cannot grant the claim, which is unavailability, not a bug here.
            return ClaimUnavailable(
                f"Redis at {describe_client(self.redis)} refused to grant claim "
                f"{self.name!r} ({exc}); the work was not started (fail closed). "
                "Check that the URL names the master and that it has memory to spare "
                "(fenced doctor)",
                name=self.name,
            )
        return ClaimUnavailable(
            f"cannot reach Redis at {describe_client(self.redis)} to acquire claim "
            f"{self.name!r} ({why_unreachable(exc)}); the work was not started (fail closed)",
            name=self.name,
        )

    def _refused(self, exc: BaseException, corrupt: tuple[str, str] | None) -> ClaimUnavailable:
        """The error for an ACQUIRE Redis answered with an error: CorruptKey when a key
        of the name holds what fenced never writes, else :meth:`_unavailable`."""
        if corrupt is None:
            return self._unavailable(exc)
        return corrupt_key_error(self.name, *corrupt, exc)

    def _late(self, res: list[Any], sent: float) -> float | None:
        """Seconds the grant took when it came after the lease's own local deadline."""
        # A stalled or paused Redis, a client retrying through an outage: another holder
        # may take the name any moment, so a late grant is given back and starts nothing.
        if int(res[0]) == 1 and self._clock() >= self._deadline_from(sent):
            return self._clock() - sent
        return None

    def _granted_slot(self, res: list[Any]) -> int:
        """The slot an ACQUIRE that granted the claim gave (0 for a limit of 1)."""
        return int(res[2]) if self.limit > 1 else 0

    def _give_back_call(self, token: str, res: list[Any], why: str, elapsed: float) -> Call:
        """RELEASE of a grant we must not use (its run record says why): its rerun
        triggers are for whoever holds the name next, and it starts no window."""
        record = self._finished_record(elapsed, why)
        slot = self._granted_slot(res)
        return self._store.release_call(
            token, record, "lost", int(res[1]), take_reruns=False, slot=slot, window=False
        )

    def _unreplicated(self, res: list[Any]) -> int | None:
        """How many replicas acknowledged a grant, when fewer than asked for."""
        if int(res[0]) == 1 and self.replicas and int(res[-1]) < self.replicas:
            return int(res[-1])
        return None

    def _unreplicated_error(self, acked: int) -> ClaimUnavailable:
        # The master wrote the lease, but a failover now could forget it: it was given
        # back and nothing started (fail closed).
        return ClaimUnavailable(
            f"Redis at {describe_client(self.redis)} granted claim {self.name!r}, but "
            f"only {acked} of the {self.replicas} replica(s) asked for "
            f"acknowledged it within {self.options.replica_ms / 1000:g} s; the lease was "
            "removed and the work was not started (fail closed). Check the replicas "
            "(INFO replication), or lower replicas=",
            name=self.name,
        )

    def _late_error(self, late: float) -> ClaimUnavailable:
        return ClaimUnavailable(
            f"Redis at {describe_client(self.redis)} granted claim {self.name!r} after "
            f"its own deadline ({late:.2f}s for a {self.ttl:g}s lease); it was given back "
            "and the work was not started (fail closed)",
            name=self.name,
        )

    def _took(self, token: str, res: list[Any], sent: float, replace: bool = False) -> bool:
        """Take in the answer of an ACQUIRE (or a TAKEOVER, a REPLACE) sent at ``sent``:
        True if the claim is ours."""
        # TAKEOVER and REPLACE read the done marker as ACQUIRE does, and answer it alike.
        self.superseded = None
        if int(res[0]) == 1:
            slot = self._granted_slot(res)
            with self._mutex:
                self.slot = slot
                self._lease_key = self.key if slot == 0 else self.keys.slot(slot)
                self.holder = None
                self.ran_recently = self.throttled = self.booked = None
                self.vanished = False
                self.rerun_triggers = []
                asked = self._store.asks_done(self.task_id)
                self.completed_before = bool(int(res[3])) if asked else None
                self.rerun_sending = []
                self._hold(token, int(res[1]), sent)
            if events.enabled():
                self._emit_held("acquired")
            return True
        # ACQUIRE's reply ends at a value Lua could not read as a number (a fence or
        # skip count someone else wrote): what is missing is unknown, the lease is held.
        pttl, fence, skips, rerun = (*res[2:6], None, None, None, None)[:4]
        code = int_or_none(res[0])
        # Only a busy answer (0) carries the done marker; "ran recently" and "rate
        # limited" (2, 3, 4) never do, and what follows them with replicas is the count
        # of replicas that acknowledged.
        asked = code in (0, 5) and self._store.asks_done(self.task_id) and len(res) > 6
        self.completed_before = bool(int_or_none(res[6])) if asked else None
        self.skips = int_or_none(skips) or 0
        self.rerun_requested = int_or_none(rerun) or 0
        # rate limited (3), with a start booked for this task id (4)
        self.throttled = (int_or_none(pttl) or 0) / 1000 if code in (3, 4) else None
        self.booked = self.throttled if code == 4 else None
        if code == 5:  # REPLACE: a newer call replaced this task id, which never runs again
            self.holder = None
            self.ran_recently = None
            self.superseded = as_text(res[1])
            return False
        if code in (2, 3, 4):  # nobody holds it: ran recently, or rate limited
            self.holder = None
            self.ran_recently = (int_or_none(pttl) or 0) / 1000 if code == 2 else None
            return False
        self.ran_recently = None
        self.holder = Holder.parse(res[1], int_or_none(pttl), fence_or_none(fence))
        return False

    def _held_unreadably(self) -> bool:
        """ACQUIRE's reply named a holder that could not be decoded: busy, held by someone
        unknown (a lease whose value we cannot read is never taken)."""
        self.holder = Holder.unknown("the lease's value is not UTF-8")
        self.ran_recently = self.throttled = self.booked = self.superseded = None
        self.skips = self.rerun_requested = 0
        return False

    def _refresh_unavailable(self, exc: BaseException) -> ClaimUnavailable:
        return ClaimUnavailable.about(
            self,
            f"cannot reach Redis at {describe_client(self.redis)} to refresh claim "
            f"{self.name!r} ({why_unreachable(exc)})",
        )

    # -- what release decides (no I/O) -----------------------------------------------

    def _releasable(self) -> bool:
        # A forked child never releases its parent's lease: the token is the parent's.
        return not (
            self._pid != current_pid() or self.token is None or self._state in (IDLE, RELEASED)
        )

    def _begin_release(self, outcome: str | None, reason: str | None) -> tuple[str, str, str]:
        """Mark the claim given back: (the state before, the outcome, the finished record)."""
        # One look at the clock: a lease whose deadline passed by then is lost (and says
        # why); one held then ends with no loss to tell, whatever the clock says after.
        now = self._clock()
        self._expire_if_due(now)
        if outcome is None:
            outcome = "lost" if self._state == LOST else "ok"
        record = self._finished_record(now - self._started_at, reason or self._lost_reason)
        return self._end_hold(), outcome, record

    def _release_give_up(self, before: str) -> float:
        """Until when (``time.monotonic()``) a release that cannot reach Redis tries again."""
        # Until the lease would run out anyway (and at most RELEASE_PATIENCE), a release
        # that cannot reach Redis is tried again: only an answer says whether the lease
        # lasted (a Redis restarted without persistence has forgotten it), and "ok" must
        # not be said unconfirmed. A retry of a release that did land gets its answer.
        patience = min(max(0.0, self._deadline - self._clock()), RELEASE_PATIENCE)
        return time.monotonic() + (patience if before == HELD else 0.0)

    def _release_call(self, outcome: str, record: str) -> Call:
        """RELEASE of this claim's lease."""
        assert self.token is not None
        return self._store.release_call(
            self.token,
            record,
            outcome,
            self.fence,
            self.task_id,
            take_reruns=self.takes_reruns,
            slot=self.slot or 0,
            unqueue=self._unqueue,
            keep_reruns=self.keeps_reruns,
        )

    def _release_unconfirmed(self, exc: BaseException, outcome: str) -> None:
        """No answer (or a replica's) to the release of a run that ended with ``outcome``:
        whether the lease lasted is unknown."""
        self.vanished = True
        self._lost_reason = f"{_UNCONFIRMED} ({exc})"
        log.warning(
            "fenced: could not release %r at %s (%s); it expires within %.1fs",
            self.name,
            describe_client(self.redis),
            exc,
            self.ttl,
            extra=self.log_fields("released", ended_as(outcome, True)),
        )
        if events.enabled():
            self._released_event(outcome)

    def _release_undone(self, before: str) -> None:
        """The release was interrupted: not given back, and release() may be called again."""
        with self._mutex:
            self._state = before

    def _ended(
        self,
        before: str,
        outcome: str,
        released: bool,
        recorded: str,
        triggers: list[str],
        replaced: str | None = None,
    ) -> bool:
        """Take in the answer of a RELEASE; returns ``released``. ``replaced``: why a
        newer run took the lease over (REPLACE's note, as a renewal reads it), when the
        release found it gone for that."""
        self.unqueued = self._unqueue
        if self.keeps_reruns and triggers:
            self.rerun_sending = list(zip(triggers[::2], triggers[1::2], strict=False))
            triggers = [trigger for _field, trigger in self.rerun_sending]
        elif self.keeps_reruns:
            self.rerun_sending = []
        self.rerun_triggers = triggers
        self.rerun_requested = len(triggers)
        lost_first = before == LOST and outcome == "ok"
        if lost_first or recorded != outcome or (not released and before == HELD):
            # Ours until the end as far as the caller knew, but it was not: lost before
            # the release, or Redis had no lease for us when it came.
            self.vanished = True
            # Replaced: the cause a renewal would have found, had one run before the end.
            found = replaced or _VANISHED
            if self._lost_reason is None or before == HELD or replaced:
                self._lost_reason = found
            if before == HELD and events.enabled():
                # Found gone only now: the loss is known here, not by the heartbeat.
                self._emit_lost(found)
        if events.enabled():
            self._released_event(outcome)
        return released

    # -- what the drivers (enter, end) decide -------------------------------------------

    def _acquire_as(self, policy: BusyPolicy) -> tuple[bool, float | None]:
        """How ``policy`` acquires: (blocking, timeout)."""
        return policy.blocks, policy.timeout if policy.blocks else None

    def _kept_for_us(self) -> bool:
        """Whether the holder is an earlier attempt of this task id, which may have kept
        the lease for this attempt (``hand_over``): one slot names no such lease."""
        holder = self.holder
        return (
            holder is not None
            and bool(self.task_id)
            and holder.task_id == self.task_id
            and self.limit == 1
        )

    def _ending(
        self, exc: BaseException | None, outcome: str | None, reason: str | None
    ) -> tuple[str, str | None]:
        """The outcome to release with: the front end's, else from how the work ended."""
        return (outcome, reason) if outcome is not None else outcome_of(self, exc, reason)

    def _release_failed(self) -> None:
        """A release raised: the run's own outcome is never hidden behind it, and whether
        the lease lasted is unknown (the vanished rule makes ``ok`` into ``lost``)."""
        log.exception(
            "fenced: releasing claim %r failed", self.name, extra=self.log_fields("released")
        )
        self.vanished = True
        if self._lost_reason is None:
            self._lost_reason = _UNCONFIRMED

    def _finished_record(self, duration: float, reason: str | None) -> str:
        if not self.records:
            return ""
        return _records.encode_finished(self.task_id, duration, reason)


class Claim(ClaimState):
    """An exclusive, self-renewing lease on one named resource, with a fencing token.

    ::

        with Claim(client, "rebuild:acme:roads", ttl=60) as claim:   # ClaimHeld if busy
            for step in claim.steps(plan):                            # ClaimLost if lost
                step.run(fence=claim.fence)

    The skip idiom is explicit: ``if claim.acquire(): with claim: ...`` (a claim already
    acquired enters without acquiring again); ``claim.holder`` then says who has it.

    Parameters:
        redis: the Redis client that holds claims (``redis.Redis``, a Cluster client).
        name: the resource two runs would collide on, e.g. ``"rebuild:acme:roads"``;
            unsafe names are made safe (see ``fenced.claim_name``), and ``claim.name``
            is the name used.
        options: a :class:`fenced.ClaimOptions`, or its fields as keywords (``ttl=60``,
            ``refresh_every``, ``namespace``, ``records``, ``max_records``, ``idle_ttl``,
            ``redelivery_window``, ``replicas``, ``replica_timeout``, ``limit``,
            ``cooldown``, ``label``); keywords given with ``options`` change those.
        heartbeat: renew in the background while held (off: call ``refresh()``).
        on_lost: called once (from the heartbeat thread, or from ``check()``) when the
            claim is lost; reading ``lost`` or ``held`` never calls it.
        task_id: the Celery task id this claim runs for: carried in the token, so a
            redelivered message of the same task is known as itself.
        record_extra: fields written into every run record of this claim.
        clock, sleep: time seams for tests (``time.monotonic``, ``time.sleep``).
    """

    _store: LeaseStore

    def _connect(self, redis: Any) -> Any:
        return connect(redis)

    def _bind_store(self) -> None:
        self._store = LeaseStore(self.redis, self.keys, self.options)

    # -- acquire ----------------------------------------------------------------------

    def acquire(
        self,
        blocking: bool = False,
        timeout: float | None = None,
        *,
        request_rerun: bool | str = False,
    ) -> bool:
        """Take the claim; non-blocking by default. Raises ClaimUnavailable if Redis is down.

        With ``request_rerun``, losing the race asks the holder for one more run after
        its own: a string names the trigger (e.g. the arguments to run with), and the
        holder takes every distinct trigger at release (``Claim.rerun_triggers``);
        equal triggers, and every ``True``, coalesce into one.
        """
        self._check_acquire(timeout)
        give_up = None if timeout is None else self._clock() + timeout
        record_skip = not blocking
        while True:
            if self._try_acquire(record_skip, mark_rerun=request_rerun):
                return True
            # A window is not waited out: it is a skip.
            if not blocking or self.ran_recently is not None or self._gave_up(give_up):
                if events.enabled():
                    self._busy_event(request_rerun)
                return False
            self._sleep(self._retry_wait(self._clock(), give_up))

    def _try_acquire(
        self,
        record_skip: bool,
        mark_rerun: bool | str = False,
        takeover: bool = False,
        replace: bool = False,
    ) -> bool:
        token = new_token(self.task_id)
        sent = self._clock()
        try:
            if replace:
                res = self._store.grant(self._replace_call(token))
            elif takeover:
                res = self._store.grant(self._takeover_call(token))
            else:
                res = self._store.grant(self._acquire_call(token, record_skip, mark_rerun))
        except UNREACHABLE as exc:
            if isinstance(exc, redis.TimeoutError):
                # Only a request that was sent can have landed; a refused connection
                # sent nothing, and cleaning up after it would only wait out the
                # client's retries a second time.
                self._store.abandon(token)
            raise self._unavailable(exc) from exc
        except redis.ResponseError as exc:
            # A script stopped at a key holding what fenced never writes (a fence that
            # is not an integer) may have set the lease first: give it back.
            self._store.abandon(token)
            raise self._refused(exc, self._store.find_corrupt_key()) from exc
        except UnicodeDecodeError:  # a client that decodes replies: only a holder is text
            return self._held_unreadably()
        acked = self._unreplicated(res) if self.replicas else None
        if acked is not None:
            self._give_back(token, res, _UNREPLICATED, self._clock() - sent)
            raise self._unreplicated_error(acked)
        late = self._late(res, sent)
        if late is not None:
            self._give_back(token, res, _LATE, late)
            raise self._late_error(late)
        if not self._took(token, res, sent, replace):
            return False
        if self.heartbeat:
            _heartbeat().add(self)
        return True

    def replace(self) -> bool:
        """Take the claim now, from whoever holds it (``on_busy="replace"``): the newest
        run wins, with a fence above the holder's, never waiting for it.

        The holder's run is recorded ``lost`` ("replaced by" this run), and the holder
        learns it at its next renewal (``ClaimLost``, as any lost claim). A free name is
        taken as :meth:`acquire` takes it (not within a cooldown window: then False and
        ``ran_recently``); a holder carrying this claim's own task id (an earlier attempt
        of the same task) is not replaced: then False, and ``holder`` says who has it.
        Limit 1 only.
        """
        self._check_acquire(None)
        self._check_replace()
        return self._try_acquire(False, replace=True)

    def take_over(self) -> bool:
        """Take the lease an earlier attempt of this task id kept for it (``hand_over``).

        A free name is taken too, unless a run ended ``ok`` within the claim's cooldown
        window (then False and ``ran_recently``, as :meth:`acquire`); a lease held by
        anyone else, or by an attempt of the same task id that did not hand it over (it
        may still be running), is not: then False, and ``holder`` says who has it. The
        fence is a new one, minted as :meth:`acquire` mints it.
        """
        self._check_acquire(None)
        self._check_handover("take_over")
        if not self.task_id:
            raise ConfigError(
                "take_over() needs the claim's task_id: only a lease kept for the same "
                "task id can be taken over",
                name=self.name,
            )
        return self._try_acquire(False, takeover=True)

    def _check_handover(self, what: str) -> None:
        # HANDOVER and TAKEOVER keep and take the plain lease key; a slot is not handed on.
        if self.limit > 1:
            raise ConfigError(
                f"{what}() works on a claim of limit 1 only (this one has limit="
                f"{self.limit}): release the slot and acquire again instead",
                name=self.name,
            )

    def hand_over(self, keep_for: float, reason: str | None = None) -> str:
        """End this run and keep the lease ``keep_for`` seconds for a later attempt of
        the same task id to take over (``take_over``); no longer renewed from here on.

        Returns the outcome recorded: ``retried`` when the lease was kept, ``lost`` when
        it was gone (or Redis could not confirm it; it then expires within its ttl).
        Not held (lost, released): nothing is done and ``""`` comes back.
        """
        self._check_handover("hand_over")
        if not self.held or self.token is None or not self.task_id:
            return ""
        if keep_for < 0:
            raise ValueError(f"keep_for={keep_for!r} must be seconds >= 0")
        if self.heartbeat:
            _heartbeat().discard(self)
        before, _outcome, record = self._begin_release("retried", reason)
        try:
            keep_ms = max(1, int(keep_for * 1000))
            call = self._store.handover_call(self.token, keep_ms, record, self.fence or 0)
            kept = self._store.hand_over(call)
        except _UNCONFIRMABLE as exc:
            self._release_unconfirmed(exc, "lost")
            return "lost"
        except BaseException:
            self._release_undone(before)
            if self.heartbeat and before == HELD:
                _heartbeat().add(self)
            raise
        if not kept:
            self.vanished = True
            self._lost_reason = _VANISHED
        if events.enabled():
            self._released_event("retried" if kept else "lost")
        return "retried" if kept else "lost"

    def _give_back(self, token: str, res: list[Any], why: str, elapsed: float) -> None:
        """Remove a lease granted to us that we must not use (its run record says why)."""
        try:
            # No WAIT: a failover that forgets this release brings back a lease that
            # expires by itself.
            self._store.release(self._give_back_call(token, res, why, elapsed), wait=False)
        except Exception:  # best effort: the lease expires within its ttl anyway
            log.warning(
                "fenced: could not give back the grant of %r (%s)",
                self.name,
                why,
                extra=self.log_fields("unavailable"),
            )

    # -- refresh --------------------------------------------------------------

    def refresh(self) -> bool:
        """Extend the lease now; False (and the claim is lost) if another token holds it."""
        if not self._mine() or self.token is None:
            return False
        token = self.token
        sent = self._clock()
        try:
            ok = self._store.refresh(token, self.slot or 0, self._marker())
        except NotReplicated as exc:
            self.retry_soon()
            raise ClaimUnavailable.about(
                self,
                f"the refresh of claim {self.name!r} was acknowledged by {exc.acked} of the "
                f"{self.replicas} replica(s) asked for: not confirmed",
            ) from None
        except UNREACHABLE as exc:
            self.retry_soon()
            raise self._refresh_unavailable(exc) from exc
        if ok is True:
            self.renewed(sent, token)
            self.renewal_event(self._clock() - sent)
            return self.held
        self.renewal_refused(token, ok or None)
        return False

    # -- release ----------------------------------------------------------------------

    def release(self, outcome: str | None = None, reason: str | None = None) -> bool:
        """Give the claim back; True only if our token still held it (then it is deleted)."""
        if not self._releasable():
            return False
        if self.heartbeat:
            _heartbeat().discard(self)
        before, outcome, record = self._begin_release(outcome, reason)
        give_up = self._release_give_up(before)
        while True:
            try:
                answer = self._store.release(self._release_call(outcome, record))
                break
            except _UNCONFIRMABLE as exc:
                if isinstance(exc, UNREACHABLE) and time.monotonic() + RELEASE_RETRY < give_up:
                    time.sleep(RELEASE_RETRY)  # real time: the claim's sleep may be a seam
                    continue
                self._release_unconfirmed(exc, outcome)
                return False
            except BaseException:
                self._release_undone(before)
                if self.heartbeat and before == HELD:
                    _heartbeat().add(self)
                raise
        return self._ended(before, outcome, *answer)

    def finished_ok(self) -> bool:
        """Whether a run of this claim's task id ended ``ok`` within its redelivery window
        (when the grant of the claim held said so: no round trip)."""
        if self.completed_before and self._mine():
            return True
        return self.task_id is not None and self._store.finished_ok(self.task_id)

    def unbook(self) -> bool:
        """Let go of the start the rate booked for this claim's task id (:attr:`booked`),
        for a call that will never come for it: a later call may take it. True when one
        was booked. The name's next free start is written again as an acquire writes it."""
        if not self.task_id or not self.options.rate_us:
            return False
        return self._store.unbook(self.task_id)

    # -- work under the claim: the drivers of fenced._guard -----------------------------

    def enter(self, policy: BusyPolicy = RAISE, trigger: bool | str = True) -> Action:
        """Take the claim under a busy ``policy``: ``RUN`` when held, else its action.

        ``trigger`` names the call for a policy that asks for a rerun (see
        :meth:`acquire`). A lease an earlier attempt of this task id kept for its retry
        (:meth:`hand_over`) is taken over (``TAKEN_OVER``).
        """
        blocking, timeout = self._acquire_as(policy)
        rerun = trigger if policy.asks_rerun else False
        self._replacing = policy.replaces
        if policy.replaces:
            if self.replace():
                return RUN
        elif self.acquire(blocking, timeout, request_rerun=rerun):
            return RUN
        # A run of this task id already ended ok (the answer said so, whoever holds the
        # name: another copy of this delivery too): a duplicate, with no lease to take.
        if not self.completed_before and self._kept_for_us() and self.take_over():
            return TAKEN_OVER
        return policy.on_busy(self)

    def end(
        self,
        exc: BaseException | None,
        what: str = "the work",
        *,
        outcome: str | None = None,
        reason: str | None = None,
        raise_lost: bool = True,
    ) -> str:
        """Release with the outcome of work that ended with ``exc`` (None: it returned),
        or with the ``outcome`` its front end decided; returns the outcome recorded.

        Work that returned although its lease was gone (lost, evicted, failed over,
        unconfirmed) ended ``lost``: with ``raise_lost`` that raises ClaimLost.
        """
        outcome, reason = self._ending(exc, outcome, reason)
        try:
            self.release(outcome=outcome, reason=reason)
        except Exception:
            self._release_failed()
        return settle(self, outcome, exc, what, raise_lost)

    # -- context manager --------------------------------------------------------------

    def __enter__(self) -> Claim:
        if self._mine():
            # Acquired before the block (the skip idiom): enter only while still ours.
            self.check()
            return self
        if not isinstance(self.enter(), Run):
            raise busy_error(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.token is None or self._state in (IDLE, RELEASED):
            return
        self.end(exc, self._what)

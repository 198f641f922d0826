"""Work under a claim: what every front end decides alike, without I/O.

The core decides, the front ends drive. A **busy policy** is one object: given a claim
whose acquire found the name taken, ``policy.on_busy(claim)`` returns an action::

    Skip(skipped)          return a falsy Skipped result (not an error)
    Refuse(error)          raise ClaimHeld
    RetryAfter(s, error)   retry the work once the holder's lease has ended (a task)

and ``policy.blocks`` / ``policy.asks_rerun`` say how to acquire (``wait`` blocks;
``rerun`` asks the holder for one more run). The drivers, ``Claim.enter`` and
``Claim.end`` (``fenced.aio.Claim`` awaits the same two), carry the actions out; each
front end names the policies it refuses. How work ended maps to its outcome in
:func:`outcome_of`, and :func:`settle` applies the vanished rule: work that returned
while its lease was gone (lost, evicted, failed over) ended ``lost``.

This module sits below ``_claim``: it reads a claim's state, never sends anything.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from ._errors import ClaimHeld, ClaimLost, ConfigError
from ._lease import Holder, short_token
from ._printable import printable
from ._redact import REASON_MAX, exception_text, redact

__all__ = [
    "COOLDOWN_REASON",
    "ON_BUSY",
    "RATE_REASON",
    "REPLACED",
    "RUN",
    "TAKEN_OVER",
    "BusyPolicy",
    "Refuse",
    "RetryAfter",
    "Run",
    "Skip",
    "Skipped",
    "busy_error",
    "busy_policy",
    "check_replace",
    "ended_as",
    "is_skipped",
    "lost_error",
    "outcome_of",
    "replaced_note",
    "replacer",
    "settle",
]

#: Reason recorded for a skip.
SKIP_REASON = "already running"
SKIP_RERUN_REASON = "already running; rerun requested"
#: Reason recorded for a trigger within a cooldown window after a run that ended ok.
COOLDOWN_REASON = "ran recently"
#: Reason given for a call made before the name's rate allows its next start.
RATE_REASON = "rate limited"
#: How the reason of a run that a newer one took the claim from begins.
REPLACED = "replaced by"
#: The status of the result of work a newer run took the claim from (``replace``).
REPLACED_STATUS = "replaced"
#: Why a wait ended without the claim.
GAVE_UP_REASON = "gave up waiting"
#: Added to a holder's remaining lease before retrying, so the retry finds it gone.
RETRY_MARGIN = 0.25


class Seen(Protocol):
    """What the core reads of a claim (``ClaimState`` has it all)."""

    name: str
    holder: Holder | None
    ran_recently: float | None
    throttled: float | None
    superseded: str | None
    skips: int
    task_id: str | None
    vanished: bool
    token: str | None
    fence: int | None

    @property
    def lost(self) -> bool: ...

    @property
    def lost_reason(self) -> str | None: ...


# -- what a busy claim gives -----------------------------------------------------------


@dataclass(frozen=True)
class Skipped:
    """The result of work that did not run because another live holder had the claim.

    Falsy, so ``if not result:`` reads as "it was skipped". With the status
    ``"replaced"`` (:meth:`replaced`), the result of work that was stopped because a
    newer run took its claim over (``on_busy="replace"``): ``holder`` is that run.
    """

    claim: str
    holder: Holder | None
    expires_in: float | None
    reason: str = SKIP_REASON
    skips: int = 0
    status: str = "skipped"

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        if self.status == REPLACED_STATUS:
            return f"claim {self.claim!r} was {printable(self.reason)}"
        if self.reason == COOLDOWN_REASON:
            return f"skipped {self.claim!r}: {_ran_recently(self.expires_in)}"
        if self.reason == RATE_REASON:
            return f"skipped {self.claim!r}: {_rate_limited(self.expires_in)}"
        held_by = f"held by {self.holder}" if self.holder else "held by another holder"
        return f"skipped {self.claim!r}: {held_by}"

    @classmethod
    def of(cls, claim: Seen, reason: str = SKIP_REASON) -> Skipped:
        """What a busy claim's last acquire saw (``expires_in``: of the holder's lease, or
        of the cooldown window when the name ran recently, until the next start its
        rate allows when rate limited)."""
        if claim.ran_recently is not None:
            return cls(claim.name, None, claim.ran_recently, COOLDOWN_REASON, claim.skips)
        if claim.throttled is not None:
            return cls(claim.name, None, claim.throttled, RATE_REASON, claim.skips)
        holder = claim.holder
        return cls(claim.name, holder, holder.expires_in if holder else None, reason, claim.skips)

    @classmethod
    def replaced(cls, claim: Seen) -> Skipped:
        """What work whose claim a newer run took over gives (``on_busy="replace"``; the
        caller knows it was, from the loss's cause): status ``replaced``, the loss's
        reason as the run record keeps it, and as ``holder`` the newer run, as the note it
        left names it (its token's start, host, pid and task id; no fence, no time left).
        Also what a call gives whose task id a newer call replaced before (its retry,
        its redelivery: ``superseded``), which does not run again."""
        reason = claim.lost_reason or claim.superseded or REPLACED
        return cls(
            claim.name,
            replacer(reason),
            None,
            redact(reason)[:REASON_MAX],
            status=REPLACED_STATUS,
        )

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (what a Celery task returns)."""
        return {
            "status": self.status,
            "reason": self.reason,
            "claim": self.claim,
            "holder": self.holder.as_dict() if self.holder else None,
            "expires_in": self.expires_in,
            "skips": self.skips,
        }


#: The keys of ``Skipped.as_dict()``: a dict with all of them and status "skipped" is one.
_SKIPPED_KEYS = frozenset(("status", "reason", "claim", "holder", "expires_in", "skips"))


def is_skipped(result: Any) -> bool:
    """True for a skipped run's result: a Skipped, or its dict (what a Celery task returns).

    For a chord's body or a group's results, where a skipped member's result arrives
    among the others: ``[r for r in results if not fenced.is_skipped(r)]``.
    """
    if isinstance(result, Skipped):
        return result.status == "skipped"
    return (
        isinstance(result, Mapping)
        and result.get("status") == "skipped"
        and result.keys() >= _SKIPPED_KEYS
    )


# How REPLACE's note names the run that took a claim over (see replaced_note).
_NOTE = re.compile(
    re.escape(REPLACED)
    + r" (?P<token>\S*) \((?P<host>.*?) pid (?P<pid>[0-9]{1,20}|None)(?: task (?P<task>.*))?\)",
    re.DOTALL,
)


def replaced_note(token: str) -> str:
    """The note REPLACE leaves for the holder it replaces, naming the run that took the
    claim over under ``token``: ``replaced by <token start> (host pid N task T)``.
    The holder's renewal reads it as the reason of its loss; :func:`replacer` reads
    the run back from it."""
    return f"{REPLACED} {short_token(token)} ({Holder.parse(token)})"


def replacer(reason: str) -> Holder | None:
    """The run a :func:`replaced_note` names (host and task id as the note shows them,
    escaped); None for a reason that is not one."""
    match = _NOTE.fullmatch(reason)
    if match is None:
        return None
    pid = None if match["pid"] == "None" else int(match["pid"])
    return Holder(match["token"], match["host"], pid, match["task"], None, None)


def _ran_recently(left: float | None) -> str:
    ends = f"; its cooldown window ends in {left:.1f}s" if left is not None else ""
    return f"{COOLDOWN_REASON}{ends}"


def _rate_limited(left: float | None) -> str:
    if left is None:
        return RATE_REASON
    # three figures, but whole seconds past 100 (1800s, never 1.8e+03s)
    seconds = f"{left:.3g}" if left < 100 else f"{left:.0f}"
    return f"{RATE_REASON}; the next start is allowed in {seconds}s"


def busy_error(claim: Seen, waited: float | None = None) -> ClaimHeld:
    """ClaimHeld for a claim whose last acquire found another holder (or a window, or
    its rate reached)."""
    if claim.throttled is not None:
        after = f" after waiting {waited:g}s" if waited is not None else ""
        return ClaimHeld(
            f"claim {claim.name!r} is {_rate_limited(claim.throttled)}{after}",
            name=claim.name,
            expires_in=claim.throttled,
        )
    if claim.ran_recently is not None:
        return ClaimHeld(
            f"claim {claim.name!r} {_ran_recently(claim.ran_recently)}",
            name=claim.name,
            expires_in=claim.ran_recently,
        )
    holder = claim.holder
    held_by = f"held by {holder}" if holder else "held by another holder"
    after = f" after waiting {waited:g}s" if waited is not None else ""
    return ClaimHeld(
        f"claim {claim.name!r} is busy{after}: {held_by}",
        name=claim.name,
        token=None,  # the holder's token is its secret, not ours to pass around
        fence=holder.fence if holder else None,
        expires_in=holder.expires_in if holder else None,
    )


# -- actions ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """The claim is held: run the work (``taken_over``: from this task id's earlier
    attempt, which kept it for its retry)."""

    taken_over: bool = False


RUN = Run()
TAKEN_OVER = Run(taken_over=True)


@dataclass(frozen=True)
class Skip:
    """Do not run; the caller gets ``skipped`` (falsy), which is not an error."""

    skipped: Skipped

    @property
    def reason(self) -> str:
        return self.skipped.reason


@dataclass(frozen=True)
class Refuse:
    """Do not run; raise ``error`` (ClaimHeld). ``reason`` is what a record or report says."""

    error: ClaimHeld
    reason: str


@dataclass(frozen=True)
class RetryAfter:
    """Do not run now; run again in ``seconds``, when the holder's lease has ended.

    ``redelivered``: the holder is an earlier attempt of this very task id (its worker
    died holding the claim, and the message came back): not a competitor. A front end
    that cannot retry raises ``error``.
    """

    seconds: float
    error: ClaimHeld
    redelivered: bool = False


Action = Run | Skip | Refuse | RetryAfter


# -- busy policies ---------------------------------------------------------------------


class BusyPolicy:
    """What to do when the claim is busy. A subclass is one policy: its ``name``, its
    ``help``, how it acquires, and :meth:`decide`."""

    name: ClassVar[str]
    help: ClassVar[str]
    #: Acquire by waiting for the holder (``timeout``: at most that long; None: forever).
    blocks: ClassVar[bool] = False
    #: A loser asks the holder for one more run after its own.
    asks_rerun: ClassVar[bool] = False
    #: Acquire by taking the claim over from its holder (``Claim.replace``).
    replaces: ClassVar[bool] = False
    timeout: float | None = None

    def on_busy(self, claim: Seen) -> Action:
        """The action for a claim whose acquire did not get it.

        Shared by every policy: a name that ran recently is skipped under all but
        ``raise`` (waiting out a cooldown window would run the work twice in it), and a
        holder carrying this claim's own task id is an earlier attempt that died
        holding it (its message came back): run once its lease has ended.
        """
        if claim.superseded is not None:
            # replace: a newer call replaced this task id; by call order it lost for good
            return Skip(Skipped.replaced(claim))
        if claim.ran_recently is not None:
            if self.name == "raise":
                return Refuse(busy_error(claim), COOLDOWN_REASON)
            return Skip(Skipped.of(claim))
        if claim.throttled is not None:
            return self.on_throttled(claim)
        holder = claim.holder
        if holder is not None and claim.task_id and holder.task_id == claim.task_id:
            return RetryAfter(_left(holder) + RETRY_MARGIN, busy_error(claim), redelivered=True)
        return self.decide(claim)

    def decide(self, claim: Seen) -> Action:
        raise NotImplementedError

    def on_throttled(self, claim: Seen) -> Action:
        """The name is free but its rate allows no start yet: a policy that skips skips
        (no rerun is asked: nobody holds the name), ``retry`` retries at the next
        start allowed, and the rest raise (``wait`` waited for it already)."""
        if self.name in ("skip", "rerun"):
            return Skip(Skipped.of(claim))
        if self.name == "retry":
            return RetryAfter(claim.throttled or 0.0, busy_error(claim))
        return Refuse(busy_error(claim, self.timeout), RATE_REASON)

    def __repr__(self) -> str:
        return f"<busy policy {self.name!r}>"


def _left(holder: Holder | None) -> float:
    return (holder.expires_in if holder else None) or 0.0


class SkipPolicy(BusyPolicy):
    name, help = "skip", "return a skipped result"

    def decide(self, claim: Seen) -> Action:
        return Skip(Skipped.of(claim))


class WaitPolicy(BusyPolicy):
    name, help = "wait", "wait for the holder to let go"
    blocks = True

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout

    def decide(self, claim: Seen) -> Action:
        return Refuse(busy_error(claim, self.timeout), GAVE_UP_REASON)


class RerunPolicy(BusyPolicy):
    name, help = "rerun", "skip, and have the holder run once more after it finishes"
    asks_rerun = True

    def decide(self, claim: Seen) -> Action:
        return Skip(Skipped.of(claim, SKIP_RERUN_REASON))


class ReplacePolicy(BusyPolicy):
    name, help = "replace", "take the claim over; the holder's run stops as lost"
    replaces = True

    def decide(self, claim: Seen) -> Action:
        # Replace takes any holder but an earlier attempt of this very task (handled by
        # on_busy) and a lease whose value cannot be read: busy then.
        return Refuse(busy_error(claim), SKIP_REASON)


class RetryPolicy(BusyPolicy):
    name, help = "retry", "retry after the holder's lease"

    def decide(self, claim: Seen) -> Action:
        return RetryAfter(_left(claim.holder) + RETRY_MARGIN, busy_error(claim))


class RaisePolicy(BusyPolicy):
    name, help = "raise", "raise ClaimHeld"

    def decide(self, claim: Seen) -> Action:
        return Refuse(busy_error(claim), SKIP_REASON)


#: Every busy policy, in the order errors list them.
POLICIES: Mapping[str, type[BusyPolicy]] = {
    p.name: p
    for p in (SkipPolicy, WaitPolicy, RerunPolicy, RetryPolicy, RaisePolicy, ReplacePolicy)
}
#: Every busy policy, and what it does.
ON_BUSY: Mapping[str, str] = {name: p.help for name, p in POLICIES.items()}
#: ``with Claim``: a busy claim raises.
RAISE = RaisePolicy()


def accepted(refuses: Collection[str]) -> tuple[str, ...]:
    """The policies a front end has: all but the ones it ``refuses``."""
    return tuple(name for name in POLICIES if name not in refuses)


def busy_policy(
    value: Any,
    refuses: Collection[str] = (),
    *,
    option: str = "on_busy",
    where: str = "",
    aliases: Mapping[str, str] | None = None,
    wait_timeout: float | None = None,
) -> BusyPolicy:
    """The policy named ``value`` if this front end has it; a ConfigError naming them if not."""
    if isinstance(value, BusyPolicy):
        value = value.name
    if aliases and value in aliases:
        value = aliases[value]
    if value in POLICIES and value not in refuses:
        policy = POLICIES[value]
        return WaitPolicy(wait_timeout) if policy is WaitPolicy else policy()
    prefix = f"{where}: " if where else ""
    allowed = accepted(refuses)
    choices = ", ".join(f"{p!r} ({ON_BUSY[p]})" for p in allowed)
    extra = ""
    if value == "wait" and "retry" in allowed:
        extra = "; a task should not block its worker while it waits: use 'retry'"
    elif value in ("retry", "rerun"):
        extra = f"; {value!r} needs a task queue (fenced.celery.ClaimedTask)"
    raise ConfigError(f"{prefix}{option}={value!r} is not one of: {choices}{extra}")


def check_replace(
    policy: BusyPolicy,
    limit: int,
    where: str = "",
    enqueue: Any = None,
    option: str = "on_busy",
    rate: str | None = None,
) -> None:
    """Refuse ``replace`` where it cannot say what it would do (at definition time)."""
    if not policy.replaces:
        return
    prefix = f"{where}: " if where else ""
    if rate is not None:
        # A rate counts starts, and a replacing run takes the name whenever it is called:
        # counting it would make the newest call wait, which replace exists to avoid.
        spelled = {"claim_on_busy": "claim_rate", "--on-busy": "--rate"}.get(option, "rate")
        raise ConfigError(
            f"{prefix}{option}='replace' does not take a rate ({spelled}={rate!r}): a "
            "replacing run starts whenever it is called. Drop the rate, or use another "
            "busy policy"
        )
    if limit > 1:
        raise ConfigError(
            f"{prefix}{option}='replace' needs a limit of 1 (this one has limit={limit}): "
            "with several holders at once, which running one a new run replaces is "
            "ambiguous. Use limit=1, or another busy policy"
        )
    if enqueue == "until_finished":
        # until_started is not: a call made while the run runs is published, and replaces it.
        raise ConfigError(
            f"{prefix}claim_on_busy='replace' contradicts claim_enqueue='until_finished': "
            "a call made while a run runs is dropped at enqueue, so it never replaces "
            "that run. Use claim_enqueue='until_started' (or none) to let the newest call "
            "win, or another busy policy"
        )


# -- how the work ended ----------------------------------------------------------------


def lost_error(claim: Seen, what: str = "the work", interrupted: bool = False) -> ClaimLost:
    """ClaimLost for work that ran on after its claim was lost (or was interrupted)."""
    stopped = f"{what} was interrupted" if interrupted else "its writes were not protected"
    return ClaimLost.about(
        claim,
        f"claim {claim.name!r} was lost while {what} ran ({claim.lost_reason}); {stopped}: "
        "another holder may be working on the same resource",
    )


def outcome_of(
    claim: Seen, exc: BaseException | None, reason: str | None = None
) -> tuple[str, str | None]:
    """How work under ``claim`` ended: (outcome for the run record, reason).

    ``lost`` when the claim was lost (whatever the work raised: the loss is the cause),
    ``failed`` when the work raised, ``ok`` otherwise. ``reason`` overrides the text.
    An exception is recorded by its type and a bounded message with what looks secret
    left out (:func:`fenced._redact.exception_text`).
    """
    if claim.lost or isinstance(exc, ClaimLost):
        if reason is None and claim.lost_reason:
            reason = redact(claim.lost_reason)[:REASON_MAX]
        return "lost", reason or (exception_text(exc) if exc else None)
    if exc is not None:
        return "failed", reason or exception_text(exc)
    return "ok", reason


def ended_as(outcome: str, vanished: bool) -> str:
    """The vanished rule: a run released ``ok`` whose lease was gone at its release (or
    could not be confirmed) is not known to have ended under the claim: ``lost``."""
    return "lost" if vanished and outcome == "ok" else outcome


def settle(
    claim: Seen,
    outcome: str,
    exc: BaseException | None,
    what: str = "the work",
    raise_lost: bool = True,
) -> str:
    """The outcome of work once ``claim`` was released with ``outcome``.

    Work that returned although its lease was gone ended ``lost``: with ``raise_lost``
    that raises ClaimLost, since its writes were not protected.
    """
    outcome = ended_as(outcome, claim.vanished)
    if raise_lost and outcome == "lost" and exc is None:
        raise lost_error(claim, what)
    return outcome

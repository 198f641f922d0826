"""Work under a claim: the one core every front end shares.

``with Claim``, ``@exclusive``, ``ClaimedTask`` and ``fenced run`` all do the same three
things, and do them here:

1. **take the claim, or handle "busy"** by one vocabulary of policies::

       skip    return a falsy Skipped result (a cron job's "already running": not an error)
       wait    block until the holder lets go (or wait_timeout passes, then raise)
       rerun   skip, and ask the holder to run once more when it finishes (Celery)
       retry   retry the task once the holder's lease has ended (Celery)
       raise   raise ClaimHeld

   Each front end accepts the policies it can carry out and refuses the others with
   an error naming the ones it has.
2. **run the work** — never without the claim;
3. **map how the work ended to an outcome** (:func:`outcome_of`) and release with it.
   Work that finished after its claim was lost ends in ``ClaimLost``: its writes were
   not protected, and saying "ok" would hide that.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import ClaimHeld, ClaimLost, ConfigError
from ._lease import Holder
from ._redact import REASON_MAX, exception_text, redact

if TYPE_CHECKING:
    from ._claim import Claim, ClaimState

__all__ = [
    "COOLDOWN_REASON",
    "ON_BUSY",
    "Guard",
    "Skipped",
    "busy_error",
    "check_on_busy",
    "finish",
    "is_skipped",
    "lost_error",
    "outcome_of",
    "settle",
    "skips",
]

#: Every busy policy, and what it does.
ON_BUSY: Mapping[str, str] = {
    "skip": "return a skipped result",
    "wait": "wait for the holder to let go",
    "rerun": "skip, and have the holder run once more after it finishes",
    "retry": "retry after the holder's lease",
    "raise": "raise ClaimHeld",
}
#: Reason recorded for a skip.
SKIP_REASON = "already running"
SKIP_RERUN_REASON = "already running; rerun requested"
#: Reason recorded for a trigger within a cooldown window after a run that ended ok.
COOLDOWN_REASON = "ran recently"


def check_on_busy(
    value: Any,
    allowed: Collection[str],
    *,
    option: str = "on_busy",
    where: str = "",
    aliases: Mapping[str, str] | None = None,
) -> str:
    """The busy policy ``value`` if this front end has it; a ConfigError naming them if not."""
    if aliases and value in aliases:
        value = aliases[value]
    if value in allowed:
        return str(value)
    prefix = f"{where}: " if where else ""
    choices = ", ".join(f"{p!r} ({ON_BUSY[p]})" for p in allowed)
    extra = ""
    if value == "wait" and "retry" in allowed:
        extra = "; a task should not block its worker while it waits: use 'retry'"
    elif value in ("retry", "rerun"):
        extra = f"; {value!r} needs a task queue (fenced.celery.ClaimedTask)"
    raise ConfigError(f"{prefix}{option}={value!r} is not one of: {choices}{extra}")


@dataclass(frozen=True)
class Skipped:
    """The result of work that did not run because another live holder had the claim.

    Falsy, so ``if not result:`` reads as "it was skipped".
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
        if self.reason == COOLDOWN_REASON:
            return f"skipped {self.claim!r}: {_ran_recently(self.expires_in)}"
        held_by = f"held by {self.holder}" if self.holder else "held by another holder"
        return f"skipped {self.claim!r}: {held_by}"

    @classmethod
    def of(cls, claim: ClaimState, reason: str = SKIP_REASON) -> Skipped:
        """What a busy claim's last acquire saw (``expires_in``: of the holder's lease, or
        of the cooldown window when the name ran recently)."""
        if claim.ran_recently is not None:
            return cls(claim.name, None, claim.ran_recently, COOLDOWN_REASON, claim.skips)
        holder = claim.holder
        return cls(claim.name, holder, holder.expires_in if holder else None, reason, claim.skips)

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
        return True
    return (
        isinstance(result, Mapping)
        and result.get("status") == "skipped"
        and result.keys() >= _SKIPPED_KEYS
    )


def skips(claim: ClaimState, on_busy: str) -> bool:
    """Whether a busy ``claim`` is skipped under ``on_busy`` (else it waits, retries or
    raises): a name that ran recently is skipped under every policy but ``raise``, since
    waiting out its cooldown window would run the work twice in one window."""
    return on_busy == "skip" or (claim.ran_recently is not None and on_busy != "raise")


def _ran_recently(left: float | None) -> str:
    ends = f"; its cooldown window ends in {left:.1f}s" if left is not None else ""
    return f"{COOLDOWN_REASON}{ends}"


def busy_error(claim: ClaimState, waited: float | None = None) -> ClaimHeld:
    """ClaimHeld for a claim whose last acquire found another holder (or a window)."""
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


def lost_error(claim: ClaimState, what: str = "the work", interrupted: bool = False) -> ClaimLost:
    """ClaimLost for work that ran on after its claim was lost (or was interrupted)."""
    stopped = f"{what} was interrupted" if interrupted else "its writes were not protected"
    return ClaimLost.about(
        claim,
        f"claim {claim.name!r} was lost while {what} ran ({claim.lost_reason}); {stopped}: "
        "another holder may be working on the same resource",
    )


def outcome_of(
    claim: ClaimState, exc: BaseException | None, reason: str | None = None
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


def finish(
    claim: Claim,
    exc: BaseException | None,
    what: str = "the work",
    *,
    reason: str | None = None,
    raise_lost: bool = True,
) -> str:
    """Release ``claim`` with the outcome of work that ended with ``exc`` (None: returned).

    Returns the outcome recorded. Work that returned although its claim was lost, or
    whose lease was found gone at release (evicted, failed over, cleared), ended
    ``lost``: with ``raise_lost`` that raises ClaimLost, since its writes were not
    protected and another holder may have the name.
    """
    outcome, why = outcome_of(claim, exc, reason)
    claim.release(outcome=outcome, reason=why)
    return settle(claim, outcome, exc, what, raise_lost)


def settle(
    claim: ClaimState,
    outcome: str,
    exc: BaseException | None,
    what: str = "the work",
    raise_lost: bool = True,
) -> str:
    """The outcome of work once ``claim`` was released with ``outcome`` (see :func:`finish`)."""
    if claim.vanished and outcome == "ok":
        outcome = "lost"
    if raise_lost and outcome == "lost" and exc is None:
        raise lost_error(claim, what)
    return outcome


class Guard:
    """One run of work under a claim, for the front ends that run it in this process."""

    def __init__(
        self, claim: Claim, on_busy: str = "raise", wait_timeout: float | None = None
    ) -> None:
        self.claim = claim
        self.on_busy = on_busy
        self.wait_timeout = wait_timeout

    def enter(self) -> Skipped | None:
        """Take the claim; None when held, a Skipped result for ``skip``; else raise."""
        claim = self.claim
        wait = self.on_busy == "wait"
        if claim.acquire(blocking=wait, timeout=self.wait_timeout if wait else None):
            return None
        return self.busy()

    def busy(self) -> Skipped:
        """The claim is busy: a Skipped result, or ClaimHeld under ``raise`` and ``wait``
        (see :func:`skips`)."""
        if skips(self.claim, self.on_busy):
            return Skipped.of(self.claim)
        raise busy_error(self.claim, self.wait_timeout if self.on_busy == "wait" else None)

    @contextmanager
    def running(self, what: str = "the work") -> Iterator[Claim]:
        """The work's block: on the way out, release with its outcome (see :func:`finish`)."""
        try:
            yield self.claim
        except BaseException as exc:
            finish(self.claim, exc, what)
            raise
        finish(self.claim, None, what)

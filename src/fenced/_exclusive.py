"""``@exclusive``: run a plain function (an APScheduler job, a script's main) once at a time.

::

    @fenced.exclusive("report:{tenant}", redis="redis://locks:6379/0", ttl=60)
    def nightly_report(tenant: str, day: str) -> str: ...

    result = nightly_report("acme", "2024-05-01")
    if not result:            # a Skipped result: another run of acme's report holds it
        log.info("skipped: %s", result)

The claim name comes from the template over the function's arguments, checked against
its signature when the decorator is applied. While the function runs the claim is
renewed by the heartbeat; a run that outlives its claim raises ``ClaimLost`` after it
returns (its writes were not protected). Coroutine functions are wrapped as coroutines.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ._claim import Claim, Holder
from ._errors import ClaimHeld, ClaimLost, ConfigError
from ._keys import check_fields, claim_name, template_fields

__all__ = ["ON_BUSY", "Skipped", "exclusive"]

F = TypeVar("F", bound=Callable[..., Any])
ON_BUSY = ("skip", "wait", "raise")


@dataclass(frozen=True)
class Skipped:
    """What an exclusive function returns when another live holder has its claim (falsy)."""

    claim: str
    holder: Holder | None
    expires_in: float | None
    reason: str = "already running"
    status: str = "skipped"

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        held_by = f"held by {self.holder}" if self.holder else "held by another holder"
        return f"skipped {self.claim!r}: {held_by}"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "status": self.status,
            "reason": self.reason,
            "claim": self.claim,
            "holder": self.holder.as_dict() if self.holder else None,
            "expires_in": self.expires_in,
        }


def _client(redis: Any) -> Any:
    if isinstance(redis, str):
        import redis as redis_py

        return redis_py.Redis.from_url(redis)
    if redis is None:
        raise ConfigError(
            "exclusive() needs redis=: a redis.Redis client or a URL such as "
            "'redis://localhost:6379/0'"
        )
    return redis


def _namer(name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., str]:
    """Turn the template into a function of the call's arguments, checked now."""
    where = f"function {fn.__qualname__}"
    sig = inspect.signature(fn)
    if callable(name):
        return name
    params = sig.parameters.values()
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = [
        p.name
        for p in params
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    # With **kwargs any field may arrive by keyword; a missing one fails at the call.
    fields = template_fields(name) if takes_kwargs else check_fields(name, named, where)

    def render(*args: Any, **kwargs: Any) -> str:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        for p in params:
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                values.update(values.pop(p.name, {}))
        return claim_name(name, **{f: values[f] for f in fields if f in values})

    return render


def exclusive(
    name: str | Callable[..., str],
    *,
    redis: Any,
    ttl: float = 30.0,
    on_busy: str = "skip",
    wait_timeout: float | None = None,
    namespace: str = "fenced",
    refresh_every: float | None = None,
    records: bool = True,
) -> Callable[[F], F]:
    """Hold a claim named from the arguments while the function runs; skip, wait or raise."""
    if on_busy not in ON_BUSY:
        raise ConfigError(f"on_busy={on_busy!r}: choose one of {', '.join(ON_BUSY)}")
    if wait_timeout is not None and (on_busy != "wait" or wait_timeout < 0):
        raise ConfigError(
            f"wait_timeout={wait_timeout!r} needs on_busy='wait' and a value >= 0 "
            "(seconds to wait for the holder before raising ClaimHeld)"
        )
    client = _client(redis)
    # A throwaway claim checks ttl, refresh_every and namespace now, not at 02:00.
    Claim(client, "exclusive", ttl, refresh_every, namespace, heartbeat=False)

    def decorate(fn: F) -> F:
        render = _namer(name, fn)
        extra = {"function": f"{fn.__module__}.{fn.__qualname__}"}

        def claim_for(args: Any, kwargs: Any) -> Claim:
            return Claim(
                client,
                render(*args, **kwargs),
                ttl,
                refresh_every,
                namespace,
                records=records,
                record_extra=extra,
            )

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                claim = claim_for(args, kwargs)
                if on_busy == "wait":
                    import asyncio  # only coroutine functions pay for the import

                    # The blocking wait must not stall the event loop.
                    got = await asyncio.to_thread(claim.acquire, True, wait_timeout)
                else:
                    got = claim.acquire()
                if not got:
                    return _busy(claim, on_busy, wait_timeout)
                try:
                    result = await fn(*args, **kwargs)
                except BaseException as exc:
                    _finish(claim, exc)
                    raise
                _finish(claim, None)
                return result

            return cast(F, async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            claim = claim_for(args, kwargs)
            if not claim.acquire(blocking=on_busy == "wait", timeout=wait_timeout):
                return _busy(claim, on_busy, wait_timeout)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                _finish(claim, exc)
                raise
            _finish(claim, None)
            return result

        return cast(F, wrapper)

    return decorate


def _busy(claim: Claim, on_busy: str, wait_timeout: float | None) -> Skipped:
    holder = claim.holder
    expires_in = holder.expires_in if holder else None
    if on_busy == "skip":
        return Skipped(claim.name, holder, expires_in)
    held_by = f"held by {holder}" if holder else "held by another holder"
    waited = f" after waiting {wait_timeout:g}s" if on_busy == "wait" else ""
    raise ClaimHeld(
        f"claim {claim.name!r} is busy{waited}: {held_by}",
        name=claim.name,
        token=holder.token if holder else None,
        fence=holder.fence if holder else None,
        expires_in=expires_in,
    )


def _finish(claim: Claim, exc: BaseException | None) -> None:
    """Release with the run's outcome; a run that outlived its claim raises ClaimLost."""
    lost = claim.lost
    if lost or isinstance(exc, ClaimLost):
        claim.release(outcome="lost", reason=repr(exc) if exc else claim.lost_reason)
    elif exc is not None:
        claim.release(outcome="failed", reason=repr(exc))
    else:
        claim.release(outcome="ok")
    if lost and exc is None:
        raise ClaimLost(
            f"claim {claim.name!r} was lost while the function ran ({claim.lost_reason}); "
            "its writes were not protected",
            name=claim.name,
            token=claim.token,
            fence=claim.fence,
        )

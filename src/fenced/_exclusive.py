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
from typing import Any, TypeVar, cast

from ._claim import Claim
from ._client import connect
from ._errors import ConfigError
from ._guard import Guard, Skipped, check_on_busy
from ._lease import check_namespace, check_timing
from ._naming import Namer, NameSource

__all__ = ["ON_BUSY", "Skipped", "exclusive"]

F = TypeVar("F", bound=Callable[..., Any])
#: The busy policies a plain function can carry out (see fenced._guard).
ON_BUSY = ("skip", "wait", "raise")


def _client(redis: Any) -> Any:
    return connect(redis, what="exclusive()")


def exclusive(
    name: NameSource,
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
    on_busy = check_on_busy(on_busy, ON_BUSY)
    if wait_timeout is not None and (on_busy != "wait" or wait_timeout < 0):
        raise ConfigError(
            f"wait_timeout={wait_timeout!r} needs on_busy='wait' and a value >= 0 "
            "(seconds to wait for the holder before raising ClaimHeld)"
        )
    ttl, refresh_every = check_timing(ttl, refresh_every)
    check_namespace(namespace)
    client = _client(redis)

    def decorate(fn: F) -> F:
        where = f"function {fn.__qualname__}"
        namer = Namer(name, inspect.signature(fn), where)
        extra = {"function": f"{fn.__module__}.{fn.__qualname__}"}

        def guard_for(args: Any, kwargs: Any) -> Guard:
            claim = Claim(
                client,
                namer(args, kwargs)[0],
                ttl=ttl,
                refresh_every=refresh_every,
                namespace=namespace,
                records=records,
                record_extra=extra,
            )
            return Guard(claim, on_busy, wait_timeout)

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                guard = guard_for(args, kwargs)
                if on_busy == "wait":
                    import asyncio  # only coroutine functions pay for the import

                    # The blocking wait must not stall the event loop.
                    skipped = await asyncio.to_thread(guard.enter)
                else:
                    skipped = guard.enter()
                if skipped is not None:
                    return skipped
                with guard.running("the function"):
                    return await fn(*args, **kwargs)

            return cast(F, async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            guard = guard_for(args, kwargs)
            skipped = guard.enter()
            if skipped is not None:
                return skipped
            with guard.running("the function"):
                return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate

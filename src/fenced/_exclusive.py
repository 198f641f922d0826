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
returns (its writes were not protected). Coroutine functions are wrapped as coroutines:
given a ``redis.asyncio`` client or a URL they hold a ``fenced.aio.Claim`` (a loss
cancels the coroutine and ends in ``ClaimLost``); given a ``redis.Redis`` client they
hold a thread ``Claim``.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from ._claim import Claim
from ._client import connect, connect_async, parse_url
from ._errors import ConfigError
from ._guard import Run, Skip, Skipped, accepted, busy_policy, check_replace
from ._naming import Namer, NameSource, bounded_label
from ._options import ClaimOptions

__all__ = ["ON_BUSY", "Skipped", "exclusive"]

F = TypeVar("F", bound=Callable[..., Any])
#: The busy policies a plain function refuses (see fenced._guard): it has no queue.
REFUSES = ("retry", "rerun")
ON_BUSY = accepted(REFUSES)


def _client(redis: Any) -> Callable[[], Any]:
    """The synchronous client: checked now, and for a URL built at first use (a cluster
    client asks its nodes when made, which must not happen when a module is imported)."""
    if isinstance(redis, str):
        parse_url(redis)
        return lambda: connect(redis, what="exclusive()")
    client = connect(redis, what="exclusive()")
    return lambda: client


def _async_client(redis: Any, replicas: int) -> Callable[[], Any] | None:
    """For a ``redis.asyncio`` client or a plain URL: the client of the running event loop.

    A URL (of any form, Cluster and Sentinel too) gets one ``redis.asyncio`` client per
    event loop (its connections belong to that loop); a URL used by a plain function gets
    a ``redis.Redis`` client instead, and so does ``replicas=`` (``fenced.aio`` does not
    wait for replicas).
    """
    if isinstance(redis, str) and not replicas:
        import weakref

        url = redis
        by_loop: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

        def for_loop() -> Any:
            import asyncio

            loop = asyncio.get_running_loop()
            found = by_loop.get(loop)
            if found is None:
                found = by_loop[loop] = connect_async(url)
            return found

        return for_loop
    if type(redis).__module__.startswith("redis.asyncio"):
        if replicas:
            raise ConfigError(
                "exclusive(replicas=...) needs a synchronous redis-py client or a URL: "
                "fenced.aio does not wait for replicas"
            )
        return lambda: redis
    return None


def exclusive(
    name: NameSource,
    *,
    redis: Any,
    on_busy: str = "skip",
    wait_timeout: float | None = None,
    secret_key: str | bytes | None = None,
    **options: Any,
) -> Callable[[F], F]:
    """Hold a claim named from the arguments while the function runs; skip, wait or raise.

    ``options`` are :class:`fenced.ClaimOptions` (``ttl=30``, ``refresh_every``,
    ``namespace``, ``records=True``, ``cooldown``, ``limit``, ``replicas``, ``label``,
    ...), checked here. With ``cooldown`` (seconds), calls within that long after a run
    that returned are skipped ("ran recently"), whatever ``on_busy`` says but ``raise``.
    With ``limit``, up to that many calls of one name run at once (each with a fence of
    its own). With ``rate`` (``"10/m"``), at most that many calls of one name start per
    period, spread evenly: a call too early is rate limited, as busy (skipped with the
    reason "rate limited", waited for with ``on_busy="wait"``, or ClaimHeld).
    ``on_busy="replace"`` takes the claim over from a running call, which
    stops as lost at its next renewal (limit 1 only). ``secret_key`` keys the digests
    of template fields marked secret (``{key:secret}``); without it, the
    ``FENCED_SECRET_KEY`` environment variable.
    ``label`` names this kind of claim in :mod:`fenced.events` and log fields (default:
    the template, or the name callable's ``__qualname__``).
    """
    policy = busy_policy(on_busy, REFUSES, wait_timeout=wait_timeout)
    if wait_timeout is not None and (not policy.blocks or wait_timeout < 0):
        raise ConfigError(
            f"wait_timeout={wait_timeout!r} needs on_busy='wait' and a value >= 0 "
            "(seconds to wait for the holder before raising ClaimHeld)"
        )
    opts = ClaimOptions.of({"records": True, **options}, where="exclusive()")
    check_replace(policy, opts.limit, "exclusive()", rate=opts.rate)
    async_client = _async_client(redis, opts.replicas)
    # A URL serves both kinds of function; a redis.asyncio client only coroutines.
    client = None if async_client is not None and not isinstance(redis, str) else _client(redis)

    def decorate(fn: F) -> F:
        if client is None and not inspect.iscoroutinefunction(fn):
            raise ConfigError(
                f"exclusive() on {fn.__qualname__}: a redis.asyncio client serves coroutine "
                "functions only; pass a redis.Redis client or a URL for a plain function"
            )
        where = f"function {fn.__qualname__}"
        namer = Namer(name, inspect.signature(fn), where, secret_key=secret_key)
        if namer.secret:
            namer.key()  # no key: fail where the function is defined, not at a call
        extra = {"function": f"{fn.__module__}.{fn.__qualname__}"}
        fn_opts = opts if opts.label is not None else opts.replace(label=bounded_label(namer.label))

        def claim_for(kind: Any, redis: Any, args: Any, kwargs: Any) -> Any:
            """A claim of ``kind`` (``Claim`` or ``aio.Claim``) for one call."""
            name, shown = namer(args, kwargs)
            call_extra: dict[str, Any] = extra
            if namer.template is not None and shown is not None:
                # The template and its values go in the run records, as Celery tasks' do:
                # the doctor's naming checks read them.
                call_extra = {**extra, "template": namer.template, "args": shown}
                readable = namer.readable(args, kwargs, shown)
                if readable:
                    call_extra["arg_text"] = readable
            claim = kind(redis, name, options=fn_opts, record_extra=call_extra)
            claim._front_end("exclusive")
            claim._what = "the function"
            return claim

        if inspect.iscoroutinefunction(fn) and async_client is not None:
            from . import aio

            @functools.wraps(fn)
            async def aio_wrapper(*args: Any, **kwargs: Any) -> Any:
                claim = claim_for(aio.Claim, async_client(), args, kwargs)
                action = await claim.enter(policy)
                if not isinstance(action, Run):
                    return _refused(action)
                # Entered already acquired; a loss cancels the function and ends in ClaimLost.
                async with claim:
                    return await fn(*args, **kwargs)

            return cast(F, aio_wrapper)

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                assert client is not None
                claim = claim_for(Claim, client(), args, kwargs)
                if policy.blocks:
                    import asyncio  # only coroutine functions pay for the import

                    # The blocking wait must not stall the event loop.
                    action = await asyncio.to_thread(claim.enter, policy)
                else:
                    action = claim.enter(policy)
                if not isinstance(action, Run):
                    return _refused(action)
                with claim:
                    return await fn(*args, **kwargs)

            return cast(F, async_wrapper)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            assert client is not None
            claim = claim_for(Claim, client(), args, kwargs)
            action = claim.enter(policy)
            if not isinstance(action, Run):
                return _refused(action)
            with claim:
                return fn(*args, **kwargs)

        return cast(F, wrapper)

    return decorate


def _refused(action: Any) -> Skipped:
    """A function's busy call: its Skipped result, or the action's ClaimHeld raised (a
    function has no queue to retry from)."""
    if isinstance(action, Skip):
        return action.skipped
    raise action.error

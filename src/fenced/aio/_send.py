"""Sending the lease scripts on a ``redis.asyncio`` client, and keeping work going.

The scripts, their arguments and the meaning of their answers live in
``fenced._scripts`` and ``fenced._lease`` (no I/O); this module only awaits them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from redis.exceptions import NoScriptError

from .._scripts import Call

__all__ = ["call", "call_pipeline", "run_to_end"]

T = TypeVar("T")

#: Work that must finish although its caller was cancelled (releases, give-backs): a
#: task the loop only references weakly would be collected mid-flight.
_running: set[asyncio.Future[Any]] = set()


async def call(client: Any, request: Call) -> Any:
    """Run one script call (EVALSHA; EVAL when the server's script cache is cold)."""
    script, keys, args = request
    try:
        return await client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.eval(script.source, len(keys), *keys, *args)


async def call_pipeline(client: Any, calls: Sequence[Call]) -> list[Any]:
    """Many script calls in one round trip; errors come back in place of results.

    redis.asyncio's Cluster pipeline refuses scripts: on a Cluster client the calls are
    sent side by side instead (one round trip each, all in flight at once).
    """
    if type(client).__name__ == "RedisCluster":
        return list(
            await asyncio.gather(
                *(call(client, request) for request in calls), return_exceptions=True
            )
        )
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        for script, keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        result: list[Any] = await pipe.execute(raise_on_error=False)
        if attempt == 2 or not any(isinstance(r, NoScriptError) for r in result):
            return result
        for source in {script.source for script, _k, _a in calls}:
            await client.script_load(source)
    raise AssertionError("unreachable")


async def run_to_end(
    work: Awaitable[T],
    on_cancel: Callable[[asyncio.Future[T]], Awaitable[object]] | None = None,
) -> T:
    """Await ``work`` shielded: a cancelled caller gets CancelledError, the work goes on.

    ``on_cancel`` is awaited with the work's future once it has ended, when its caller
    was cancelled (to give back what it took); it runs in a task started at once.
    """
    future = asyncio.ensure_future(work)
    keep(future)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if on_cancel is not None:
            keep(asyncio.ensure_future(_after(future, on_cancel)))
        raise


async def _after(
    future: asyncio.Future[T], then: Callable[[asyncio.Future[T]], Awaitable[object]]
) -> None:
    await asyncio.wait([future])
    await then(future)


def keep(future: asyncio.Future[Any]) -> None:
    """Keep a background task referenced until it ends."""
    _running.add(future)
    future.add_done_callback(_running.discard)

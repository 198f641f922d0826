"""Sending the lease scripts on a ``redis.asyncio`` client, and keeping work going.

The scripts, their arguments and the meaning of their answers live in
``fenced._scripts`` and ``fenced._lease`` (no I/O); this module only awaits them.

A plain client (``redis.asyncio.Redis`` over a standard pool, in UTF-8, with the
hiredis reader) has its script calls packed by hiredis and sent on a connection of its
pool, without ``execute_command``'s per-call overhead; other clients go through
redis-py's commands.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis
from redis._parsers import _AsyncHiredisParser
from redis.asyncio.connection import BlockingConnectionPool, ConnectionPool, DefaultParser
from redis.exceptions import NoScriptError, ResponseError

from .._scripts import Call, _pack

__all__ = ["call", "call_pipeline", "run_to_end"]

T = TypeVar("T")

#: Given the outcome of a call whose caller was cancelled after it was sent: a future
#: holding its reply or error (a ``redis.TimeoutError`` when no reply can tell).
OnCancel = Callable[["asyncio.Future[Any]"], Awaitable[object]]

#: Work that must finish although its caller was cancelled (releases, give-backs): a
#: task the loop only references weakly would be collected mid-flight.
_running: set[asyncio.Future[Any]] = set()

_PACKABLE_POOLS = (ConnectionPool, BlockingConnectionPool)


async def call(client: Any, request: Call, on_cancel: OnCancel | None = None) -> Any:
    """Run one script call (EVALSHA; EVAL when the server's script cache is cold).

    With ``on_cancel``, a call whose caller is cancelled once it may have been sent is
    followed to its end by a task of its own, which then awaits ``on_cancel`` with the
    outcome (to give back what the call took); the caller gets CancelledError at once.
    """
    script, keys, args = request
    if _pack is not None and _packable(client):
        try:
            return await _send_one(
                client, _pack(("EVALSHA", script.sha, len(keys), *keys, *args)), on_cancel
            )
        except NoScriptError:
            # EVAL also caches the script, so the next call is an EVALSHA hit again.
            return await _send_one(
                client, _pack(("EVAL", script.source, len(keys), *keys, *args)), on_cancel
            )
    if on_cancel is not None:
        return await run_to_end(_call(client, request), on_cancel)
    return await _call(client, request)


async def _call(client: Any, request: Call) -> Any:
    script, keys, args = request
    try:
        return await client.evalsha(script.sha, len(keys), *keys, *args)
    except NoScriptError:
        return await client.eval(script.source, len(keys), *keys, *args)


def _packable(client: Any) -> bool:
    """A plain client over a standard pool, in UTF-8, reading through hiredis (which a
    cancelled read leaves whole, so the reply can be read after it). The reply is the
    connection's own reading of it, in either protocol, as ``execute_command``'s is:
    redis-py has no reply callback for EVAL and EVALSHA."""
    if type(client) is not aredis.Redis or client.single_connection_client:
        return False
    pool: Any = client.connection_pool
    if type(pool) not in _PACKABLE_POOLS:
        return False
    kwargs = pool.connection_kwargs
    return kwargs.get("parser_class", DefaultParser) is _AsyncHiredisParser and str(
        kwargs.get("encoding", "utf-8")
    ).lower() in ("utf-8", "utf8")


async def _send_one(client: Any, packed: bytes, on_cancel: OnCancel | None) -> Any:
    """What ``execute_command`` does for one command: a connection from the pool, the
    client's retries (a connection error reconnects and sends again), the reply (an
    error reply raised, the connection kept).

    A caller cancelled while the reply is awaited hands the connection, reply unread, to
    a task that reads it and gives the connection back (with ``on_cancel``); without
    ``on_cancel`` the connection is closed, as redis-py closes it.
    """
    pool = client.connection_pool
    conn = await pool.get_connection()
    reading = False

    async def attempt() -> Any:
        nonlocal reading
        reading = False
        await _write(conn, packed)
        reading = True
        reply = await conn.read_response(disconnect_on_error=False)
        reading = False  # read: a cancel from here on leaves nothing on the connection
        return reply

    async def dropped(_error: BaseException) -> None:
        nonlocal reading
        reading = False  # whether that attempt landed, no reply will say
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(attempt, dropped)
    except ResponseError:
        raise  # the whole reply was read: the connection stays usable
    except asyncio.CancelledError:
        if reading and on_cancel is not None:
            keep(asyncio.ensure_future(_read_late(pool, conn, on_cancel)))
            conn = None  # released by the task, once the reply is read
        else:
            await conn.disconnect(nowait=True)
            if on_cancel is not None:
                # Cancelled while sending: it may have been sent, and no reply will say.
                keep(asyncio.ensure_future(on_cancel(_unknown())))
        raise
    except BaseException:
        # A reply may be left unread: this connection must not be used again.
        await conn.disconnect(nowait=True)
        raise
    finally:
        if conn is not None:
            await pool.release(conn)


async def _write(conn: Any, packed: bytes) -> None:
    """``conn.send_packed_command(packed)`` for a connection that is ready: written at
    once, and drained (within the socket timeout) only when the socket did not take it
    all, where redis-py starts a timed task for every command on Python 3.11."""
    writer = getattr(conn, "_writer", None)
    if writer is None or conn.health_check_interval or writer.transport.is_closing():
        await conn.send_packed_command(packed)  # connects, checks health, reports
        return
    writer.write(packed)  # a socket error closes the transport: the read reports it
    if not writer.transport.get_write_buffer_size():
        return
    try:
        await asyncio.wait_for(writer.drain(), conn.socket_timeout)
    except asyncio.TimeoutError:
        await conn.disconnect(nowait=True)
        raise redis.TimeoutError("Timeout writing to socket") from None
    except OSError as exc:
        await conn.disconnect(nowait=True)
        raise redis.ConnectionError(f"Error while writing to socket: {exc}") from exc


async def _read_late(pool: Any, conn: Any, on_cancel: OnCancel) -> None:
    """Read the reply a cancelled caller left on ``conn``, release it, then ``on_cancel``."""
    outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    try:
        outcome.set_result(await conn.read_response())
    except asyncio.CancelledError:
        outcome.cancel()  # the loop is closing: the grant, if any, expires with its ttl
        raise
    except BaseException as exc:  # read_response closed the connection if it must
        outcome.set_exception(exc)
    finally:
        await pool.release(conn)
    await on_cancel(outcome)


def _unknown() -> asyncio.Future[Any]:
    outcome: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    outcome.set_exception(redis.TimeoutError("cancelled while the call was being sent"))
    return outcome


async def call_pipeline(client: Any, calls: Sequence[Call]) -> list[Any]:
    """Many script calls in one round trip; errors come back in place of results.

    redis.asyncio's Cluster pipeline refuses scripts: on a Cluster client the calls are
    sent side by side instead (one round trip each, all in flight at once).
    """
    if type(client).__name__ == "RedisCluster":
        return list(
            await asyncio.gather(
                *(_call(client, request) for request in calls), return_exceptions=True
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

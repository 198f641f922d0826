"""Fences against one write to the claims' Redis: a fence key set past 2**53, to a float
or to what is not an integer. Fences stay exact integers, strictly increasing; a fence
key that is not one grants nothing and names the fix."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

import fenced
import fenced.aio
from fenced import Claim, CorruptKey, StaleFence
from fenced._lease import ClaimKeys
from fenced._lock import fence_key
from fenced.store import FilePointer, RedisPointer, upsert
from fenced.testing import RedisServer

NEAR = 2**53 + 1  # the first integer a double cannot hold

#: What a fence key may be set to that is not a fence the scripts can mint on.
NOT_FENCES = [
    "nan",
    "inf",
    "1e300",
    "-5",
    "abc",
    "",
    " 5",
    "05",
    "5.0",
    "0x10",
    str(2**63 - 1),  # its successor overflows a signed 64-bit integer
    str(2**64),
    "9" * 40,
]


def keys(name: str = "job") -> ClaimKeys:
    return ClaimKeys("fenced", name)


def _fences(r: Any, n: int, **options: Any) -> list[int]:
    """The fences of ``n`` holders of "job", one after another."""
    out = []
    for _ in range(n):
        claim = Claim(r, "job", ttl=10, heartbeat=False, **options)
        assert claim.acquire()
        assert claim.fence is not None
        out.append(claim.fence)
        claim.release()
    return out


@pytest.mark.parametrize("options", [{}, {"records": True}, {"limit": 3}], ids=str)
def test_fences_past_2_53_stay_exact_and_strictly_increase(
    r: Any, server: RedisServer, options: dict[str, Any]
) -> None:
    raw = server.client()
    raw.set(keys().fence, str(NEAR))
    assert _fences(r, 3, **options) == [NEAR + 1, NEAR + 2, NEAR + 3]
    assert raw.get(keys().fence) == str(NEAR + 3).encode()


def test_a_taken_over_lease_gets_an_exact_fence_past_2_53(r: Any, server: RedisServer) -> None:
    raw = server.client()
    raw.set(keys().fence, str(NEAR))
    claim = Claim(r, "job", ttl=10, heartbeat=False, task_id="t-1")
    assert claim.take_over()
    assert claim.fence == NEAR + 1
    claim.release()


def test_the_largest_fence_is_minted_once_then_the_key_fails_closed(
    r: Any, server: RedisServer
) -> None:
    raw = server.client()
    raw.set(keys().fence, str(2**63 - 2))
    assert _fences(r, 1) == [2**63 - 1]  # still a BIGINT, and a pointer's fence
    with pytest.raises(CorruptKey):
        _fences(r, 1)


def test_a_lock_fence_past_2_53_stays_exact(server: RedisServer) -> None:
    raw = server.client()
    raw.set(fence_key("report"), str(NEAR))
    fences = []
    for _ in range(3):
        lock = fenced.Lock(raw, "report", timeout=10)
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    assert fences == [NEAR + 1, NEAR + 2, NEAR + 3]


def _refused(exc: CorruptKey, key: str, value: str) -> None:
    message = str(exc)
    assert exc.key == key
    assert key in message and "not a fence" in message and repr(value)[:20] in message
    # The fix: set it above the fences issued, or delete it.
    assert f"SET {key}" in message and f"DEL {key}" in message


@pytest.mark.parametrize("value", NOT_FENCES)
@pytest.mark.parametrize("options", [{}, {"records": True}, {"limit": 3}], ids=str)
def test_a_fence_key_that_is_not_a_fence_grants_nothing(
    r: Any, server: RedisServer, value: str, options: dict[str, Any]
) -> None:
    raw = server.client()
    raw.set(keys().fence, value)
    claim = Claim(r, "job", ttl=10, heartbeat=False, **options)
    with pytest.raises(CorruptKey) as err:
        claim.acquire()
    _refused(err.value, keys().fence, value)
    assert claim.fence is None
    assert not any(raw.exists(keys().slot(i)) for i in range(3))  # no lease left behind
    assert raw.get(keys().fence) == value.encode()  # left for the operator to repair


@pytest.mark.parametrize("options", [{}, {"records": True}, {"limit": 3}], ids=str)
def test_a_fence_key_of_another_type_grants_nothing_and_is_left_as_it_is(
    r: Any, server: RedisServer, options: dict[str, Any]
) -> None:
    raw = server.client()
    raw.hset(keys().fence, "planted", "value")
    claim = Claim(r, "job", ttl=10, heartbeat=False, **options)
    with pytest.raises(CorruptKey, match="is a hash"):
        claim.acquire()
    assert claim.fence is None
    assert not any(raw.exists(keys().slot(i)) for i in range(3))  # no lease left behind
    assert raw.hgetall(keys().fence) == {b"planted": b"value"}


def test_a_fence_minted_in_the_same_microsecond_as_the_last_is_still_above_it(
    r: Any, server: RedisServer
) -> None:
    # The last fence ahead of the server's clock (as after a clock stepped back): the
    # grant's one write reads it and a second write mints the one above it.
    raw = server.client()
    ahead = int(raw.time()[0]) * 1_000_000 + 3_600_000_000
    raw.set(keys().fence, str(ahead), px=60_000)
    assert _fences(r, 2) == [ahead + 1, ahead + 2]
    assert raw.pttl(keys().fence) > 60_000  # the idle expiry (a week), written again


@pytest.mark.parametrize("value", ["nan", "1e300", "-5", "abc", str(2**63 - 1)])
def test_a_fence_key_that_is_not_a_fence_is_not_taken_over(
    r: Any, server: RedisServer, value: str
) -> None:
    raw = server.client()
    raw.set(keys().fence, value)
    claim = Claim(r, "job", ttl=10, heartbeat=False, task_id="t-1")
    with pytest.raises(CorruptKey) as err:
        claim.take_over()
    _refused(err.value, keys().fence, value)
    assert not raw.exists(keys().lock)


@pytest.mark.parametrize("value", ["nan", "1e300", "-5", "abc", str(2**63 - 1)])
def test_a_busy_slot_whose_fence_is_not_a_fence_shows_none(
    r: Any, server: RedisServer, value: str
) -> None:
    raw = server.client()
    raw.hset(keys().slots, mapping={"0": value, "1": value, "limit": "2"})
    raw.set(keys().lock, "ab:h:1:", px=10_000)
    raw.set(keys().slot(1), "cd:h:2:", px=10_000)
    claim = Claim(r, "job", ttl=10, heartbeat=False, limit=2)
    assert not claim.acquire()
    assert claim.holder is not None and claim.holder.fence is None


@pytest.mark.parametrize("value", ["nan", "1e300", "-5", "abc", str(2**63 - 1)])
def test_a_lock_whose_fence_key_is_not_a_fence_is_not_taken(
    redis_server: RedisServer, value: str
) -> None:
    raw = redis_server.client()
    raw.flushall()
    raw.set(fence_key("report"), value)
    with pytest.raises(CorruptKey) as err:
        fenced.Lock(raw, "report", timeout=10).acquire(blocking=False)
    _refused(err.value, fence_key("report"), value)
    assert raw.get("report") is None

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            with pytest.raises(CorruptKey):
                await fenced.aio.Lock(client, "report", timeout=10).acquire(blocking=False)
        finally:
            await client.aclose()

    asyncio.run(main())
    assert raw.get("report") is None
    raw.delete(fence_key("report"))


@pytest.mark.parametrize("value", ["nan", "-5", str(2**63 - 1)])
def test_an_aio_claim_refuses_a_fence_key_that_is_not_a_fence(
    redis_server: RedisServer, value: str
) -> None:
    raw = redis_server.client()
    raw.flushall()
    raw.set(keys().fence, value)

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            with pytest.raises(CorruptKey) as err:
                await fenced.aio.Claim(client, "job", ttl=10, heartbeat=False).acquire()
            _refused(err.value, keys().fence, value)
        finally:
            await client.aclose()

    asyncio.run(main())
    assert not raw.exists(keys().lock)
    raw.delete(keys().fence)


def test_a_stale_holder_past_2_53_is_refused_by_the_stores(
    r: Any, server: RedisServer, tmp_path: Path
) -> None:
    # One write sets the fence key past 2**53; two holders follow one another. The
    # first, paused past its lease, must not publish over the second.
    raw = server.client()
    raw.set(keys().fence, str(NEAR))
    first = Claim(r, "job", ttl=10, heartbeat=False)
    assert first.acquire()
    stale = first.fence
    first.release()
    second = Claim(r, "job", ttl=10, heartbeat=False)
    assert second.acquire()
    newer = second.fence
    assert stale is not None and newer is not None and stale < newer
    target = tmp_path / "out"
    target.write_bytes(b"output")
    for ptr in (RedisPointer(r, "job"), FilePointer(tmp_path / "current")):
        ptr.swap(target, fence=newer)
        with pytest.raises(StaleFence):
            ptr.swap(target, fence=stale)
        published = ptr.read()
        assert published is not None and published.fence == newer
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'rows.db'}")
    md = sa.MetaData()
    key, fence = sa.Column("k", sa.String(20), primary_key=True), sa.Column("fence", sa.BigInteger)
    rows = sa.Table("rows", md, key, fence)
    md.create_all(engine)
    assert upsert(engine, rows, [{"k": "a"}], "k", fence=newer).written == 1
    assert upsert(engine, rows, [{"k": "a"}], "k", fence=stale).written == 0
    with engine.connect() as conn:
        assert conn.execute(sa.select(rows.c.fence)).scalar_one() == newer
    engine.dispose()
    second.release()

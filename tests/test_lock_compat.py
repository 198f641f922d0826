"""fenced.Lock against redis-py's own Lock: the same checks run on both, on a real server.

Every behaviour of redis-py's lock test suite is checked here for ``redis.lock.Lock``
and for ``fenced.Lock`` alike (the ``lock_class`` parameter), so any difference shows
up as a failure. Where fenced differs on purpose, the test says so and asserts both
sides of the difference (README, "Drop-in for redis-py's Lock").
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio.lock
import redis.lock
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot
from redis.exceptions import LockError, LockNotOwnedError

import fenced
import fenced.aio
from _wait import wait_for
from fenced._lock import fence_key, hash_tag, shares_slot
from fenced._scripts import LOCK_ACQUIRE
from fenced.testing import RedisServer

LockClass = type[redis.lock.Lock]


@pytest.fixture(
    params=[
        pytest.param(redis.lock.Lock, id="redis-py"),
        pytest.param(fenced.Lock, id="fenced"),
    ]
)
def lock_class(request: pytest.FixtureRequest) -> LockClass:
    """Each lock class the same check runs on."""
    cls: LockClass = request.param
    return cls


@pytest.fixture
def client(server: RedisServer) -> Iterator[Any]:
    """A client that returns bytes (redis-py's tests compare tokens as bytes)."""
    c = server.client()
    yield c
    c.close()


@pytest.fixture
def decoded(server: RedisServer) -> Iterator[Any]:
    """A client with decode_responses=True."""
    c = server.client(decode_responses=True)
    yield c
    c.close()


def make(client: Any, lock_class: LockClass, name: str | bytes = "foo", **kwargs: Any) -> Any:
    """A lock through the client, as applications make them: ``r.lock(..., lock_class=)``."""
    return client.lock(name, lock_class=lock_class, **kwargs)


class FakeTime:
    """Stands in for the time module of redis-py's lock loop: sleeping moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def fake_time(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    """Both classes wait in redis-py's acquire loop, so one seam serves both."""
    fake = FakeTime()
    monkeypatch.setattr(redis.lock, "mod_time", fake)
    return fake


# -- redis-py's behaviours, on both classes ------------------------------------------------


def test_acquire_stores_the_token_under_the_name_without_expiry(
    client: Any, lock_class: LockClass
) -> None:
    lock = make(client, lock_class)
    assert lock.acquire(blocking=False)
    assert client.get("foo") == lock.local.token
    assert client.ttl("foo") == -1
    lock.release()
    assert client.get("foo") is None


@pytest.mark.parametrize("thread_local", [True, False])
def test_a_given_token_is_stored_as_bytes_and_cleared_on_release(
    client: Any, lock_class: LockClass, thread_local: bool
) -> None:
    lock = make(client, lock_class, thread_local=thread_local)
    assert lock.acquire(blocking=False, token="test")
    assert client.get("foo") == b"test"
    assert lock.local.token == b"test"
    assert client.ttl("foo") == -1
    lock.release()
    assert client.get("foo") is None
    assert lock.local.token is None


def test_generated_tokens_are_uuid_hex_bytes(client: Any, lock_class: LockClass) -> None:
    # The shape is what callers see and compare; which UUID version redis-py mints is its
    # own business (it changed between releases), so only fenced's own is pinned.
    lock = make(client, lock_class)
    assert lock.acquire(blocking=False)
    token = lock.local.token
    assert isinstance(token, bytes) and len(token) == 32
    made = uuid.UUID(hex=token.decode())
    assert made.variant == uuid.RFC_4122
    assert made.hex.encode() == token
    if lock_class is fenced.Lock:
        assert made.version == 4
    lock.release()


def test_tokens_have_the_shape_of_the_installed_redis_pys(client: Any) -> None:
    theirs, ours = make(client, redis.lock.Lock, "a"), make(client, fenced.Lock, "b")
    assert theirs.acquire(blocking=False) and ours.acquire(blocking=False)
    a, b = theirs.local.token, ours.local.token
    assert (type(a), len(a), a.isalnum(), a == a.lower()) == (type(b), len(b), True, True)
    theirs.release()
    ours.release()


def test_tokens_are_unique_across_threads_and_forks() -> None:
    from fenced._lock import new_token

    made: list[bytes] = []

    def burst() -> None:
        made.extend(new_token() for _ in range(2000))

    threads = [threading.Thread(target=burst) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child writes its tokens and leaves without running anything else
        os.write(write, b"".join(new_token() for _ in range(500)))
        os._exit(0)
    os.close(write)
    child = b""
    while chunk := os.read(read, 65536):
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    made += [child[i : i + 32] for i in range(0, len(child), 32)]
    assert len(made) == 8500
    assert len(set(made)) == len(made)


def test_locked(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class)
    assert lock.locked() is False
    lock.acquire(blocking=False)
    assert lock.locked() is True
    lock.release()
    assert lock.locked() is False


@pytest.mark.parametrize("responses", ["bytes", "decoded"])
def test_owned(client: Any, decoded: Any, lock_class: LockClass, responses: str) -> None:
    r = client if responses == "bytes" else decoded
    lock = make(r, lock_class)
    assert lock.owned() is False
    lock.acquire(blocking=False)
    assert lock.owned() is True
    lock.release()
    assert lock.owned() is False

    lock2 = make(r, lock_class)
    assert lock.owned() is False
    assert lock2.owned() is False
    lock2.acquire(blocking=False)
    assert lock.owned() is False
    assert lock2.owned() is True
    lock2.release()
    assert lock.owned() is False
    assert lock2.owned() is False


def test_competing_locks(client: Any, lock_class: LockClass) -> None:
    lock1 = make(client, lock_class)
    lock2 = make(client, lock_class)
    assert lock1.acquire(blocking=False)
    assert not lock2.acquire(blocking=False)
    lock1.release()
    assert lock2.acquire(blocking=False)
    assert not lock1.acquire(blocking=False)
    lock2.release()


def test_a_chosen_token_does_not_take_a_name_held_under_that_token(
    client: Any, lock_class: LockClass
) -> None:
    client.set("foo", "shared")
    assert not make(client, lock_class).acquire(blocking=False, token="shared")
    assert client.get("foo") == b"shared"


def test_timeout(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    assert 8 < client.ttl("foo") <= 10
    lock.release()


def test_float_timeout(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=9.5)
    assert lock.acquire(blocking=False)
    assert 8000 < client.pttl("foo") <= 9500
    lock.release()


def test_timeout_zero_means_no_expiry(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=0)
    assert lock.acquire(blocking=False)
    assert client.ttl("foo") == -1
    lock.release()


def test_an_expired_lock_can_be_taken(client: Any, lock_class: LockClass) -> None:
    first = make(client, lock_class, timeout=0.1)
    assert first.acquire(blocking=False)
    wait_for("the lock to expire", lambda: client.get("foo") is None, 5)
    second = make(client, lock_class, timeout=10)
    assert second.acquire(blocking=False)
    second.release()


def test_blocking_timeout(client: Any, lock_class: LockClass, fake_time: FakeTime) -> None:
    lock1 = make(client, lock_class)
    assert lock1.acquire(blocking=False)
    try:
        lock2 = make(client, lock_class, sleep=0.05, blocking_timeout=0.4)
        assert not lock2.acquire()
        assert fake_time.now == pytest.approx(0.4)
        assert fake_time.sleeps == [0.05] * 8
    finally:
        lock1.release()


def test_acquire_arguments_override_the_constructor(
    client: Any, lock_class: LockClass, fake_time: FakeTime
) -> None:
    holder = make(client, lock_class)
    assert holder.acquire(blocking=False)
    lock = make(client, lock_class, blocking=False)
    assert not lock.acquire()
    assert fake_time.sleeps == []
    # Positionally, as redis-py's signature orders them: sleep, blocking, blocking_timeout.
    assert not lock.acquire(0.25, True, 1.0)
    assert fake_time.sleeps == [0.25] * 4
    holder.release()


def test_high_sleep_small_blocking_timeout(
    client: Any, lock_class: LockClass, fake_time: FakeTime
) -> None:
    lock1 = make(client, lock_class)
    assert lock1.acquire(blocking=False)
    try:
        lock2 = make(client, lock_class, sleep=60, blocking_timeout=1)
        assert not lock2.acquire()
        assert fake_time.now == 0
        assert fake_time.sleeps == []
    finally:
        lock1.release()


def test_a_blocked_acquire_gets_the_lock_when_the_holder_releases(
    client: Any, lock_class: LockClass
) -> None:
    holder = make(client, lock_class)
    assert holder.acquire(blocking=False)
    waiter = make(client, lock_class, sleep=0.01, blocking_timeout=10)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(waiter.acquire()))
    t.start()
    time.sleep(0.1)
    assert got == []
    holder.release()
    t.join(10)
    assert got == [True]


def test_context_manager(client: Any, lock_class: LockClass) -> None:
    with make(client, lock_class, blocking_timeout=0.2) as lock:
        assert isinstance(lock, lock_class)
        assert client.get("foo") == lock.local.token
    assert client.get("foo") is None


def test_context_manager_blocking_timeout(
    client: Any, lock_class: LockClass, fake_time: FakeTime
) -> None:
    with make(client, lock_class, blocking=False):
        lock2 = make(client, lock_class, sleep=0.05, blocking_timeout=0.4)
        assert not lock2.acquire()
        assert fake_time.now == pytest.approx(0.4)
        assert fake_time.sleeps == [0.05] * 8


def test_context_manager_raises_lock_error_when_not_acquired(
    client: Any, lock_class: LockClass
) -> None:
    client.set("foo", "bar")
    ran = False
    with pytest.raises(LockError) as info, make(client, lock_class, blocking_timeout=0.1):
        ran = True
    assert not ran
    assert type(info.value) is LockError
    assert info.value.lock_name == "foo"
    assert client.get("foo") == b"bar"


def test_context_manager_release_error_raised_or_logged(
    client: Any, lock_class: LockClass, caplog: pytest.LogCaptureFixture
) -> None:
    with make(client, lock_class, timeout=0.1, raise_on_release_error=False):
        time.sleep(0.15)
    assert "no longer owned" in caplog.text

    with (
        pytest.raises(LockNotOwnedError),
        make(client, lock_class, timeout=0.1, raise_on_release_error=True),
    ):
        time.sleep(0.15)


def test_context_manager_released_inside_the_block(client: Any, lock_class: LockClass) -> None:
    with make(client, lock_class, timeout=1, raise_on_release_error=False) as lock:
        lock.release()

    with (
        pytest.raises(LockError),
        make(client, lock_class, timeout=1, raise_on_release_error=True) as lock,
    ):
        lock.release()


def test_context_manager_lock_taken_inside_the_block(client: Any, lock_class: LockClass) -> None:
    with (
        pytest.raises(LockNotOwnedError) as info,
        make(client, lock_class, timeout=10, blocking=False),
    ):
        client.set("foo", "a")
    assert info.value.lock_name == "foo"
    assert client.get("foo") == b"a", "a release must never delete another holder's lock"


def test_context_manager_passes_the_body_exception_through(
    client: Any, lock_class: LockClass
) -> None:
    with pytest.raises(KeyError), make(client, lock_class, timeout=10):
        raise KeyError("boom")
    assert client.get("foo") is None


def test_releasing_an_unlocked_lock_raises(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class)
    with pytest.raises(LockError) as info:
        lock.release()
    assert not isinstance(info.value, LockNotOwnedError)


def test_releasing_a_lock_no_longer_owned_raises(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class)
    lock.acquire(blocking=False)
    client.set("foo", "a")
    with pytest.raises(LockNotOwnedError):
        lock.release()
    assert lock.local.token is None  # cleared even though it raised
    assert client.get("foo") == b"a"


def test_extend(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    assert 8000 < client.pttl("foo") <= 10000
    assert lock.extend(10) is True
    assert 16000 < client.pttl("foo") <= 20000
    lock.release()


def test_extend_replace_ttl(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    assert lock.extend(10, replace_ttl=True)
    assert 8000 < client.pttl("foo") <= 10000
    lock.release()


def test_extend_float(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=10.5)
    assert lock.acquire(blocking=False)
    old = client.pttl("foo")
    assert lock.extend(10.5)
    assert old + 10000 < client.pttl("foo") <= old + 10500
    lock.release()


def test_extend_refusals(client: Any, lock_class: LockClass) -> None:
    with pytest.raises(LockError):
        make(client, lock_class, timeout=10).extend(10)  # not acquired
    forever = make(client, lock_class)
    assert forever.acquire(blocking=False)
    with pytest.raises(LockError):
        forever.extend(10)  # no timeout
    forever.release()
    taken = make(client, lock_class, timeout=10)
    assert taken.acquire(blocking=False)
    client.set("foo", "a")
    with pytest.raises(LockNotOwnedError):
        taken.extend(10)
    assert client.ttl("foo") == -1


def test_reacquire(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    assert client.pexpire("foo", 5000)
    assert client.pttl("foo") <= 5000
    assert lock.reacquire() is True
    assert 8000 < client.pttl("foo") <= 10000
    lock.release()


def test_reacquire_refusals(client: Any, lock_class: LockClass) -> None:
    with pytest.raises(LockError):
        make(client, lock_class, timeout=10).reacquire()
    forever = make(client, lock_class)
    assert forever.acquire(blocking=False)
    with pytest.raises(LockError):
        forever.reacquire()
    forever.release()
    taken = make(client, lock_class, timeout=10)
    assert taken.acquire(blocking=False)
    client.set("foo", "a")
    with pytest.raises(LockNotOwnedError):
        taken.reacquire()


def test_context_manager_reacquire_refusals(client: Any, lock_class: LockClass) -> None:
    with make(client, lock_class, timeout=None, blocking=False) as lock, pytest.raises(LockError):
        lock.reacquire()


def test_thread_local_tokens_keep_a_late_release_off_the_next_holder(
    client: Any, lock_class: LockClass
) -> None:
    # redis-py's docstring timeline: thread 1's lock expires while it works, thread 2
    # takes it through the same Lock object, thread 1's release must not free it.
    lock = make(client, lock_class, timeout=0.2, sleep=0.01)
    assert lock.acquire(blocking=False)
    got = threading.Event()

    def take() -> None:
        if lock.acquire(blocking_timeout=5):
            got.set()

    threading.Thread(target=take).start()
    assert got.wait(5)
    with pytest.raises(LockNotOwnedError):
        lock.release()
    assert client.get("foo") is not None, "thread 2 still holds the lock"


def test_without_thread_local_another_thread_can_release(
    client: Any, lock_class: LockClass
) -> None:
    lock = make(client, lock_class, thread_local=False)
    assert lock.acquire(blocking=False)
    t = threading.Thread(target=lock.release)
    t.start()
    t.join(5)
    assert client.get("foo") is None


def test_lock_class_argument(client: Any, lock_class: LockClass) -> None:
    lock = client.lock("foo", lock_class=lock_class)
    assert type(lock) is lock_class
    assert isinstance(lock, redis.lock.Lock)


# -- mixed fleets: redis-py Locks and fenced Locks on the same name --------------------------


def test_a_mixed_fleet_excludes_each_other(client: Any) -> None:
    plain = redis.lock.Lock(client, "job", timeout=10)
    fenced_lock = fenced.Lock(client, "job", timeout=10)
    assert plain.acquire(blocking=False)
    assert not fenced_lock.acquire(blocking=False)
    assert fenced_lock.locked() and not fenced_lock.owned()
    plain.release()
    assert fenced_lock.acquire(blocking=False)
    assert not plain.acquire(blocking=False)
    assert plain.locked() and not plain.owned()
    fenced_lock.release()
    assert not plain.locked()


def test_a_mixed_fleet_never_releases_the_other_holder(client: Any) -> None:
    plain = redis.lock.Lock(client, "job", timeout=10)
    fenced_lock = fenced.Lock(client, "job", timeout=10)
    assert fenced_lock.acquire(blocking=False)
    plain.local.token = b"a stale token"
    with pytest.raises(LockNotOwnedError):
        plain.release()
    assert fenced_lock.owned()
    fenced_lock.release()


def test_a_mixed_fleet_waits_for_each_other(client: Any) -> None:
    plain = redis.lock.Lock(client, "job", timeout=10)
    assert plain.acquire(blocking=False)
    waiter = fenced.Lock(client, "job", timeout=10, sleep=0.01, blocking_timeout=10)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(waiter.acquire()))
    t.start()
    time.sleep(0.1)
    assert got == []
    plain.release()
    t.join(10)
    assert got == [True]


def test_threads_of_both_kinds_never_overlap(server: RedisServer) -> None:
    inside: list[int] = []
    overlaps: list[int] = []

    def work(lock_class: LockClass, n: int) -> None:
        r = server.client()
        for _ in range(n):
            with r.lock("shared", timeout=10, sleep=0.001, lock_class=lock_class):
                inside.append(1)
                if len(inside) > 1:
                    overlaps.append(len(inside))
                time.sleep(0.001)
                inside.pop()
        r.close()

    threads = [
        threading.Thread(target=work, args=(cls, 30))
        for cls in (redis.lock.Lock, fenced.Lock, redis.lock.Lock, fenced.Lock)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert overlaps == []


# -- where fenced differs on purpose -----------------------------------------------------


def test_difference_fence(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    if lock_class is redis.lock.Lock:
        assert not hasattr(lock, "fence")
        lock.release()
        return
    first = lock.fence
    assert isinstance(first, int) and first > 0
    lock.release()
    assert lock.fence is None
    other = make(client, lock_class, timeout=10)
    assert other.acquire(blocking=False)
    assert other.fence > first
    other.release()


def test_difference_a_side_key_for_the_fence(client: Any, lock_class: LockClass) -> None:
    lock = make(client, lock_class, timeout=10)
    assert lock.acquire(blocking=False)
    lock.release()
    keys = set(client.keys("*"))
    if lock_class is redis.lock.Lock:
        assert keys == set()
    else:
        assert keys == {b"fenced:lock:{foo}:fence"}
        # Kept after the name's last use for idle_ttl (a week), not forever.
        assert 6 * 86400 < client.ttl("fenced:lock:{foo}:fence") <= 7 * 86400


def test_difference_names_must_be_text(client: Any, lock_class: LockClass) -> None:
    if lock_class is redis.lock.Lock:
        lock = make(client, lock_class, name=b"foo")
        assert lock.acquire(blocking=False)
        lock.release()
        return
    with pytest.raises(fenced.ConfigError, match="must be a str"):
        make(client, lock_class, name=b"foo")


def test_fence_strictly_increases_across_acquires_and_locks(client: Any) -> None:
    seen: list[int] = []
    locks = [fenced.Lock(client, "job", timeout=10), fenced.Lock(client, "job")]
    for i in range(200):
        lock = locks[i % 2]
        assert lock.acquire(blocking=False)
        assert lock.fence is not None
        seen.append(lock.fence)
        lock.release()
    assert all(b > a for a, b in itertools.pairwise(seen))
    # A mixed fleet does not disturb it: a redis-py holder mints nothing.
    plain = redis.lock.Lock(client, "job")
    assert plain.acquire(blocking=False)
    plain.release()
    assert locks[0].acquire(blocking=False)
    assert (locks[0].fence or 0) > seen[-1]
    locks[0].release()


def test_fence_is_above_a_stored_fence_from_the_future(client: Any) -> None:
    ahead = 2**52
    client.set("fenced:lock:{job}:fence", ahead)
    lock = fenced.Lock(client, "job")
    assert lock.acquire(blocking=False)
    assert lock.fence == ahead + 1
    lock.release()


def test_fence_is_at_least_redis_time_in_microseconds(client: Any) -> None:
    seconds, micros = client.time()
    lock = fenced.Lock(client, "job")
    assert lock.acquire(blocking=False)
    assert lock.fence is not None and lock.fence >= seconds * 1_000_000 + micros
    lock.release()


def test_fence_increases_after_its_key_expired(client: Any) -> None:
    lock = fenced.Lock(client, "job", timeout=0.2, idle_ttl=1)
    assert lock.acquire(blocking=False)
    first = lock.fence
    lock.release()
    wait_for("the idle fence key to expire", lambda: not client.exists(lock.fence_key), 10)
    assert lock.acquire(blocking=False)
    assert lock.fence is not None and first is not None and lock.fence > first
    lock.release()


def test_fence_increases_across_a_restart_without_persistence(own_server: RedisServer) -> None:
    r = own_server.client()
    lock = fenced.Lock(r, "job", timeout=10)
    fences = []
    for _ in range(5):
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        lock.release()
    own_server.restart()
    assert r.dbsize() == 0, "the restarted server kept nothing"
    lock = fenced.Lock(r, "job", timeout=10)
    assert lock.acquire(blocking=False)
    assert lock.fence is not None and lock.fence > max(f for f in fences if f is not None)
    lock.release()
    r.close()


def test_a_retried_acquire_of_our_own_token_is_granted_once(client: Any) -> None:
    # The acquire script's contract: a token made for this acquire, found holding the
    # name, is the same acquire sent again (its reply was lost): granted, same fence. A
    # token the caller chose is redis-py's: a held name is not taken, whoever holds it.
    keys = ("job", fence_key("job"))
    first = LOCK_ACQUIRE(client, keys, (b"tok", 10_000, 0, 1))
    assert int(first) > 0  # decimal text: a fence past 2**53 stays exact
    assert LOCK_ACQUIRE(client, keys, (b"tok", 10_000, 0, 1)) == first
    assert LOCK_ACQUIRE(client, keys, (b"tok", 10_000, 0, 0)) == 0
    assert LOCK_ACQUIRE(client, keys, (b"other", 10_000, 0, 1)) == 0


def test_bad_input_names_the_fix(client: Any) -> None:
    with pytest.raises(fenced.ConfigError, match="needs a timeout"):
        fenced.Lock(client, "job", auto_renew=True)
    with pytest.raises(fenced.ConfigError, match="only used with auto_renew"):
        fenced.Lock(client, "job", timeout=10, refresh_every=1)
    with pytest.raises(fenced.ConfigError, match="refresh_every"):
        fenced.Lock(client, "job", timeout=10, auto_renew=True, refresh_every=9)
    with pytest.raises(fenced.ConfigError, match="timeout"):
        fenced.Lock(client, "job", timeout=-1, auto_renew=True)
    with pytest.raises(fenced.ConfigError, match="idle_ttl"):
        fenced.Lock(client, "job", timeout=10, idle_ttl=0.5)
    with pytest.raises(fenced.ConfigError, match="namespace"):
        fenced.Lock(client, "job", namespace="a{b}")


def test_a_lock_takes_a_url_as_a_claim_does(server: RedisServer, client: Any) -> None:
    lock = fenced.Lock(server.url, "job", timeout=10)
    assert isinstance(lock, redis.lock.Lock) and isinstance(lock.redis, redis.Redis)
    assert lock.acquire(blocking=False)
    assert lock.fence is not None and client.get("job") == lock.local.token
    # The same key as redis-py's Lock: the two still exclude each other.
    assert not client.lock("job", timeout=10).acquire(blocking=False)
    assert lock.owned()
    first = lock.fence
    lock.release()
    assert client.get("job") is None
    with fenced.Lock(server.url, "job", timeout=10) as again:
        assert again.fence is not None and again.fence > first


def test_a_lock_given_no_client_names_the_fix(server: RedisServer, client: Any) -> None:
    with pytest.raises(fenced.ConfigError, match="no Redis given"):
        fenced.Lock(None, "job")
    with pytest.raises(fenced.ConfigError, match="int is not a Redis client"):
        fenced.Lock(42, "job")
    with pytest.raises(fenced.ConfigError, match="URL"):
        fenced.Lock("localhost:6379", "job")
    for given_client in (server.url, client):
        with pytest.raises(fenced.ConfigError, match=r"not a redis\.asyncio client.*fenced\.Lock"):
            fenced.aio.Lock(given_client, "job")


# -- the fence key's Cluster slot --------------------------------------------------------------


@given(st.text(min_size=0, max_size=30))
def test_the_fence_key_shares_the_slot_of_every_name_that_can(name: str) -> None:
    key = fence_key(name)
    if shares_slot(name):
        assert key_slot(key.encode()) == key_slot(name.encode())
    if hash_tag(name) is not None:
        assert hash_tag(key) == hash_tag(name)


@given(st.text(max_size=20), st.text(max_size=20))
def test_two_names_never_share_a_fence_key(a: str, b: str) -> None:
    if a != b:
        assert fence_key(a) != fence_key(b)


def test_hash_tags_follow_the_cluster_rule() -> None:
    assert hash_tag("job:{acme}:x") == "acme"
    assert hash_tag("{}x") is None
    assert hash_tag("a{b") is None
    assert hash_tag("a}{b}") == "b"
    assert fence_key("report") == "fenced:lock:{report}:fence"
    assert fence_key("job:{acme}:x") == "fenced:lock:fence:job:{acme}:x"


def test_on_a_cluster(cluster_server: RedisServer) -> None:
    cluster = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        for name in ("report", "job:{acme}:report", "a{b"):
            with cluster.lock(name, timeout=10, lock_class=fenced.Lock) as lock:
                assert lock.fence is not None
                assert cluster.get(name) == lock.local.token
        with pytest.raises(fenced.ConfigError, match="hash tag"):
            fenced.Lock(cluster, "a}b")
    finally:
        cluster.close()


# -- auto_renew -----------------------------------------------------------------------------


def test_auto_renew_keeps_a_short_lock_across_many_timeouts(client: Any) -> None:
    lock = fenced.Lock(client, "job", timeout=0.5, auto_renew=True)
    rival = fenced.Lock(client, "job", timeout=0.5)
    assert lock.acquire(blocking=False)
    end = time.monotonic() + 2.5  # five timeouts
    while time.monotonic() < end:
        assert not rival.acquire(blocking=False)
        assert not lock.lost
        time.sleep(0.1)
    assert lock.owned()
    assert 0 < client.pttl("job") <= 500
    lock.release()
    assert client.get("job") is None


def test_auto_renew_reports_a_stolen_lock(client: Any) -> None:
    told: list[fenced.Lock] = []
    lock = fenced.Lock(client, "job", timeout=0.6, auto_renew=True, on_lost=told.append)
    assert lock.acquire(blocking=False)
    client.set("job", "thief")
    wait_for("the renewal to find the lock taken", lambda: lock.lost, 5)
    assert lock.lost_reason == "the lock is gone or held under another token"
    assert not lock.owned()
    time.sleep(0.5)
    assert told == [lock], "on_lost is called once"
    with pytest.raises(LockNotOwnedError, match="lost"):
        lock.release()
    assert client.get("job") == b"thief"


def test_auto_renew_reports_a_deleted_lock_at_the_end_of_the_block(client: Any) -> None:
    with (
        pytest.raises(LockNotOwnedError),
        fenced.Lock(client, "job", timeout=0.6, auto_renew=True) as lock,
    ):
        client.delete("job")
        wait_for("the renewal to find the lock gone", lambda: lock.lost, 5)
    assert lock.lost, "a lost hold stays lost after its release"
    assert lock.acquire(blocking=False)
    assert not lock.lost, "until the next acquire"
    lock.release()


def test_a_timeout_longer_than_the_fence_idle_expiry_is_accepted(client: Any) -> None:
    lock = client.lock("job", timeout=30 * 86400, lock_class=fenced.Lock)
    assert lock.acquire(blocking=False)
    assert client.ttl("job") > 29 * 86400
    lock.release()


def test_auto_renew_reports_a_server_paused_past_the_deadline(own_server: RedisServer) -> None:
    r = own_server.client(socket_timeout=5)
    lock = fenced.Lock(r, "job", timeout=0.6, auto_renew=True)
    assert lock.acquire(blocking=False)
    own_server.pause()
    try:
        # Reading ``lost`` asks nothing of the (paused) server.
        wait_for("the local deadline to pass", lambda: lock.lost, 5)
        assert lock.lost_reason == "no renewal was confirmed before the local deadline"
    finally:
        own_server.resume()
    assert not lock.owned()
    # Whether or not the key outlived the pause, the hold is lost for good, and release
    # says so (it still deletes our own token, so the name is free at once).
    with pytest.raises(LockNotOwnedError):
        lock.release()
    assert r.get("job") is None
    r.close()


def test_auto_renew_gives_back_a_grant_that_came_after_its_deadline(
    own_server: RedisServer,
) -> None:
    r = own_server.client()
    admin = own_server.client()
    lock = fenced.Lock(r, "job", timeout=0.5, auto_renew=True)
    assert lock.acquire(blocking=False)  # the script is cached: the next is one EVALSHA
    lock.release()
    admin.execute_command("CLIENT", "PAUSE", 800, "ALL")
    assert not lock.acquire(blocking=False)
    assert r.get("job") is None, "a late grant must not sit in Redis"
    r.close()
    admin.close()


def test_auto_renew_is_kept_by_extend_and_reacquire(client: Any) -> None:
    lock = fenced.Lock(client, "job", timeout=0.6, auto_renew=True)
    assert lock.acquire(blocking=False)
    assert lock.extend(5)
    assert lock.reacquire()
    assert lock.extend(0.3, replace_ttl=True)  # shortened: renewed back to the timeout
    time.sleep(1.0)
    assert lock.owned() and not lock.lost
    lock.release()


def test_without_auto_renew_a_lock_is_never_reported_lost(client: Any) -> None:
    lock = fenced.Lock(client, "job", timeout=0.1)
    assert lock.acquire(blocking=False)
    time.sleep(0.2)
    assert not lock.lost  # nothing watches it: owned() asks Redis, as redis-py does
    assert not lock.owned()
    with pytest.raises(LockNotOwnedError):
        lock.release()


def test_auto_renew_through_r_lock_with_a_partial(client: Any) -> None:
    # r.lock() passes on only redis-py's arguments: fenced's options ride on a partial.
    renewing = functools.partial(fenced.Lock, auto_renew=True)
    with client.lock("job", timeout=0.5, lock_class=renewing) as lock:
        assert isinstance(lock, fenced.Lock) and lock.auto_renew
        time.sleep(1.2)
        assert lock.owned()
    assert client.get("job") is None


def test_a_release_past_the_deadline_declares_the_loss_once(client: Any) -> None:
    told: list[fenced.Lock] = []
    lock = fenced.Lock(client, "job", timeout=30, auto_renew=True, on_lost=told.append)
    assert lock.acquire(blocking=False)
    lock.local.hold._deadline = 0.0  # as if the process had slept past it, unnoticed
    with pytest.raises(LockNotOwnedError, match="lost while held"):
        lock.release()
    assert told == [lock], "on_lost once, whoever declares the loss"
    assert lock.lost_reason == "no renewal was confirmed before the local deadline"
    assert client.get("job") is None, "our token still held it: deleted"


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [
        pytest.param(redis.lock.Lock, fenced.Lock, id="sync"),
        pytest.param(redis.asyncio.lock.Lock, fenced.aio.Lock, id="asyncio"),
    ],
)
def test_every_method_takes_what_the_installed_redis_pys_takes(theirs: Any, ours: Any) -> None:
    # A drop-in follows the redis-py installed, whatever it added (8.2: acquire(sleep=)).
    for name, method in vars(theirs).items():
        if name.startswith("_") and name not in ("__init__", "__enter__", "__aenter__"):
            continue
        if not callable(method) or name not in vars(ours):
            continue  # inherited as it is
        want = inspect.signature(method).parameters
        have = inspect.signature(getattr(ours, name)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in have.values())
        for param in want.values():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            assert param.name in have or takes_any, f"{ours.__name__}.{name}({param.name}=)"
            if param.name in have and param.kind is not param.KEYWORD_ONLY:
                assert have[param.name].kind is not param.KEYWORD_ONLY, (name, param.name)

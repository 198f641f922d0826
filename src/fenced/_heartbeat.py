"""The one background renewer per process.

Every claim a process holds is renewed by a single daemon thread, started lazily the
first time a claim is held. On each wake it refreshes every claim that is due, or
nearly due (so renewals coalesce into a few pipelined round trips per interval even
for thousands of claims), and declares lost every claim whose local deadline passed.

Its requests go through a private connection pool cloned from the claim's client,
with a socket timeout shorter than the refresh interval: a paused or unreachable
Redis cannot hold the thread past a claim's deadline, so loss is declared on time
without waiting for a reply.

It holds claims weakly: a claim that nobody references any more (dropped without
``release()``, say after an exception) stops being renewed and expires by its ttl, as
if its process had died.

It talks to a claim only through the small :class:`Renewable` interface: what to renew
now, and what came of it.

After ``fork`` the child starts with an empty registry and no thread: a child holds
none of its parent's claims.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from typing import Any, NamedTuple, Protocol

import redis

from ._lease import UNREACHABLE
from ._scripts import REFRESH, run_pipeline

__all__ = ["Heartbeat", "Renewable", "Renewal", "heartbeat"]


class Renewal(NamedTuple):
    """What the heartbeat needs to know of one held lease, read at one moment."""

    client: Any
    key: str
    token: str
    ttl_ms: int
    refresh_every: float
    next_refresh: float
    deadline: float


class Renewable(Protocol):
    """What the heartbeat asks of a claim, and what it tells it."""

    @property
    def name(self) -> str: ...

    def renewal(self) -> Renewal | None:
        """The lease to renew, or None when this process does not hold it now."""

    def renewed(self, sent: float, token: str) -> None:
        """Redis extended the lease of ``token`` by a request sent at ``sent``."""

    def renewal_failed(self) -> None:
        """The renewal got no answer: keep the deadline, try again soon."""

    def renewal_refused(self, token: str) -> None:
        """The lease of ``token`` is gone or held under another token."""

    def expired(self, token: str) -> None:
        """The local deadline of ``token``'s lease passed with no renewal confirmed."""


log = logging.getLogger("fenced.heartbeat")

#: Refreshes per pipelined round trip. Redis reads a pipeline in chunks and serves
#: other clients in between, so a larger batch does not block them for longer.
BATCH = 2500
#: A claim is refreshed early when it is due within this share of its interval, so
#: claims acquired at different moments share round trips. At one half, two groups of
#: claims with the same interval always have a gap of at most half an interval on one
#: side, so they merge, and renewals settle into one round per interval (a claim is
#: never renewed more than twice per interval).
COALESCE = 0.5
#: The longest the thread sleeps when nothing is due sooner.
IDLE_WAIT = 30.0
#: The shortest such sleep (claims with shorter intervals wake the thread themselves).
MIN_NAP = 0.1


class Heartbeat:
    """Renews every claim of this process from one daemon thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        # Weak: a claim nobody references stops being renewed (see the module docstring).
        self._claims: dict[int, weakref.ref[Renewable]] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf
        # The thread never sleeps longer than the shortest interval it has served, so
        # a claim acquired while it sleeps is due no sooner than its next look and
        # add() need not wake it: a wake per acquire costs every acquire a thread switch.
        self._nap = IDLE_WAIT
        # (id of the claim's pool, timeout bucket) -> (that pool, weakly; its clone). The
        # pool is checked on every hit: a new pool can be given a dead one's id.
        self._pools: dict[tuple[int, float], tuple[weakref.ref[Any], Any]] = {}
        self.rounds = 0
        self.round_trips = 0

    # -- registry ---------------------------------------------------------------------

    def add(self, claim: Renewable) -> None:
        """Start renewing a claim (starts the thread on first use)."""
        lease = claim.renewal()
        if lease is None:
            return
        with self._cond:
            self._claims[id(claim)] = weakref.ref(claim)
            if lease.refresh_every < self._nap:
                self._nap = max(MIN_NAP, lease.refresh_every)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="fenced-heartbeat", daemon=True
                )
                self._thread.start()
            elif lease.next_refresh < self._wake_at:
                # Only wake the thread when this claim is due before its next wake.
                self._cond.notify()

    def discard(self, claim: Renewable) -> None:
        """Stop renewing a claim."""
        with self._cond:
            ref = self._claims.get(id(claim))
            if ref is not None and ref() in (claim, None):
                del self._claims[id(claim)]

    def claims(self) -> list[Renewable]:
        """The claims being renewed now."""
        with self._cond:
            return [c for ref in self._claims.values() if (c := ref()) is not None]

    def __len__(self) -> int:
        return len(self.claims())

    @property
    def thread(self) -> threading.Thread | None:
        """The renewing thread, if started."""
        return self._thread

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._tick()
            except Exception:  # a renewer that dies silently is the bug to avoid
                log.exception("fenced: heartbeat tick failed; retrying")
                time.sleep(0.05)

    def _tick(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                due: list[tuple[Renewable, Renewal]] = []
                # With the token it expired under: a claim released and acquired
                # again before it is declared lost holds a new lease, not this one.
                expired: list[tuple[Renewable, str]] = []
                wake = now + self._nap
                # A round runs when some claim is due; it then takes every claim due
                # within its slack too. (Claims in their slack alone start no round, so
                # a refresh that failed and is retried later does not spin the loop.)
                any_due = False
                for key, ref in list(self._claims.items()):
                    c = ref()
                    lease = c.renewal() if c is not None else None
                    if c is None or lease is None:
                        # Collected, or no longer held here: nothing to renew.
                        del self._claims[key]
                        continue
                    if now >= lease.deadline:
                        expired.append((c, lease.token))
                        del self._claims[key]
                        continue
                    if lease.next_refresh <= now:
                        any_due = True
                    else:
                        wake = min(wake, lease.next_refresh, lease.deadline)
                    if lease.next_refresh - lease.refresh_every * COALESCE <= now:
                        due.append((c, lease))
                if not any_due:
                    due = []
                if not due and not expired:
                    self._wake_at = wake
                    self._cond.wait(max(0.0, wake - now))
                    self._wake_at = math.inf
                    continue
            for c, token in expired:
                c.expired(token)
            if due:
                self._refresh(due)
            return

    def _refresh(self, due: list[tuple[Renewable, Renewal]]) -> None:
        by_client: dict[int, tuple[Any, list[tuple[Renewable, Renewal]]]] = {}
        for c, lease in due:
            client = self._client_for(lease.client, lease.refresh_every)
            by_client.setdefault(id(client), (client, []))[1].append((c, lease))
        self.rounds += 1
        for client, group in by_client.values():
            for start in range(0, len(group), BATCH):
                # Each lease is judged under the token it was read with: a claim
                # released and acquired again meanwhile has a new lease.
                batch = group[start : start + BATCH]
                calls = [(REFRESH, [lease.key], [lease.token, lease.ttl_ms]) for _c, lease in batch]
                sent = time.monotonic()
                try:
                    self.round_trips += 1
                    results = run_pipeline(client, calls)
                except UNREACHABLE as exc:
                    # Not confirmed: each claim keeps its deadline and is retried soon.
                    log.warning("fenced: heartbeat could not reach Redis: %s", exc)
                    for c, _lease in batch:
                        c.renewal_failed()
                    continue
                except Exception:  # a renewer that dies silently is the bug to avoid
                    log.exception("fenced: heartbeat round failed")
                    for c, _lease in batch:
                        c.renewal_failed()
                    continue
                for (c, lease), res in zip(batch, results):
                    if isinstance(res, Exception):
                        log.warning("fenced: refresh of %s failed: %s", c.name, res)
                        c.renewal_failed()
                    elif res == 1:
                        c.renewed(sent, lease.token)
                    else:
                        c.renewal_refused(lease.token)

    def _client_for(self, client: Any, refresh_every: float) -> Any:
        """A client on a private pool with a socket timeout below the claim's interval."""
        pool = getattr(client, "connection_pool", None)
        if pool is None or type(client) is not redis.Redis:
            return client  # cluster or custom clients: use them as they are
        # Bucket timeouts by powers of two so claims with similar intervals share a pool.
        timeout = min(5.0, max(0.05, refresh_every / 2))
        bucket = 2.0 ** math.floor(math.log2(timeout))
        key = (id(pool), bucket)
        cached = self._pools.get(key)
        if cached is not None and cached[0]() is pool:
            return cached[1]
        # redis-py 6+ keeps per-pool bookkeeping in connection_kwargs; a clone gets its own.
        kwargs = {
            k: v
            for k, v in pool.connection_kwargs.items()
            if not k.startswith("orig_") and k != "maint_notifications_pool_handler"
        }
        kwargs["socket_timeout"] = bucket
        kwargs["socket_connect_timeout"] = bucket
        try:
            private = redis.Redis(
                connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, max_connections=4, **kwargs
                )
            )
        except Exception:  # an exotic pool we cannot clone: share the claim's own
            return client
        self._pools[key] = (weakref.ref(pool), private)
        return private


_lock = threading.Lock()
_instance: Heartbeat | None = None


def heartbeat() -> Heartbeat:
    """The process's heartbeat (created on first use, and anew in a forked child)."""
    global _instance
    inst = _instance
    if inst is None:
        with _lock:
            if _instance is None:
                _instance = Heartbeat()
            inst = _instance
    return inst


def _after_fork_in_child() -> None:
    # The parent's thread does not exist here, and its locks may have been held at
    # the moment of the fork: start from nothing.
    global _instance, _lock
    _lock = threading.Lock()
    _instance = None


os.register_at_fork(after_in_child=_after_fork_in_child)

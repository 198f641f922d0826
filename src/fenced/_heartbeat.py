"""The one background renewer per process.

Every claim a process holds is renewed by a single daemon thread, started lazily the
first time a claim is held. On each wake it refreshes every claim that is due, or
nearly due (so renewals coalesce into a few pipelined round trips per interval even
for thousands of claims), and declares lost every claim whose local deadline passed.

Its requests go through a private connection pool cloned from the claim's client,
with a socket timeout shorter than the refresh interval: a paused or unreachable
Redis cannot hold the thread past a claim's deadline, so loss is declared on time
without waiting for a reply.

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
from typing import TYPE_CHECKING, Any

import redis

from ._scripts import REFRESH, run_pipeline

if TYPE_CHECKING:
    from ._claim import Claim

__all__ = ["Heartbeat", "heartbeat"]

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
        self._claims: dict[int, Claim] = {}
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

    def add(self, claim: Claim) -> None:
        """Start renewing a claim (starts the thread on first use)."""
        with self._cond:
            self._claims[id(claim)] = claim
            if claim.refresh_every < self._nap:
                self._nap = max(MIN_NAP, claim.refresh_every)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="fenced-heartbeat", daemon=True
                )
                self._thread.start()
            elif claim._next_refresh < self._wake_at:
                # Only wake the thread when this claim is due before its next wake.
                self._cond.notify()

    def discard(self, claim: Claim) -> None:
        """Stop renewing a claim."""
        with self._cond:
            self._claims.pop(id(claim), None)

    def __len__(self) -> int:
        return len(self._claims)

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
                due: list[Claim] = []
                # With the token it expired under: a claim released and acquired
                # again before it is declared lost holds a new lease, not this one.
                expired: list[tuple[Claim, str | None]] = []
                wake = now + self._nap
                # A round runs when some claim is due; it then takes every claim due
                # within its slack too. (Claims in their slack alone start no round, so
                # a refresh that failed and is retried later does not spin the loop.)
                any_due = False
                for c in self._claims.values():
                    if now >= c._deadline:
                        expired.append((c, c.token))
                        continue
                    if c._next_refresh <= now:
                        any_due = True
                    else:
                        wake = min(wake, c._next_refresh, c._deadline)
                    if c._next_refresh - c.refresh_every * COALESCE <= now:
                        due.append(c)
                if not any_due:
                    due = []
                for c, _token in expired:
                    self._claims.pop(id(c), None)
                if not due and not expired:
                    self._wake_at = wake
                    self._cond.wait(max(0.0, wake - now))
                    self._wake_at = math.inf
                    continue
            for c, token in expired:
                c._declare_lost("no refresh was confirmed before the local deadline", token)
            if due:
                self._refresh(due)
            return

    def _refresh(self, claims: list[Claim]) -> None:
        by_client: dict[int, tuple[Any, list[Claim]]] = {}
        for c in claims:
            client = self._client_for(c)
            by_client.setdefault(id(client), (client, []))[1].append(c)
        self.rounds += 1
        for client, group in by_client.values():
            for start in range(0, len(group), BATCH):
                batch = group[start : start + BATCH]
                # Snapshot the tokens: a claim released and acquired again meanwhile
                # must not be judged by the answer about its previous lease.
                tokens = [c.token for c in batch]
                calls = [(REFRESH, [c.key], [t, c._ttl_ms]) for c, t in zip(batch, tokens)]
                sent = time.monotonic()
                try:
                    self.round_trips += 1
                    results = run_pipeline(client, calls)
                except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                    # Not confirmed: each claim keeps its deadline and is retried soon.
                    log.warning("fenced: heartbeat could not reach Redis: %s", exc)
                    for c in batch:
                        c._refresh_failed(sent)
                    continue
                except Exception:  # a renewer that dies silently is the bug to avoid
                    log.exception("fenced: heartbeat round failed")
                    for c in batch:
                        c._refresh_failed(sent)
                    continue
                for c, token, res in zip(batch, tokens, results):
                    if isinstance(res, Exception):
                        log.warning("fenced: refresh of %s failed: %s", c.name, res)
                        c._refresh_failed(sent)
                    elif res == 1:
                        c._refresh_confirmed(sent, token)
                    else:
                        c._declare_lost("the lease is gone or held under another token", token)

    def _client_for(self, claim: Claim) -> Any:
        """A client on a private pool with a socket timeout below the claim's interval."""
        client = claim.redis
        pool = getattr(client, "connection_pool", None)
        if pool is None or type(client) is not redis.Redis:
            return client  # cluster or custom clients: use them as they are
        # Bucket timeouts by powers of two so claims with similar intervals share a pool.
        timeout = min(5.0, max(0.05, claim.refresh_every / 2))
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

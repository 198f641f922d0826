"""The one renewer per process: a scheduler thread, and one lane per Redis server.

Every claim a process holds is renewed from here. The scheduler thread, started
lazily the first time a claim is held, never talks to Redis itself: on each wake it
declares lost every claim whose local deadline passed, and hands the claims that are
due, or nearly due (so renewals coalesce into a few pipelined round trips per
interval even for thousands of claims), to the **lane** of their server. A lane is a
thread with a private connection pool cloned from the claim's client, with a socket
timeout below the refresh interval and no retries: one renewal round against a
partitioned or paused server costs one socket timeout, and a stuck server holds up
only its own lane. So a claim is declared lost no later than its local deadline plus
one refresh interval, whatever the client's retry and timeout settings, and one
unreachable Redis never delays renewals on another.

A server is what a claim's keys live on: for a Redis Cluster client, the node that owns
the claim's slot (each node's claims go in their own pipelined rounds; a MOVED or ASK
answer is followed through the cluster client, and a node that stops answering makes it
read the slot map again); for a Sentinel client, the master the sentinels name, through
a private pool that finds it again after a failover.

It holds claims weakly: a claim that nobody references any more (dropped without
``release()``, say after an exception) stops being renewed and expires by its ttl, as
if its process had died. A lane whose client is gone, or that no claim has used for a
while, closes its connections.

It talks to a claim only through the small :class:`Renewable` interface: what to renew
now, and what came of it. What a claim's callbacks raise (even ``SystemExit``) is
logged, never allowed to stop the renewals of other claims.

After ``fork`` the child starts with an empty registry and no threads: a child holds
none of its parent's claims.

Its time is a seam: a :class:`Heartbeat` made with another ``clock`` and ``wait`` (tests
drive time with one) reads that clock for every deadline, interval and ``sent`` it
tells a claim, and sleeps through ``wait``; the claims it renews must read the same
clock. The process's heartbeat uses ``time.monotonic`` and ``Condition.wait``.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from . import events
from ._audit import claim_fields
from ._client import is_cluster, node_client, refresh_slots
from ._lease import UNREACHABLE, refresh_request
from ._printable import readable
from ._scripts import Call, run_pipeline

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
    #: The name's keys that outlive the lease, kept from expiring while it is held.
    lasting: tuple[str, ...] = ()
    idle_ms: int = 0
    #: Replicas that must acknowledge each renewal (WAIT), and how long to wait for them.
    replicas: int = 0
    replica_timeout_ms: int = 0
    #: The name's replaced notes (REPLACE writes them), read by a refused renewal.
    notes: str = ""
    #: The name's enqueue marker and the run's task id (``claim_enqueue="until_finished"``):
    #: each renewal keeps the marker alive one ttl while it holds that task id, so a
    #: marker a lost release left behind lasts no longer than the lease would have.
    marker: tuple[str, str] | None = None


def refresh_call(lease: Renewal) -> Call:
    """REFRESH of one lease: with the name's replaced notes, a refusal says why."""
    return refresh_request(
        lease.key,
        lease.token,
        lease.ttl_ms,
        lease.idle_ms,
        lease.lasting,
        lease.notes,
        lease.marker,
    )


def refused_why(reply: Any) -> str | None:
    """What a refused REFRESH said of the lease's loss (REPLACE's note), if anything."""
    if isinstance(reply, (bytes, str)):
        return readable(reply)
    return None


class Renewable(Protocol):
    """What the heartbeat asks of a claim, and what it tells it."""

    @property
    def name(self) -> str: ...

    def renewal(self) -> Renewal | None:
        """The lease to renew, or None when this process does not hold it now."""

    def schedule(self) -> tuple[float, float] | None:
        """(its refresh interval, when it is next due) of the lease held now, or None
        when this process does not hold it: all that starting to renew it needs."""

    def renewed(self, sent: float, token: str) -> None:
        """Redis extended the lease of ``token`` by a request sent at ``sent``."""

    def retry_soon(self) -> None:
        """No confirmed answer yet (a renewal on its way, or none came): look again soon."""

    def renewal_event(self, duration: float, error: BaseException | None = None) -> None:
        """A renewal's round trip took ``duration`` seconds (``error``: it failed). Told
        only while someone subscribed to :mod:`fenced.events`, after ``renewed``."""

    def renewal_refused(self, token: str, why: str | None = None) -> None:
        """The lease of ``token`` is gone or held under another token (``why``: what
        the run that took it over noted)."""

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
#: A renewal sent but not yet confirmed is looked at again after this share of its
#: interval (``Claim.retry_soon``); the scheduler sleeps that long after a round.
RETRY_SHARE = 0.35
#: The longest the scheduler sleeps when nothing is due sooner.
IDLE_WAIT = 30.0
#: The shortest such sleep (claims with shorter intervals wake the thread themselves).
MIN_NAP = 0.1
#: A lane no claim has used for this long closes its connections (they reopen on use).
LANE_IDLE = 10.0

Batch = list[tuple[Renewable, Renewal]]


def _tell(what: Callable[..., None], *args: Any) -> None:
    """Tell a claim something; nothing it raises may stop other claims' renewals."""
    try:
        what(*args)
    except BaseException:  # even SystemExit: this thread serves every claim
        log.exception("fenced: a claim's heartbeat callback failed")


def failed(part: Batch, took: float, exc: BaseException) -> None:
    """A renewal round of ``part`` failed with ``exc`` after ``took`` seconds: each claim
    is told to look again soon (and, for the events, what failed)."""
    report = events.enabled()
    for c, _lease in part:
        _tell(c.retry_soon)
        if report:
            _tell(c.renewal_event, took, exc)


def refresh_failed(c: Renewable, exc: BaseException) -> None:
    """Log the failed renewal of one claim (with its structured fields)."""
    log.warning(
        "fenced: refresh of %s failed: %s",
        c.name,
        exc,
        extra=claim_fields(c.name, event="renewal_failed", label=getattr(c, "label", None)),
    )


class _Lane:
    """One server's renewals: a thread and a private client, so a stuck server waits alone."""

    def __init__(
        self,
        client: Any,
        owner: weakref.ref[Any] | None,
        private: bool,
        timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self._clock = clock  # the heartbeat's: what it tells a claim was sent when
        self.timeout = timeout  # the socket timeout of its connections
        self.owner = owner  # the client this lane serves as it is, None for a server's lane
        self.private = private  # a clone of that pool, which the lane owns and closes
        self.last_used = clock()
        # Idle means: unused for longer than two intervals of its slowest claim (a lane
        # between two renewals is not idle), and at least LANE_IDLE.
        self.idle_after = LANE_IDLE
        self.busy = False
        self.closed = False
        self.round_trips = 0
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fenced-heartbeat-lane", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch) -> bool:
        """Renew ``batch`` on this lane's thread; False when it is still busy with the last."""
        if self.busy or self.closed:
            return False
        self.busy = True
        self.last_used = self._clock()
        slowest = max(lease.refresh_every for _c, lease in batch)
        self.idle_after = max(self.idle_after, 2 * slowest)
        self._queue.put(batch)
        return True

    def close(self) -> None:
        """Stop the thread once idle, and close the private connections."""
        self.closed = True
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                break
            try:
                self._renew(batch)
            except BaseException:  # a renewer that dies silently is the bug to avoid
                log.exception("fenced: heartbeat round failed")
            finally:
                self.busy = False
        if self.private:
            try:
                self.client.connection_pool.disconnect()
            except Exception:
                pass

    def _renew(self, batch: Batch) -> None:
        if is_cluster(self.client):
            # A cluster client that cannot be split into its nodes (no slot map yet):
            # redis-py refuses scripts in a cluster pipeline, so one call per claim.
            for c, lease in batch:
                self._renew_one(c, lease)
            return
        for start in range(0, len(batch), BATCH):
            # Each lease is judged under the token it was read with: a claim released
            # and acquired again meanwhile has a new lease.
            part = batch[start : start + BATCH]
            calls = [refresh_call(lease) for _c, lease in part]
            # One WAIT after the batch covers every write before it on this connection,
            # for at most half the socket timeout: the replies before it stay readable.
            replicas = max(lease.replicas for _c, lease in part)
            wait = None
            if replicas:
                longest = max(lease.replica_timeout_ms for _c, lease in part)
                wait = (replicas, max(1, min(longest, int(self.timeout * 500))))
            sent = self._clock()
            try:
                self.round_trips += 1
                results = run_pipeline(self.client, calls, wait=wait)
            except UNREACHABLE as exc:
                # Not confirmed: each claim keeps its deadline and is retried soon.
                log.warning(
                    "fenced: heartbeat could not reach Redis: %s",
                    exc,
                    extra={"fenced_event": "renewal_failed"},
                )
                self._lost_track(part)
                failed(part, self._clock() - sent, exc)
                continue
            except Exception as exc:
                log.exception(
                    "fenced: heartbeat round failed", extra={"fenced_event": "renewal_failed"}
                )
                failed(part, self._clock() - sent, exc)
                continue
            took = self._clock() - sent
            report = events.enabled()
            acked = results.pop() if wait else 0
            if wait and (isinstance(acked, Exception) or acked < replicas):
                log.warning(
                    "fenced: renewals not acknowledged by %d replica(s) (%s): not confirmed",
                    replicas,
                    acked,
                )
            for (c, lease), res in zip(part, results):
                if isinstance(res, redis.exceptions.AskError):  # MOVED too: a slot moved
                    refresh_slots(lease.client)
                    self._renew_one(c, lease)
                elif isinstance(res, Exception):
                    refresh_failed(c, res)
                    _tell(c.retry_soon)
                    if report:
                        _tell(c.renewal_event, took, res)
                elif res != 1:
                    _tell(c.renewal_refused, lease.token, refused_why(res))
                elif lease.replicas and (isinstance(acked, Exception) or acked < lease.replicas):
                    _tell(c.retry_soon)
                else:
                    _tell(c.renewed, sent, lease.token)
                    if report:
                        _tell(c.renewal_event, took)

    @staticmethod
    def _lost_track(part: Batch) -> None:
        """A cluster node that stopped answering may have failed over: re-read the map."""
        for client in {id(lease.client): lease.client for _c, lease in part}.values():
            refresh_slots(client)

    def _renew_one(self, c: Renewable, lease: Renewal) -> None:
        """One renewal through the claim's own client (it follows MOVED and ASK)."""
        sent = self._clock()
        try:
            self.round_trips += 1
            script, keys, args = refresh_call(lease)
            res = script(lease.client, keys, args)
        except Exception as exc:
            refresh_failed(c, exc)
            refresh_slots(lease.client)
            failed([(c, lease)], self._clock() - sent, exc)
            return
        if res != 1:
            _tell(c.renewal_refused, lease.token, refused_why(res))
        elif lease.replicas:
            _tell(c.retry_soon)  # acknowledged by replicas only in a pipelined round
        else:
            _tell(c.renewed, sent, lease.token)
            if events.enabled():
                _tell(c.renewal_event, self._clock() - sent)


def _clonable(client: Any, pool: Any) -> bool:
    """Whether the heartbeat can make its own pool like ``pool``: standard ones only."""
    if type(client) is not redis.Redis:
        return False
    if type(pool) is SentinelConnectionPool:
        return bool(pool.is_master)
    return type(pool) in (redis.ConnectionPool, redis.BlockingConnectionPool)


def _server_of(pool: Any) -> tuple[Any, ...]:
    """Which server (and as whom) a pool talks to: the clients a lane may share."""
    kw = pool.connection_kwargs
    if isinstance(pool, SentinelConnectionPool):
        # The sentinels' master of a service; the manager tells groups apart.
        where: tuple[Any, ...] = ("sentinel", pool.service_name, id(pool.sentinel_manager))
    else:
        where = (kw.get("host"), kw.get("port"), kw.get("path"))
    return (
        pool.connection_class,
        *where,
        kw.get("db", 0),
        kw.get("username"),
        kw.get("password"),
        kw.get("decode_responses", False),
    )


class Heartbeat:
    """Renews every claim of this process: one scheduler thread, one lane per server.

    ``clock`` is what every deadline and interval is read on, and ``wait(cond,
    timeout)`` how the scheduler sleeps (it holds ``cond``, as ``Condition.wait``
    wants): seams for tests, which drive time instead of sleeping it. The claims
    renewed must read the same clock.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wait: Callable[[threading.Condition, float], object] = threading.Condition.wait,
    ) -> None:
        self._clock = clock
        self._wait = wait
        # The condition's own lock: add() and discard(), on every acquire and release,
        # take it directly (a Condition's ``with`` is two more Python calls).
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        # Weak: a claim nobody references stops being renewed (see the module docstring).
        self._claims: dict[int, weakref.ref[Renewable]] = {}
        self._thread: threading.Thread | None = None
        self._wake_at = math.inf
        # Set by add() when it wakes the thread, cleared by each scan: a claim added while
        # a round is sent (no lock held, nobody waiting to be notified) is seen by the
        # rest after that round, which then looks again instead of sleeping.
        self._added = False
        # The thread never sleeps longer than the shortest interval it has served, so
        # a claim acquired while it sleeps is due no sooner than its next look and
        # add() need not wake it: a wake per acquire costs every acquire a thread switch.
        self._nap = IDLE_WAIT
        # (the server, timeout bucket) -> its lane: clients of one server share a lane
        # and its connections, however many clients a program makes.
        self._lanes: dict[tuple[Any, float], _Lane] = {}
        self.rounds = 0
        # Round trips of the lanes closed so far (they still count).
        self._closed_trips = 0

    @property
    def round_trips(self) -> int:
        """Pipelined renewal round trips sent so far (all lanes, closed ones too)."""
        return self._closed_trips + sum(lane.round_trips for lane in list(self._lanes.values()))

    def _retire(self, lane: _Lane) -> None:
        lane.close()
        self._closed_trips += lane.round_trips

    # -- registry ---------------------------------------------------------------------

    def add(self, claim: Renewable) -> None:
        """Start renewing a claim (starts the thread on first use).

        Every acquire comes here: it reads two numbers of the claim, not its whole
        :class:`Renewal` (the thread asks for that when the claim is due)."""
        schedule = claim.schedule()
        if schedule is None:
            return
        refresh_every, next_refresh = schedule
        ref = weakref.ref(claim)
        with self._mutex:
            self._claims[id(claim)] = ref
            if refresh_every < self._nap:
                self._nap = max(MIN_NAP, refresh_every)
            thread = self._thread
            if thread is None or not thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="fenced-heartbeat", daemon=True
                )
                self._thread.start()
            elif next_refresh < self._wake_at:
                # Only wake the thread when this claim is due before its next wake.
                self._added = True
                self._cond.notify()

    def discard(self, claim: Renewable) -> None:
        """Stop renewing a claim."""
        key = id(claim)
        with self._mutex:
            ref = self._claims.get(key)
            if ref is not None and ref() in (claim, None):
                del self._claims[key]

    def claims(self) -> list[Renewable]:
        """The claims being renewed now."""
        with self._cond:
            return [c for ref in self._claims.values() if (c := ref()) is not None]

    def lanes(self) -> int:
        """How many server lanes are open."""
        return sum(1 for lane in list(self._lanes.values()) if not lane.closed)

    def __len__(self) -> int:
        return len(self.claims())

    @property
    def thread(self) -> threading.Thread | None:
        """The scheduler thread, if started."""
        return self._thread

    # -- the loop ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                self._tick()
            except BaseException:  # a renewer that dies silently is the bug to avoid
                log.exception("fenced: heartbeat tick failed; retrying")
                time.sleep(0.05)

    def _tick(self) -> None:
        while True:
            with self._cond:
                now = self._clock()
                self._added = False
                due: Batch = []
                # With the token it expired under: a claim released and acquired
                # again before it is declared lost holds a new lease, not this one.
                expired: list[tuple[Renewable, str]] = []
                wake = now + self._nap
                if self._lanes:
                    wake = min(wake, now + LANE_IDLE)
                # A round runs when some claim is due; it then takes every claim due
                # within its slack too. (Claims in their slack alone start no round, so
                # a refresh that failed and is retried later does not spin the loop.)
                any_due = False
                # The soonest renewal among the claims in their slack: the wake when no
                # round runs now (when one does, they go with it).
                slack_wake = math.inf
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
                    wake = min(wake, lease.deadline)
                    if lease.next_refresh <= now:
                        any_due = True
                    if lease.next_refresh - lease.refresh_every * COALESCE <= now:
                        due.append((c, lease))
                        slack_wake = min(slack_wake, lease.next_refresh)
                    else:
                        wake = min(wake, lease.next_refresh)
                if not any_due:
                    due = []
                    wake = min(wake, slack_wake)
                if not due and not expired:
                    self._prune(now)
                    self._wake_at = wake
                    self._wait(self._cond, max(0.0, wake - now))
                    self._wake_at = math.inf
                    continue
            for c, token in expired:
                _tell(c.expired, token)
            if due:
                self._dispatch(due)
                # The claims just sent look again at their retry time at the soonest
                # (``retry_soon``): until then only the claims seen waiting, or a new
                # claim (add() wakes the thread), can be due. Sleeping till then spares a
                # scan of every claim right after each round.
                soonest = min(lease.refresh_every for _c, lease in due) * RETRY_SHARE
                with self._cond:
                    if self._added:  # a claim came while the round was sent
                        return
                    until = min(wake, self._clock() + soonest)
                    self._wake_at = until
                    self._wait(self._cond, max(0.0, until - self._clock()))
                    self._wake_at = math.inf
            return

    def _dispatch(self, due: Batch) -> None:
        by_lane: dict[int, tuple[_Lane, Batch]] = {}
        # The lane of a client (and interval) is looked up once per round, not per claim;
        # a cluster client's lane depends on each claim's slot. The leases hold their
        # clients, so no id is reused within the round.
        known: dict[tuple[int, float], _Lane] = {}
        for c, lease in due:
            lane = known.get((id(lease.client), lease.refresh_every))
            if lane is None:
                lane = self._lane_for(lease.client, lease.refresh_every, lease.key)
                if not is_cluster(lease.client):
                    known[id(lease.client), lease.refresh_every] = lane
            by_lane.setdefault(id(lane), (lane, []))[1].append((c, lease))
        self.rounds += 1
        for lane, batch in by_lane.values():
            # Sent, or its lane still waits on its server: either way no answer yet,
            # so the claims look again a little later (and the loop does not spin).
            for c, _lease in batch:
                _tell(c.retry_soon)
            lane.submit(batch)

    def _prune(self, now: float) -> None:
        """Close lanes whose client is gone, or that no claim used for a while."""
        for key, lane in list(self._lanes.items()):
            gone = lane.owner is not None and lane.owner() is None
            if gone or (not lane.busy and now - lane.last_used > lane.idle_after):
                self._retire(lane)
                del self._lanes[key]

    def _lane_for(self, client: Any, refresh_every: float, name_key: str | None = None) -> _Lane:
        """The lane of a client's server, with a socket timeout below the interval.

        On a cluster, the server is the node that owns ``key``'s slot: each node's
        renewals go in their own pipelined rounds, so a node that is down delays only
        the claims whose slots it owns (``name_key`` is the claim's lock key).
        """
        if name_key is not None and is_cluster(client):
            try:
                client = node_client(client, name_key)
            except Exception:  # no slot map yet: the cluster client's own lane
                pass
        pool = getattr(client, "connection_pool", None)
        # Bucket timeouts by powers of two so claims with similar intervals share a pool.
        timeout = min(5.0, max(0.05, refresh_every / 2))
        bucket = 2.0 ** math.floor(math.log2(timeout))
        lane: _Lane | None
        if _clonable(client, pool):
            key: tuple[Any, float] = (_server_of(pool), bucket)
            lane = self._lanes.get(key)
            if lane is not None and not lane.closed:
                return lane
            private = self._private_client(client, pool, bucket)
            if private is not client:
                lane = _Lane(private, None, private=True, timeout=bucket, clock=self._clock)
                self._lanes[key] = lane
                return lane
        # A client used as it is (Cluster, custom, or a pool that cannot be cloned): its
        # lane is its own, and ends with it. A new client can be given a dead one's id.
        key = (("client", id(client)), bucket)
        lane = self._lanes.get(key)
        owner = lane.owner if lane is not None else None
        if lane is not None and not lane.closed and owner is not None and owner() is client:
            return lane
        if lane is not None:
            self._retire(lane)
        own_timeout = getattr(pool, "connection_kwargs", {}).get("socket_timeout") or 5.0
        lane = _Lane(
            client,
            weakref.ref(client),
            private=False,
            timeout=float(own_timeout),
            clock=self._clock,
        )
        self._lanes[key] = lane
        return lane

    def _client_for(self, client: Any, refresh_every: float, name_key: str | None = None) -> Any:
        """The client a lane renews through (for tests and tools)."""
        return self._lane_for(client, refresh_every, name_key).client

    @staticmethod
    def _private_client(client: Any, pool: Any, timeout: float) -> Any:
        """A clone of the client's pool: short timeouts, no retries, few connections."""
        if not _clonable(client, pool):
            return client  # custom clients and pools: use them as they are
        # redis-py 6+ keeps per-pool bookkeeping in connection_kwargs; a clone gets its own.
        kwargs = {
            k: v
            for k, v in pool.connection_kwargs.items()
            if not k.startswith("orig_")
            and k not in ("maint_notifications_pool_handler", "connection_pool")
        }
        kwargs["socket_timeout"] = timeout
        kwargs["socket_connect_timeout"] = timeout
        # The user's retry policy (redis-py 6 retries ten times by default) would hold a
        # round against a black-holed server for many timeouts: one try, then the
        # scheduler looks again within the interval.
        kwargs["retry"] = Retry(NoBackoff(), 0)
        kwargs["retry_on_error"] = []
        kwargs.pop("retry_on_timeout", None)
        try:
            if isinstance(pool, SentinelConnectionPool):
                # The master the sentinels name, found again after a failover.
                return redis.Redis(
                    connection_pool=SentinelConnectionPool(  # type: ignore[no-untyped-call]
                        pool.service_name,
                        pool.sentinel_manager,
                        connection_class=pool.connection_class,
                        check_connection=pool.check_connection,
                        max_connections=4,
                        **kwargs,
                    )
                )
            return redis.Redis(
                connection_pool=redis.ConnectionPool(
                    connection_class=pool.connection_class, max_connections=4, **kwargs
                )
            )
        except Exception:  # an exotic pool we cannot clone: share the claim's own
            return client


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

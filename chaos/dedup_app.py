"""The dedup lane: fenced's Celery options in a real ``celery worker``, under the nemesis.

``celery -A chaos.dedup_app worker`` (the harness starts it, prefork). Each task holds
a claim on the lock Redis (the one the nemesis restarts, pauses and cuts) and sleeps a
little under it; :mod:`chaos.feeder` calls the tasks all through the run. Every run
logs ``dd-start`` and ``dd-end`` (claim name, task, task id, fence, token, arguments,
the monotonic time); every delivery logs ``dd-post`` from ``task_postrun`` (its state,
and a skip's reason), so the checker can say what became of every call.

=====================  ============================  =====================================
task                   claim                         what it exercises
=====================  ============================  =====================================
``dd.started``         ``dd:started``                ``claim_enqueue="until_started"``
``dd.finished``        ``dd:finished``               ``claim_enqueue="until_finished"``
``dd.cooldown``        ``dd:cooldown``               ``claim_cooldown``
``dd.limit``           ``dd:limit``                  ``claim_limit=2``
``dd.retry``           ``dd:retry``                  a retry that keeps its claim
``dd.rerun``           ``dd:rerun``                  ``claim_on_busy="rerun"``
``dd.member``          ``dd:member:{k}``             a chord member (``dd.chord_body``)
``dd.replace_started`` ``dd:replace_started``        ``claim_on_busy="replace"`` with
                                                     ``claim_enqueue="until_started"``
``dd.replace_retry``   ``dd:replace_retry``          ``replace``, a call in three retries
``dd.debounce``        ``dd:debounce``               ``claim_debounce``, called by its own
                                                     sender (:mod:`chaos.debounce_sender`)
=====================  ============================  =====================================

The replace tasks take a sequence number (the feeder's call counter: call order) and,
at the end of a run, publish it through a fenced pointer under the run's fence
(``dd-publish``: accepted, or refused as stale); a replaced run's delivery logs who
replaced it (``replaced_by`` in ``dd-post``).

Beside them, when celery-once is installed, ``dd.once`` (``QueueOnce``, graceful, one
lock for every call, kept on the lock Redis too) is called on ``dd.finished``'s
schedule: a peer, reported beside fenced, not held to fenced's invariants.

``CHAOS_BROKEN`` (``--broken``) switches on deliberate faults the checker must catch:
``limit`` and ``cooldown`` add unclaimed tasks that log as ``dd:limit`` and
``dd:cooldown`` (the feeder sends them now and then); ``rerun`` makes every run of
``dd:rerun`` delete the triggers left for it, as a release that loses them would (so a
run with any rerun trigger must fail the checker).
"""

from __future__ import annotations

import os
import random
import time
from typing import Any

from celery import Celery
from celery import signals as celery_signals

import fenced
from fenced import ClaimLost, StaleFence
from fenced._lease import ClaimKeys
from fenced.celery import ClaimedTask
from fenced.store import RedisPointer

from .config import DEDUP_NAMES, Shared
from .events import EventLog

__all__ = ["BROKEN", "LIMITS", "NAMES", "QUEUE", "app"]

shared = Shared.from_env()
QUEUE = os.environ.get("CHAOS_DEDUP_QUEUE", "chaos-dedup")
#: Lease of every dedup claim: longer than the longest pause the nemesis makes (2 ttl),
#: so that a run outlives a paused Redis, as a production lease does.
TTL = float(shared.extra.get("dedup_ttl", "3"))
COOLDOWN = float(shared.extra.get("dedup_cooldown", "1.5"))
BROKEN = frozenset(filter(None, shared.extra.get("broken", "").split(",")))
#: How many runs of each claim name may run at once (the checker reads it too).
LIMITS = {"dd:limit": 2}
#: The debounced task's quiet time and longest wait (``claim_debounce``, ``_max``).
DEBOUNCE = float(shared.extra.get("dedup_debounce", "0.4"))
DEBOUNCE_MAX = float(shared.extra.get("dedup_debounce_max", "1.5"))
NAMES = DEDUP_NAMES

app = Celery(
    "chaos-dedup",
    broker=os.environ.get("CHAOS_BROKER_URL", "memory://"),
    backend=os.environ.get("CHAOS_RESULT_URL", "cache+memory://"),
)
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    broker_connection_retry_on_startup=True,
    # A whole worker killed: its messages come back this long after their delivery.
    # kombu looks for such messages every unacked_restore_interval times
    # unacked_restore_throttle seconds (100 by default): every second here.
    broker_transport_options={
        "visibility_timeout": 8,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed inside a sweep leaves kombu's restore mutex held: by default
        # for 300 s, longer than the drain, and no message of a killed worker comes back
        # meanwhile. A sweep takes milliseconds.
        "unacked_mutex_expire": 5,
    },
    result_expires=3600,
    # The lock Redis, or with --sentinel a Sentinel group's redis+sentinel:// URL, or
    # with --cluster a Redis Cluster's redis+cluster:// URL.
    fenced_redis_url=shared.extra.get("dedup_url") or shared.lock_url,
    fenced_secret_key="chaos-dedup-lane-secret-key-0123456789abcdef",
    fenced_claim_ttl=TTL,
    fenced_claim_alert_after_skips=0,
    fenced_claim_replicas=int(shared.extra.get("replicas") or 0),
    # The nemesis restarts the claims' Redis for up to half a second: retry through it.
    fenced_claim_unavailable_backoff=0.2,
    fenced_claim_unavailable_retries=12,
    # celery-once's locks: on the lock Redis (its faults hit them too), database 2.
    ONCE={
        "backend": "celery_once.backends.Redis",
        "settings": {"url": shared.lock_url.rsplit("/", 1)[0] + "/2", "default_timeout": 3600},
    },
)

_log: tuple[int, EventLog] | None = None


def log_here() -> EventLog:
    """This pool child's event log, opened after the fork."""
    global _log
    if _log is None or _log[0] != os.getpid():
        pid = os.getpid()
        _log = (
            pid,
            EventLog(
                os.path.join(shared.log_dir, f"dedup.{pid}.jsonl"),
                w=f"dedup-{pid}",
                lane="dedup",
                pid=pid,
            ),
        )
    return _log[1]


def _is_rerun(request: Any) -> bool:
    if getattr(request, "fenced_rerun", None):
        return True
    headers = getattr(request, "headers", None) or {}
    return bool(headers.get("fenced_rerun"))


def _hold(task: Any, name: str, args: tuple[Any, ...], low: float, high: float) -> None:
    """One run: log its start, sleep under the claim (checking it), log its end."""
    log = log_here()
    try:
        claim = task.claim
        fence, token = claim.fence, claim.token
    except Exception:  # an unclaimed task (--broken): no claim to report
        claim, fence, token = None, None, None
    request = task.request
    ident = dict(name=name, task=task.name, id=request.id, args=list(args))
    log.emit(
        "dd-start", fence=fence, token=token, rerun=_is_rerun(request),
        retries=request.retries or 0, **ident,
    )  # fmt: skip
    how = "error"
    try:
        until = time.monotonic() + random.uniform(low, high)
        while time.monotonic() < until:
            if claim is not None:
                claim.check()
            time.sleep(min(0.05, max(0.0, until - time.monotonic())))
        how = "ok"
    except ClaimLost:
        how = "lost"
        raise
    finally:
        log.emit("dd-end", how=how, fence=fence, **ident)


@celery_signals.task_postrun.connect
def _after(task_id: str | None = None, task: Any = None, args: Any = None, kwargs: Any = None,
           retval: Any = None, state: str | None = None, **_kw: Any) -> None:  # fmt: skip
    if task is None or not str(getattr(task, "name", "")).startswith("dd."):
        return
    reason = None
    if fenced.is_skipped(retval):
        reason = retval["reason"] if isinstance(retval, dict) else retval.reason
    replaced_by = None
    if isinstance(retval, dict) and retval.get("status") == "replaced":
        replaced_by = str((retval.get("holder") or {}).get("task_id") or "?")
    log_here().emit(
        "dd-post",
        task=task.name,
        id=task_id,
        args=list(args or ()),
        state=state,
        skipped=reason,
        rerun=_is_rerun(task.request),
        retries=task.request.retries or 0,
        policy=getattr(task, "claim_on_busy", None),
        error=repr(retval)[:200] if state == "FAILURE" else None,
        replaced_by=replaced_by,
    )


@app.task(
    base=ClaimedTask,
    bind=True,
    name="dd.started",
    claim="dd:started",
    claim_enqueue="until_started",
)
def started(self: ClaimedTask, k: int) -> str:
    _hold(self, "dd:started", (k,), 0.2, 0.5)
    return "done"


@app.task(
    base=ClaimedTask,
    bind=True,
    name="dd.finished",
    claim="dd:finished",
    claim_enqueue="until_finished",
)
def finished(self: ClaimedTask, k: int) -> str:
    _hold(self, "dd:finished", (k,), 0.2, 0.5)
    return "done"


@app.task(
    base=ClaimedTask, bind=True, name="dd.cooldown", claim="dd:cooldown", claim_cooldown=COOLDOWN
)
def cooldown(self: ClaimedTask, k: int) -> str:
    _hold(self, "dd:cooldown", (k,), 0.1, 0.3)
    return "done"


@app.task(
    base=ClaimedTask, bind=True, name="dd.limit", claim="dd:limit", claim_limit=LIMITS["dd:limit"]
)
def limit(self: ClaimedTask, k: int) -> str:
    _hold(self, "dd:limit", (k,), 0.6, 1.2)
    return "done"


@app.task(base=ClaimedTask, bind=True, name="dd.retry", claim="dd:retry", max_retries=3)
def retry(self: ClaimedTask, k: int) -> str:
    _hold(self, "dd:retry", (k,), 0.1, 0.3)
    if not self.request.retries:
        log_here().emit("dd-retrying", name="dd:retry", id=self.request.id, args=[k])
        raise self.retry(countdown=0.3)  # the claim is kept for the retry
    return "done"


@app.task(base=ClaimedTask, bind=True, name="dd.rerun", claim="dd:rerun", claim_on_busy="rerun")
def rerun(self: ClaimedTask, g: int) -> str:
    _hold(self, "dd:rerun", (g,), 0.3, 0.6)
    if "rerun" in BROKEN:
        # Deliberately broken: the triggers left during this run are lost.
        self.claim.redis.delete(ClaimKeys.of("dd:rerun").rerun)
    return "done"


@app.task(base=ClaimedTask, bind=True, name="dd.member", claim="dd:member:{k}")
def member(self: ClaimedTask, k: int) -> int:
    _hold(self, f"dd:member:{k}", (k,), 0.05, 0.2)
    return k


@app.task(name="dd.chord_body")
def chord_body(results: list[Any], chord: int) -> int:
    log_here().emit("dd-chord-body", chord=chord, results=len(results))
    return chord


_pointers: dict[str, RedisPointer] = {}


def _publish(task: Any, name: str, seq: int) -> None:
    """Publish the call's sequence number through a fenced pointer, under the run's fence."""
    log = log_here()
    claim = task.claim
    pointer = _pointers.get(name)
    if pointer is None:
        pointer = _pointers[name] = RedisPointer(shared.lock_url, f"chaos:{name}")
    ident = dict(name=name, task=task.name, id=task.request.id, seq=seq, fence=claim.fence)
    t0 = time.monotonic()
    try:
        pointer.swap(str(seq), fence=claim.fence)
    except StaleFence:
        log.emit("dd-publish", t0=t0, accepted=False, **ident)
        return
    except Exception as exc:  # the lock Redis restarted or paused: not published
        log.emit("dd-publish", t0=t0, accepted=None, error=repr(exc)[:120], **ident)
        return
    log.emit("dd-publish", t0=t0, accepted=True, **ident)


@app.task(
    base=ClaimedTask,
    bind=True,
    name="dd.replace_started",
    claim="dd:replace_started",
    claim_on_busy="replace",
    claim_enqueue="until_started",
)
def replace_started(self: ClaimedTask, seq: int) -> str:
    _hold(self, "dd:replace_started", (seq,), 0.8, 1.5)
    _publish(self, "dd:replace_started", seq)
    return "done"


@app.task(
    base=ClaimedTask,
    bind=True,
    name="dd.replace_retry",
    claim="dd:replace_retry",
    claim_on_busy="replace",
    max_retries=3,
)
def replace_retry(self: ClaimedTask, seq: int) -> str:
    _hold(self, "dd:replace_retry", (seq,), 0.2, 0.5)
    if seq % 3 == 0 and not self.request.retries:
        log_here().emit("dd-retrying", name="dd:replace_retry", id=self.request.id, args=[seq])
        raise self.retry(countdown=0.3)  # the claim is kept for the retry: a newer call may take it
    _publish(self, "dd:replace_retry", seq)
    return "done"


@app.task(
    base=ClaimedTask,
    bind=True,
    name="dd.debounce",
    claim="dd:debounce",
    claim_debounce=DEBOUNCE,
    claim_debounce_max=DEBOUNCE_MAX,
)
def debounce(self: ClaimedTask, seq: int) -> str:
    _hold(self, "dd:debounce", (seq,), 0.05, 0.15)
    return "done"


# -- deliberately broken (--broken): runs that log as a claimed name but hold nothing ---


@app.task(bind=True, name="dd.limit_unclaimed")
def limit_unclaimed(self: Any, k: int) -> str:
    _hold(self, "dd:limit", (k,), 0.6, 1.2)
    return "done"


@app.task(bind=True, name="dd.cooldown_unclaimed")
def cooldown_unclaimed(self: Any, k: int) -> str:
    _hold(self, "dd:cooldown", (k,), 0.1, 0.3)
    return "done"


# -- celery-once, the peer (when installed) -----------------------------------------------

try:
    from celery_once import QueueOnce  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - celery-once comes with the dev group
    QueueOnce = None

if QueueOnce is not None:

    @app.task(base=QueueOnce, bind=True, name="dd.once", once={"graceful": True, "keys": []})
    def once(self: Any, k: int) -> str:
        """celery-once: a call sent while another is queued or running is refused."""
        _hold(self, "once:finished", (k,), 0.2, 0.5)
        return "done"

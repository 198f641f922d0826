"""The Celery app the worker tests run in real ``celery worker`` processes.

Configured from the environment the tests give each worker:

- ``FENCED_TEST_BROKER_URL``, ``FENCED_TEST_BACKEND_URL``: broker and result backend;
- ``FENCED_REDIS_URL``: the claims' Redis (read by fenced itself);
- ``FENCED_TEST_OBS_URL``: a Redis where tasks and signal receivers write what they saw
  (markers, spans, signals; fenced's lifecycle signals in ``sig:<claim name>``), for the
  tests to read;
- ``FENCED_TEST_TTL`` (claim ttl, seconds), ``FENCED_TEST_QUEUE``,
  ``FENCED_TEST_VISIBILITY`` (Redis broker visibility timeout, seconds);
- ``FENCED_TEST_SOCKET_TIMEOUT``: when set, the claims' client gives up on a request
  after this many seconds, with no retry of its own (for tests that pause Redis).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals

from fenced.celery import ClaimedTask, signals

TTL = float(os.environ.get("FENCED_TEST_TTL", "3"))

app = Celery(
    "fenced_tests",
    broker=os.environ.get("FENCED_TEST_BROKER_URL", "memory://"),
    backend=os.environ.get("FENCED_TEST_BACKEND_URL") or None,
)
transport: dict[str, Any] = {}
if os.environ.get("FENCED_TEST_VISIBILITY"):
    transport = {
        "visibility_timeout": float(os.environ["FENCED_TEST_VISIBILITY"]),
        # Sweep for unacknowledged messages every second, so a dead worker's message
        # comes back soon after the visibility timeout.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # A worker killed inside a sweep holds its mutex 300 s by default.
        "unacked_mutex_expire": 5,
    }
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("FENCED_TEST_QUEUE", "celery"),
    broker_transport_options=transport,
    broker_connection_retry_on_startup=True,
    fenced_claim_ttl=TTL,
    fenced_claim_unavailable_backoff=0.5,
)
if os.environ.get("FENCED_TEST_SOCKET_TIMEOUT"):
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # A paused claims' Redis fails a request after this long, not after the client's
    # own retries.
    app.conf.fenced_redis_options = {
        "socket_timeout": float(os.environ["FENCED_TEST_SOCKET_TIMEOUT"]),
        "retry": Retry(NoBackoff(), 0),
    }

_obs: redis.Redis | None = None


def obs() -> redis.Redis:
    """The observation Redis (one client per process; redis-py reconnects after fork)."""
    global _obs
    if _obs is None:
        _obs = redis.Redis.from_url(os.environ["FENCED_TEST_OBS_URL"], decode_responses=True)
    return _obs


def note(key: str, **data: Any) -> None:
    """Append one JSON observation to a list."""
    data.setdefault("at", time.time())
    data.setdefault("pid", os.getpid())
    obs().rpush(key, json.dumps(data, default=str))


# -- what the worker's signals saw -------------------------------------------------------


@celery_signals.task_failure.connect
def _on_failure(sender: Any = None, task_id: str = "", exception: Any = None, **_: Any) -> None:
    note("signal:failure", task_id=task_id, task=getattr(sender, "name", None), exc=repr(exception))


@celery_signals.task_retry.connect
def _on_retry(sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
    note("signal:retry", task_id=getattr(request, "id", None), reason=repr(reason))


@celery_signals.task_postrun.connect
def _on_postrun(sender: Any = None, task_id: str = "", state: str = "", **_: Any) -> None:
    # Sent after the failure, retry and success handling: a test that sees it knows
    # every other signal of that run was sent.
    note("signal:postrun", task_id=task_id, state=state)


@signals.claim_skips_exceeded.connect
def _on_skips_exceeded(sender: Any = None, name: str = "", skips: int = 0, **kw: Any) -> None:
    holder = kw.get("holder")
    note("signal:skips_exceeded", name=name, skips=skips, holder=getattr(holder, "task_id", None))


def _die_publishing(when: str, headers: Any, body: Any) -> None:
    """SIGKILL this whole worker (main process and pool children) as it publishes a
    rerun of a key the test marked ``die:<when>:<key>`` (taken once): a holder that dies
    between its release and its rerun's publish (``before``) or just after (``after``)."""
    if not isinstance(headers, dict) or headers.get("task") not in ("t.rerun", "t.rerun_layers"):
        return
    args = body[0] if isinstance(body, (list, tuple)) and body else None
    if not args or obs().getdel(f"die:{when}:{args[0]}") is None:
        return
    note(f"died:{args[0]}", when=when, task_id=headers.get("id"))
    os.killpg(os.getpgid(0), signal.SIGKILL)


@celery_signals.before_task_publish.connect
def _before_publish(body: Any = None, headers: Any = None, **_: Any) -> None:
    _die_publishing("before", headers, body)


@celery_signals.after_task_publish.connect
def _after_publish(body: Any = None, headers: Any = None, **_: Any) -> None:
    _die_publishing("after", headers, body)


def _on_lifecycle(signal: Any, sender: Any, **kw: Any) -> None:
    event = kw.pop("event")
    data = {
        "signal": signal.name,
        "task": sender.name,
        "kind": event.kind,
        "thread": threading.current_thread().name,
        **kw,
    }
    obs().rpush(f"sig:{kw['name']}", json.dumps(data))


# Connected in the worker's main process, before the pool forks: each child inherits them.
for _signal in (
    signals.claim_acquired,
    signals.claim_skipped,
    signals.claim_lost,
    signals.claim_released,
    signals.claim_renewal_failed,
):
    _signal.connect(_on_lifecycle, weak=False)


def skips_callback(sender: Any, name: str, skips: int, holder: Any) -> None:
    """The claim_on_skips_exceeded callback of ``t.alert``."""
    note("callback:skips_exceeded", name=name, skips=skips, task=sender.name)


# -- tasks ---------------------------------------------------------------------------------


def _rebuild(task: Any, tenant: str, layer: str, steps: int, step_time: float, run: str) -> Any:
    start = time.time()
    fence = task.claim.fence
    for i in task.claim.steps(range(steps)):
        # Written only after check(): a run that lost its claim writes no further marker.
        note(f"marks:{run}", i=i, fence=fence, task_id=task.request.id)
        obs().set(f"out:{tenant}:{layer}:{i}", fence)
        time.sleep(step_time)
    note(
        "spans",
        tenant=tenant,
        layer=layer,
        start=start,
        end=time.time(),
        run=run,
        task_id=task.request.id,
    )
    return {"status": "ok", "tenant": tenant, "layer": layer, "steps": steps, "fence": fence}


@app.task(base=ClaimedTask, bind=True, name="t.rebuild", claim="rebuild:{tenant}:{layer}")
def rebuild(
    self: Any, tenant: str, layer: str, steps: int = 3, step_time: float = 0.3, run: str = ""
) -> Any:
    """A tenant's layer rebuilt in steps, each after a claim check."""
    return _rebuild(self, tenant, layer, steps, step_time, run)


@app.task(
    base=ClaimedTask,
    bind=True,
    name="t.rebuild_long_lease",
    claim="rebuild:{tenant}:{layer}",
    claim_ttl=30,
)
def rebuild_long_lease(
    self: Any, tenant: str, layer: str, steps: int = 3, step_time: float = 0.3, run: str = ""
) -> Any:
    """The same rebuild with a lease far longer than the test waits."""
    return _rebuild(self, tenant, layer, steps, step_time, run)


@app.task(base=ClaimedTask, bind=True, name="t.sleeper", claim="sleep:{key}")
def sleeper(self: Any, key: str, seconds: float) -> str:
    """Never checks its claim: one long sleep."""
    note(f"sleeper:{key}", event="start", fence=self.claim.fence)
    time.sleep(seconds)
    note(f"sleeper:{key}", event="end")
    return "slept"


@app.task(base=ClaimedTask, bind=True, name="t.spinner", claim="spin:{key}")
def spinner(self: Any, key: str, seconds: float) -> str:
    """Never checks its claim: busy in Python for a while."""
    note(f"sleeper:{key}", event="start", fence=self.claim.fence)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(0.01)
    note(f"sleeper:{key}", event="end")
    return "spun"


def _gated(task: Any, key: str, **seen: Any) -> Any:
    """Note the start, then wait (checking the claim) until the test opens this run's gate."""
    r = obs()
    start = {"task_id": task.request.id, "start": time.time(), **seen}
    n = r.rpush(f"runs:{key}", json.dumps(start)) - 1
    while not r.exists(f"gate:{key}:{n}"):
        task.claim.check()
        time.sleep(0.05)
    note(f"ends:{key}", n=n, task_id=task.request.id)
    return {"status": "ok", "run": n}


@app.task(base=ClaimedTask, bind=True, name="t.gated", claim="gated:{key}")
def gated(self: Any, key: str) -> Any:
    """Holds its claim until the test lets it finish (skip policy)."""
    return _gated(self, key)


@app.task(base=ClaimedTask, bind=True, name="t.rerun", claim="gated:{key}", claim_on_busy="rerun")
def gated_rerun(self: Any, key: str) -> Any:
    """Rerun policy: conflicting triggers coalesce into one more run."""
    return _gated(self, key)


@app.task(
    base=ClaimedTask, bind=True, name="t.rerun_other", claim="gated:{key}", claim_on_busy="rerun"
)
def gated_rerun_other(self: Any, key: str) -> Any:
    """Another task on t.rerun's names, with the same arguments (one resource)."""
    return _gated(self, key, by=self.name)


@app.task(
    base=ClaimedTask, bind=True, name="t.rerun_layers", claim="gated:{key}", claim_on_busy="rerun"
)
def gated_rerun_layers(self: Any, key: str, layer: str) -> Any:
    """Rerun policy with a claim coarser than the arguments: one per distinct layer."""
    return _gated(self, key, layer=layer)


@app.task(
    base=ClaimedTask, bind=True, name="t.replace", claim="replace:{key}", claim_on_busy="replace"
)
def gated_replace(self: Any, key: str) -> Any:
    """Replace policy: publish under the run's fence, then wait for the gate. A run that a
    newer one replaced is interrupted; it then writes once more (after the newer run
    published), as a run that keeps writing would, and notes the refusal."""
    from fenced import ClaimLost, StaleFence
    from fenced.store import RedisPointer

    r = obs()
    n = r.rpush(f"runs:{key}", json.dumps({"task_id": self.request.id})) - 1
    pointer = RedisPointer(os.environ["FENCED_REDIS_URL"], f"replace:{key}")
    fence = self.claim.fence
    pointer.swap(f"run-{n}", fence=fence)
    note(f"published:{key}", n=n, fence=fence)
    try:
        while not r.exists(f"gate:{key}:{n}"):
            time.sleep(0.05)  # no check(): the interruption stops it
    except ClaimLost:
        while len(r.lrange(f"published:{key}", 0, -1)) <= n + 1:
            time.sleep(0.02)
        try:
            pointer.swap(f"late-{n}", fence=fence)
            note(f"late:{key}", n=n, refused=False)
        except StaleFence:
            note(f"late:{key}", n=n, refused=True)
        raise
    note(f"ends:{key}", n=n, task_id=self.request.id)
    return {"status": "ok", "run": n}


@app.task(base=ClaimedTask, bind=True, name="t.retry", claim="gated:{key}", claim_on_busy="retry")
def gated_retry(self: Any, key: str) -> Any:
    """Retry policy: wait for the holder's lease, then run."""
    return _gated(self, key)


@app.task(base=ClaimedTask, bind=True, name="t.raise", claim="gated:{key}", claim_on_busy="raise")
def gated_raise(self: Any, key: str) -> Any:
    """Raise policy: ClaimHeld."""
    return _gated(self, key)


@app.task(
    base=ClaimedTask,
    bind=True,
    name="t.alert",
    claim="gated:{key}",
    claim_alert_after_skips=2,
    claim_on_skips_exceeded=skips_callback,
)
def gated_alert(self: Any, key: str) -> Any:
    """Alerts every second consecutive skip."""
    return _gated(self, key)


@app.task(base=ClaimedTask, bind=True, name="t.soft", claim="soft:{key}", soft_time_limit=1)
def soft(self: Any, key: str) -> str:
    """Overruns its soft time limit."""
    note(f"sleeper:{key}", event="start")
    time.sleep(20)
    return "never"


# -- retries keep the claim ----------------------------------------------------------------


class Flaky(Exception):
    """A failure autoretry_for retries."""


def _attempt(task: Any, key: str) -> None:
    note(
        f"attempts:{key}",
        task_id=task.request.id,
        retries=task.request.retries,
        fence=task.claim.fence,
    )


def _gate_after_retry(task: Any, key: str) -> None:
    """A retried attempt holds its claim until the test opens the gate."""
    while not obs().exists(f"gate:{key}"):
        task.claim.check()
        time.sleep(0.05)


@app.task(base=ClaimedTask, bind=True, name="t.retry_once", claim="retry:{key}", max_retries=3)
def retry_once(self: Any, key: str, countdown: float = 2.0, gated: bool = False) -> Any:
    """Asks for one retry; the retried attempt finishes (after the gate, when gated)."""
    _attempt(self, key)
    if self.request.retries == 0:
        raise self.retry(countdown=countdown)
    if gated:
        _gate_after_retry(self, key)
    return {"status": "ok", "fence": self.claim.fence, "retries": self.request.retries}


@app.task(
    base=ClaimedTask,
    bind=True,
    name="t.autoretry",
    claim="retry:{key}",
    autoretry_for=(Flaky,),
    default_retry_delay=2,
    max_retries=3,
)
def autoretry(self: Any, key: str, gated: bool = False) -> Any:
    """Fails once with Flaky (autoretry_for retries it); the retried attempt finishes."""
    _attempt(self, key)
    if self.request.retries == 0:
        raise Flaky("the first attempt fails")
    if gated:
        _gate_after_retry(self, key)
    return {"status": "ok", "fence": self.claim.fence, "retries": self.request.retries}


@app.task(base=ClaimedTask, bind=True, name="t.retry_forever", claim="retry:{key}", max_retries=1)
def retry_forever(self: Any, key: str) -> Any:
    """Always asks for a retry, so its retries run out."""
    _attempt(self, key)
    raise self.retry(countdown=0.5)


@app.task(base=ClaimedTask, bind=True, name="t.retry_elsewhere", claim="retry:{key}")
def retry_elsewhere(self: Any, key: str, queue: str, countdown: float = 2.0) -> Any:
    """Retries into a queue no worker reads: the retried message never comes."""
    _attempt(self, key)
    raise self.retry(countdown=countdown, queue=queue)


class PausesRedisBeforeTakeover(ClaimedTask):
    """Stops the claims' Redis (SIGSTOP) just before a retried message takes over its
    kept lease, once for each key a test arms (``pause:<key>`` holds the server's pid)."""

    def _enqueue_marker(self, claim: Any, opts: Any) -> None:
        # Called on each run's claim just before it is taken: wrap its take_over.
        super()._enqueue_marker(claim, opts)
        take_over = claim.take_over

        def pausing() -> bool:
            pid = obs().getdel(f"pause:{claim.name.split(':', 1)[1]}")
            if pid:
                note(f"paused:{claim.name}")
                os.kill(int(pid), signal.SIGSTOP)
            took: bool = take_over()
            return took

        claim.take_over = pausing


@app.task(base=PausesRedisBeforeTakeover, bind=True, name="t.retry_paused", claim="retry:{key}")
def retry_paused(self: Any, key: str) -> Any:
    """Asks for one retry; Redis is paused as the retried message takes the claim over."""
    _attempt(self, key)
    if self.request.retries == 0:
        raise self.retry(countdown=0.3)
    return {"status": "ok", "fence": self.claim.fence, "retries": self.request.retries}


# -- groups and chords ---------------------------------------------------------------------


@app.task(name="t.collect")
def collect(results: list[Any]) -> Any:
    """A chord body: what it received, and its members that ran (skips filtered out)."""
    from fenced import is_skipped

    return {
        "results": results,
        "ran": [r for r in results if not is_skipped(r)],
        "skipped": [r["claim"] for r in results if is_skipped(r)],
    }


@app.task(base=ClaimedTask, bind=True, name="t.cooled", claim="cooled:{key}", claim_cooldown=60.0)
def cooled(self: Any, key: str, seconds: float = 0.0, fail: bool = False) -> Any:
    """At most one run ending ok per minute: notes each run that starts."""
    note(f"runs:{key}", task_id=self.request.id, fence=self.claim.fence)
    time.sleep(seconds)
    if fail:
        raise ValueError("failed on purpose")
    return {"status": "ok", "fence": self.claim.fence}


@app.task(base=ClaimedTask, bind=True, name="t.limited", claim="limited:{key}", claim_limit=2)
def limited(self: Any, key: str) -> Any:
    """Two at a time: holds its slot until the test lets it finish."""
    return _gated(self, key, fence=self.claim.fence, slot=self.claim.slot)


@app.task(
    base=ClaimedTask, bind=True, name="t.labelled", claim="labelled:{key}", claim_label="gates"
)
def labelled(self: Any, key: str) -> Any:
    """A gated run whose claims carry a label of their own (lifecycle signals)."""
    return _gated(self, key)

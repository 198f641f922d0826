"""The Celery app the throughput benchmark's worker runs: one task per contender.

Every task does the same trivial work (INCR a counter the benchmark watches), so the
difference between contenders is what each one's locking costs.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import redis
from celery import Celery, Task

URL = os.environ.get("BENCH_REDIS", "redis://127.0.0.1:6379")

app = Celery("bench", broker=f"{URL}/0")
app.conf.update(
    fenced_redis_url=f"{URL}/2",
    task_ignore_result=True,
    task_acks_late=True,
    worker_prefetch_multiplier=4,
    task_serializer="json",
    accept_content=["json"],
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": f"{URL}/3"}},
    singleton_backend_url=f"{URL}/4",
    worker_hijack_root_logger=False,
)

counter = redis.Redis.from_url(f"{URL}/5")
locks = redis.Redis.from_url(f"{URL}/6")

if os.environ.get("BENCH_PROFILE"):
    # Profile each pool child (cProfile), one file per child in $BENCH_PROFILE, to see
    # where a task's time goes inside the worker: python -m pstats <file>.
    import cProfile

    from celery.signals import worker_process_init, worker_process_shutdown

    _profile = cProfile.Profile()

    @worker_process_init.connect
    def _start_profile(**_: Any) -> None:
        _profile.enable()

    @worker_process_shutdown.connect
    def _save_profile(**_: Any) -> None:
        _profile.disable()
        _profile.dump_stats(os.path.join(os.environ["BENCH_PROFILE"], f"child-{os.getpid()}.prof"))


def done(kind: str) -> None:
    """The work every contender does: count one finished task."""
    counter.incr(f"done:{kind}")


@app.task(name="bench.plain")
def plain(i: int) -> None:
    """No locking at all: the floor."""
    done("plain")


try:
    from fenced.celery import ClaimedTask

    FencedBase: type[Any] = ClaimedTask
    SWITCH = os.environ.get("BENCH_METRICS")  # "on" or "control": see celery_throughput

    if SWITCH:
        from fenced import events

        _subscribed: list[Any] = []  # the unsubscribe function while subscribed

        class _Switched(ClaimedTask):  # type: ignore[misc]
            """Each run first subscribes fenced.metrics in this pool child (or takes it
            away), so fenced and fenced+metrics run on the same worker and children."""

            abstract = True
            with_metrics = False

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                if self.with_metrics != bool(_subscribed):
                    if _subscribed:
                        _subscribed.pop()()
                    else:
                        _subscribed.append(events.subscribe(_child_metrics().subscriber))
                return super().__call__(*args, **kwargs)

        @functools.cache
        def _child_metrics() -> Any:
            """This pool child's metrics, made in the child (multiprocess mode's files)."""
            from prometheus_client import CollectorRegistry

            from fenced.metrics import ClaimMetrics

            return ClaimMetrics(CollectorRegistry())

        FencedBase = _Switched

    @app.task(base=FencedBase, bind=True, name="bench.fenced", claim="bench:{i}", claim_ttl=30)
    def fenced_task(self: Task, i: int) -> None:
        """A claimed task: atomic fenced acquire, heartbeat, run records, release."""
        done("fenced")

    if SWITCH:

        @app.task(
            base=FencedBase,
            bind=True,
            name="bench.fenced_metrics",
            claim="bench:{i}",
            claim_ttl=30,
            with_metrics=SWITCH == "on",
        )
        def fenced_metrics_task(self: Task, i: int) -> None:
            """The same, with fenced.metrics subscribed (with --control: without)."""
            done("fenced_metrics")

    @app.task(
        base=ClaimedTask,
        bind=True,
        name="bench.fenced_enqueue",
        claim="bench-enqueue:{i}",
        claim_ttl=30,
        claim_enqueue="until_finished",
    )
    def fenced_enqueue_task(self: Task, i: int) -> None:
        """The same, deduplicated at enqueue too (as celery-once): one marker per name
        from apply_async until the run ends."""
        done("fenced_enqueue")

except ImportError:  # pragma: no cover
    pass

try:
    from celery_once import QueueOnce

    @app.task(base=QueueOnce, name="bench.once", once={"graceful": True})
    def once_task(i: int) -> None:
        """celery-once: a lock taken at enqueue time, cleared after return."""
        done("once")

except ImportError:  # pragma: no cover
    pass

try:
    from celery_singleton import Singleton

    @app.task(base=Singleton, name="bench.singleton")
    def singleton_task(i: int) -> None:
        """celery-singleton: a lock per argument set, taken at enqueue time."""
        done("singleton")

except ImportError:  # pragma: no cover
    pass


@app.task(name="bench.redis_lock")
def redis_lock_task(i: int) -> Any:
    """A task wrapped by hand in redis-py's Lock, the usual home-made solution."""
    with locks.lock(f"bench:{i}", timeout=30, blocking=False) as held:
        if held:
            done("redis_lock")

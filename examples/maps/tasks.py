"""The map rebuild as a claimed Celery task.

Run a worker from the ``examples`` directory::

    MAPS_BROKER_URL=redis://localhost:6379/0 FENCED_REDIS_URL=redis://localhost:6379/1 \\
    MAPS_OUTPUT_DIR=/tmp/maps celery -A maps.tasks worker -c 2

and enqueue ``maps.tasks.rebuild_map.delay("roads")`` (or ``python -m maps roads``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from fenced.celery import ClaimedTask

from .build import Output, Step, check_layer, rebuild

__all__ = ["app", "rebuild_map"]

BROKER_URL = os.environ.get("MAPS_BROKER_URL", "redis://localhost:6379/0")

app = Celery(
    "maps",
    broker=BROKER_URL,
    backend=os.environ.get("MAPS_RESULT_BACKEND", BROKER_URL),
)
app.conf.update(
    # The claim store is its own setting, separate from the broker: it must not evict
    # keys (maxmemory-policy noeviction), which a cache or broker instance may do.
    fenced_redis_url=os.environ.get("FENCED_REDIS_URL", "redis://localhost:6379/1"),
    # Acknowledge on completion, so a deploy that kills a worker mid-rebuild returns
    # the message instead of losing the rebuild; the claim makes the redelivery safe.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    # A long rebuild should not sit in a busy child's prefetch buffer.
    worker_prefetch_multiplier=1,
    # Time limits above the claim's ttl, and a visibility timeout above the time limit:
    # otherwise the broker redelivers a rebuild that is still running.
    task_soft_time_limit=50 * 60,
    task_time_limit=60 * 60,
    broker_transport_options={"visibility_timeout": 2 * 60 * 60},
    result_expires=24 * 60 * 60,
)


def _output() -> Output:
    return Output.at(os.environ.get("MAPS_OUTPUT_DIR", "maps-output"))


def _step_delay() -> float:
    # Stands in for the minutes real tiling takes, so overlaps can be seen and tested.
    return float(os.environ.get("MAPS_STEP_DELAY", "0") or 0)


@app.task(
    name="maps.rebuild_map",
    base=ClaimedTask,
    bind=True,
    acks_late=True,
    # Named for the output two rebuilds would collide on: one layer's published tiles.
    # Not "rebuild" (too coarse: every layer queues behind one lock) and not anything
    # with a timestamp in it (too fine: never contends, protects nothing).
    claim="rebuild:{layer}",
    # A moderate lease, renewed every ttl/3 while the worker lives: a dead worker's
    # claim ends within 30 s instead of blocking rebuilds for hours.
    claim_ttl=30,
)
def rebuild_map(self: Any, layer: str) -> dict[str, Any]:
    """Rebuild one layer's tiles and publish its manifest under the claim's fence."""
    check_layer(layer)
    delay = _step_delay()

    def pause(step: Step) -> None:
        if delay > 0:
            time.sleep(delay)

    manifest, published = rebuild(
        layer,
        _output(),
        fence=self.claim.fence,
        steps=self.claim.steps,
        after_step=pause,
    )
    return {
        "status": "ok",
        "layer": layer,
        "manifest": manifest.digest,
        "published": published.target,
        "fence": published.fence,
    }

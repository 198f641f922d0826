"""The demo's Celery app: the map rebuild example, claimed, content-addressed and fenced.

Configured from the environment by the demo runner: ``FENCED_DEMO_REDIS`` (the
embedded Redis; db 0 is the broker, db 1 the result backend, db 2 the claim store),
``FENCED_DEMO_DIR`` (where tiles and published pointers go: the runner's directory for
this run, which it removes at the end; without it, ``fenced-demo`` in the temporary
folder, ``$TMPDIR`` or ``/tmp``, which nothing removes), ``FENCED_SECRET_KEY`` (signs
the calls a debounce burst stores) and, for the object-storage act, ``FENCED_DEMO_S3``
(the store's URL, ``s3://<bucket>/maps``) on the S3 API server at
``FENCED_DEMO_S3_ENDPOINT``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis
from celery import Celery

from ..celery import ClaimedTask
from ..store import ContentStore, FilePointer, Pointer

if TYPE_CHECKING:
    from ..store import ObjectStore

BASE = os.environ.get("FENCED_DEMO_REDIS", "redis://127.0.0.1:6379")
OUT = os.environ.get("FENCED_DEMO_DIR") or os.path.join(tempfile.gettempdir(), "fenced-demo")
TTL = float(os.environ.get("FENCED_DEMO_TTL", "2.0"))
STEP = float(os.environ.get("FENCED_DEMO_STEP", "0.3"))
#: Seconds a flaky fetch waits before its retry.
RETRY_COUNTDOWN = 2.0
#: The key the runner sets when the exports may finish.
EXPORTS_GO = "demo:exports:go"
#: The partner API's rate (sync_account) and the debounce of a document's edits (reindex).
RATE = "2/s"
DEBOUNCE = 1.0
#: The object-storage act's store and the S3 API server it is on (set by the runner).
S3 = os.environ.get("FENCED_DEMO_S3", "")
S3_ENDPOINT = os.environ.get("FENCED_DEMO_S3_ENDPOINT", "")

app = Celery("fenced_demo", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    fenced_redis_url=f"{BASE}/2",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    # A killed worker's unacked message comes back after visibility_timeout; sweep for
    # such messages every second so the demo shows it within seconds, not minutes.
    # Every demo task is far shorter than the timeout, or it would be redelivered
    # while still running (the mistake `fenced doctor` reports).
    broker_transport_options={
        "visibility_timeout": 15,
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
        # The sweep runs under a Redis mutex; a worker killed inside one (the deploy act
        # kills worker a) leaves it held this long: 300 s by default, which would stop
        # every worker's sweep, and the redelivery, for five minutes.
        "unacked_mutex_expire": 5,
    },
    result_expires=600,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_hijack_root_logger=False,
)


@functools.cache
def _client() -> redis.Redis:
    return redis.Redis.from_url(f"{BASE}/2")


def event(kind: str, **data: Any) -> None:
    """Tell the demo runner what happened, as it happens (a Redis list it reads)."""
    worker = os.environ.get("FENCED_DEMO_WORKER", socket.gethostname())
    data.update(kind=kind, worker=worker, at=time.time(), pid=os.getpid())
    _client().rpush("demo:events", json.dumps(data))


def tile(tenant: str, layer: str, i: int) -> bytes:
    """Deterministic bytes of one tile: a repeat writes identical bytes."""
    seed = f"{tenant}/{layer}/{i}".encode()
    return b"TILE" + hashlib.sha256(seed).digest() * 64


def expected_manifest(tenant: str, layer: str, tiles: int) -> bytes:
    """The manifest a complete rebuild publishes (what every repeat must converge to)."""
    digests = [hashlib.sha256(tile(tenant, layer, i)).hexdigest() for i in range(tiles)]
    return json.dumps({"tenant": tenant, "layer": layer, "tiles": digests}).encode()


def object_store(url: str = S3, endpoint: str = S3_ENDPOINT) -> ObjectStore:
    """The object-storage act's store: ``url`` on the S3 API server at ``endpoint``
    (moto's, which takes any credentials)."""
    from ..store import ObjectStore

    return ObjectStore(
        url, endpoint=endpoint, access_key_id="demo", secret_access_key="demo", region="us-east-1"
    )


@functools.cache
def _object_store() -> ObjectStore:
    store = object_store()
    # Probed once per worker, before any build: a later swap costs only its own requests.
    store.check_conditions()
    return store


def _build(
    task: Any,
    tenant: str,
    layer: str,
    tiles: int,
    publish_delay: float,
    store: ContentStore | ObjectStore | None = None,
    pointer: Pointer | None = None,
) -> dict[str, Any]:
    """Put the tiles and the manifest, then publish the manifest under the claim's fence;
    by default into the output directory (a ContentStore and a FilePointer)."""
    if store is None:
        store = ContentStore(os.path.join(OUT, "objects"), create=True)
    if pointer is None:
        pointer = FilePointer(os.path.join(OUT, "published", tenant, layer, "current"))
    claim = task.claim
    event("started", tenant=tenant, layer=layer, fence=claim.fence, task_id=task.request.id)
    for i in claim.steps(range(tiles)):
        time.sleep(STEP)
        store.put(tile(tenant, layer, i))
        event("step", tenant=tenant, layer=layer, step=i, fence=claim.fence)
    manifest = store.put(expected_manifest(tenant, layer, tiles))
    event("publishing", tenant=tenant, layer=layer, fence=claim.fence)
    time.sleep(publish_delay)  # the window a paused worker sleeps through
    pointer.swap(manifest, fence=claim.fence)
    event("published", tenant=tenant, layer=layer, fence=claim.fence)
    return {"status": "ok", "tenant": tenant, "layer": layer, "fence": claim.fence}


def _claimed(name: str, claim: str, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``@app.task`` for a bound ClaimedTask ``demo.<name>`` with the demo's claim TTL."""
    return app.task(
        base=ClaimedTask, bind=True, name=f"demo.{name}", claim=claim, claim_ttl=TTL, **options
    )


@_claimed("rebuild", "rebuild:{tenant}:{layer}", claim_interrupt=False)
def rebuild(
    self: Any, tenant: str, layer: str, tiles: int = 8, publish_delay: float = 0.0
) -> dict[str, Any]:
    """Rebuild one tenant's layer under a claim named for the output it writes."""
    return _build(self, tenant, layer, tiles, publish_delay)


@_claimed("rebuild_to_objects", "rebuild:{tenant}:{layer}", claim_interrupt=False)
def rebuild_to_objects(
    self: Any, tenant: str, layer: str, tiles: int = 8, publish_delay: float = 0.0
) -> dict[str, Any]:
    """The rebuild, its tiles in the S3 server's bucket and its manifest published by an
    ObjectPointer named ``<tenant>/<layer>``."""
    from ..store import ObjectPointer

    store = _object_store()
    pointer = ObjectPointer(store, f"{tenant}/{layer}")
    return _build(self, tenant, layer, tiles, publish_delay, store, pointer)


@_claimed("rebuild_once", "rebuild:{tenant}:{layer}", claim_enqueue="until_finished")
def rebuild_once(self: Any, tenant: str, layer: str, tiles: int = 8) -> dict[str, Any]:
    """The rebuild, sent at most once while one is queued or running (claim_enqueue)."""
    return _build(self, tenant, layer, tiles, 0.0)


@_claimed("rebuild_coarse", "rebuild", claim_on_busy="retry")
def rebuild_coarse(self: Any, tenant: str, layer: str, tiles: int = 8) -> dict[str, Any]:
    """The same rebuild behind one coarse claim shared by every tenant (the mistake)."""
    return _build(self, tenant, layer, tiles, 0.0)


@_claimed("daily_digest", "digest:{tenant}", claim_cooldown=3600)
def daily_digest(self: Any, tenant: str) -> dict[str, Any]:
    """Once an hour at most, however often the beat fires: a cooldown after each ok run."""
    event("digest", tenant=tenant, layer="digest", fence=self.claim.fence)
    return {"status": "ok", "tenant": tenant, "fence": self.claim.fence}


@_claimed("export", "export:{tenant}", claim_limit=2)
def export(self: Any, tenant: str, hold: float = 20.0) -> dict[str, Any]:
    """Export a tenant's maps to a print server that takes two jobs at once (claim_limit)."""
    event("export", tenant=tenant, layer="export", fence=self.claim.fence)
    # The slot stays held until the runner has shown a third export turned away.
    deadline = time.monotonic() + hold
    while not _client().exists(EXPORTS_GO) and time.monotonic() < deadline:
        self.claim.check()
        time.sleep(0.05)
    return {"status": "ok", "tenant": tenant, "fence": self.claim.fence}


@_claimed("fetch_feed", "feed:{source}")
def fetch_feed(self: Any, source: str) -> dict[str, Any]:
    """Fetch a feed from a flaky upstream: the first attempt retries, keeping its claim."""
    attempt = self.request.retries
    event("fetch", tenant=source, layer="feed", fence=self.claim.fence, attempt=attempt)
    if attempt == 0:
        raise self.retry(countdown=RETRY_COUNTDOWN)
    return {"status": "ok", "source": source, "fence": self.claim.fence, "attempt": attempt}


@_claimed("preview", "preview:{doc}", claim_on_busy="replace")
def preview(self: Any, doc: str, version: int, seconds: float = 10.0) -> dict[str, Any]:
    """Render a document's preview: a newer version's render takes the claim over, and
    the older one is stopped (claim_on_busy="replace")."""
    event("preview", tenant=doc, layer="preview", version=version, fence=self.claim.fence)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)  # never checks its claim: the takeover interrupts it
    return {"status": "ok", "doc": doc, "version": version, "fence": self.claim.fence}


@_claimed("sync_account", "sync:{account}", claim_rate=RATE, claim_limit=3)
def sync_account(self: Any, account: str, n: int) -> dict[str, Any]:
    """Call a partner API that allows two calls a second per account (claim_rate): a
    call over the rate is put back until its start, never dropped. The limit, one above
    the rate's two, lets a call that arrives while two run reach the rate instead of
    being skipped as busy (busy is checked first)."""
    event("sync", tenant=account, layer="sync", n=n, fence=self.claim.fence)
    return {"status": "ok", "account": account, "n": n, "fence": self.claim.fence}


@_claimed("reindex", "reindex:{doc}", claim_debounce=DEBOUNCE, claim_debounce_max=5.0)
def reindex(self: Any, doc: str, version: int) -> dict[str, Any]:
    """Reindex a document once per burst of edits, with the last edit (claim_debounce)."""
    event("reindex", tenant=doc, layer="reindex", version=version, fence=self.claim.fence)
    return {"status": "ok", "doc": doc, "version": version}

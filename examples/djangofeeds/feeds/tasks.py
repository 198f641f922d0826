"""The ``feed.import`` task: the feed importer, claimed instead of check-then-set.

The old cookbook recipe reads a cache key, then sets it: two workers can both read "not
locked" and both import. Here the claim is taken in one atomic step, is named by a
digest of the feed URL (fenced hashes long or unsafe template values itself), renews
itself while the import runs, and carries a fence that the upsert compares.
"""

from __future__ import annotations

import functools
from typing import Any

import sqlalchemy as sa
from celery import shared_task
from django.conf import settings

from fenced.celery import ClaimedTask

from .importer import fetch, parse, store_feed

__all__ = ["import_feed"]


@functools.cache
def engine() -> sa.Engine:
    """A SQLAlchemy engine on Django's default database (one per worker process)."""
    db = settings.DATABASES["default"]
    if db["ENGINE"] != "django.db.backends.sqlite3":
        raise RuntimeError("this example writes SQLite; build the URL for your database here")
    timeout = db.get("OPTIONS", {}).get("timeout", 30)
    return sa.create_engine(f"sqlite:///{db['NAME']}", connect_args={"timeout": timeout})


@shared_task(
    name="feed.import",
    base=ClaimedTask,
    bind=True,
    acks_late=True,
    # One import per feed at a time, named by the feed URL (hashed into the claim name).
    # Its lease (claim_ttl) comes from settings.CELERY_FENCED_CLAIM_TTL.
    claim="feed:{feed_url}",
)
def import_feed(self: Any, feed_url: str) -> dict[str, Any]:
    """Fetch, parse and upsert one feed under its claim."""
    body, content_type = fetch(feed_url, settings.FEEDS_FETCH_TIMEOUT, settings.FEEDS_USER_AGENT)
    parsed = parse(feed_url, body, content_type)
    counts = store_feed(engine(), parsed, fence=self.claim.fence, check=self.claim.check)
    return {"status": "ok", "feed": feed_url, "fence": self.claim.fence, **counts}

"""Fetch a feed, parse it with feedparser, and upsert it: no Celery, no claim, no Django ORM.

The writes go through :func:`fenced.store.upsert` (SQLAlchemy Core) on the database
Django manages. Each row carries the fence of the claim under which it was written,
and a row is only overwritten by a write with an equal or higher fence: a stale
import (paused past its lease, resumed after a newer import wrote) changes nothing.
"""

from __future__ import annotations

import calendar
import datetime as dt
import hashlib
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import feedparser
import sqlalchemy as sa

from fenced.store import upsert

__all__ = ["FeedError", "ParsedEntry", "ParsedFeed", "fetch", "parse", "store_feed"]

#: Entries written per INSERT ... ON CONFLICT statement.
BATCH = 500


class FeedError(Exception):
    """The document at a feed URL could not be read as RSS or Atom."""


@dataclass(frozen=True)
class ParsedEntry:
    """The fields of one entry that the Entry table keeps."""

    guid: str
    title: str
    link: str
    published: dt.datetime | None


@dataclass(frozen=True)
class ParsedFeed:
    """A feed document, reduced to what the Feed and Entry tables keep."""

    url: str
    title: str
    entries: tuple[ParsedEntry, ...]


def fetch(
    url: str, timeout: float = 20.0, user_agent: str = "djangofeeds/1.0"
) -> tuple[bytes, str]:
    """The body and Content-Type of ``url``; urllib raises on HTTP errors."""
    request = urllib.request.Request(url, headers={"User-Agent": user_agent})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        body: bytes = response.read()
        return body, str(response.headers.get("Content-Type", ""))


def _when(entry: Any) -> dt.datetime | None:
    # feedparser normalises dates to UTC struct_time; keep them as naive UTC, which is
    # how Django stores datetimes in SQLite when USE_TZ is on.
    parsed = entry.get("published_parsed") or entry.get("updated_parsed")
    if not parsed:
        return None
    return dt.datetime(1970, 1, 1) + dt.timedelta(seconds=calendar.timegm(parsed))


def _guid(entry: Any) -> str:
    guid = entry.get("id") or entry.get("link")
    if guid:
        return str(guid)
    # No id and no link: the title and date are all that identify the entry.
    basis = f"{entry.get('title', '')}\x00{entry.get('published', entry.get('updated', ''))}"
    return "sha256:" + hashlib.sha256(basis.encode()).hexdigest()


def parse(url: str, body: bytes, content_type: str = "") -> ParsedFeed:
    """Parse an RSS or Atom document; FeedError when it is neither."""
    headers = {"content-location": url}
    if content_type:
        # The charset and media type the server declared, as feedparser expects them.
        headers["content-type"] = content_type
    doc = feedparser.parse(body, response_headers=headers)
    if doc.get("bozo") and not doc.get("entries") and not doc.feed.get("title"):
        raise FeedError(f"{url} is not an RSS or Atom feed: {doc.get('bozo_exception')}")
    entries: dict[str, ParsedEntry] = {}
    for item in doc.entries:
        guid = _guid(item)
        # A feed that repeats a guid would make one upsert batch update a row twice.
        entries[guid] = ParsedEntry(
            guid=guid,
            title=str(item.get("title", "")),
            link=str(item.get("link", "")),
            published=_when(item),
        )
    return ParsedFeed(url, str(doc.feed.get("title", "")), tuple(entries.values()))


def _tables(conn: sa.Connection) -> tuple[sa.Table, sa.Table]:
    meta = sa.MetaData()
    return (
        sa.Table("feeds_feed", meta, autoload_with=conn),
        sa.Table("feeds_entry", meta, autoload_with=conn),
    )


def store_feed(
    engine: sa.Engine,
    feed: ParsedFeed,
    fence: int,
    check: Callable[[], None] | None = None,
) -> dict[str, int]:
    """Upsert the feed and its entries under ``fence`` in one transaction; row counts.

    ``check`` (a claim's ``check``) runs before each statement, so an import that lost
    its claim stops instead of writing; the fence catches one paused mid-statement.
    The counts: ``entries`` in the document, ``written`` rows inserted or updated,
    ``kept`` rows left alone because a newer import (higher fence) wrote them.
    """
    check = check or (lambda: None)
    with engine.begin() as conn:
        feeds, entries = _tables(conn)
        check()
        results = [
            upsert(
                conn,
                feeds,
                [{"url": feed.url, "title": feed.title}],
                key=["url"],
                fence_column="fence",
                fence=fence,
            )
        ]
        feed_id = conn.execute(sa.select(feeds.c.id).where(feeds.c.url == feed.url)).scalar_one()
        rows = [
            {
                "feed_id": feed_id,
                "guid": e.guid,
                "title": e.title,
                "link": e.link,
                "published": e.published,
            }
            for e in feed.entries
        ]
        for start in range(0, len(rows), BATCH):
            check()
            results.append(
                upsert(
                    conn,
                    entries,
                    rows[start : start + BATCH],
                    key=["feed_id", "guid"],
                    fence_column="fence",
                    fence=fence,
                    batch_size=BATCH,
                )
            )
    # SQLite and PostgreSQL report the rows written (MySQL's count is ambiguous: None).
    written = sum(r.written or 0 for r in results)
    kept = sum(r.skipped or 0 for r in results)
    return {"feed_id": int(feed_id), "entries": len(rows), "written": written, "kept": kept}

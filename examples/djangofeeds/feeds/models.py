"""A feed, identified by its URL, and its entries, identified by (feed, guid)."""

from __future__ import annotations

from django.db import models


class Feed(models.Model):
    """A subscribed RSS or Atom feed."""

    url = models.URLField(max_length=1000, unique=True)
    title = models.CharField(max_length=1000, blank=True, default="")
    # The fence of the claim that last wrote this row: a lower one may not overwrite it.
    fence = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return self.title or self.url


class Entry(models.Model):
    """One item of a feed; a repeated import updates it instead of adding a copy."""

    feed = models.ForeignKey(Feed, on_delete=models.CASCADE, related_name="entries")
    guid = models.CharField(max_length=1000)
    title = models.CharField(max_length=1000, blank=True, default="")
    link = models.URLField(max_length=2000, blank=True, default="")
    published = models.DateTimeField(null=True, blank=True)
    fence = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            # The upsert's conflict target: without it a repeat import duplicates rows.
            models.UniqueConstraint(fields=["feed", "guid"], name="feeds_entry_feed_guid"),
        ]
        ordering = ["-published", "guid"]
        verbose_name_plural = "entries"

    def __str__(self) -> str:
        return self.title or self.guid

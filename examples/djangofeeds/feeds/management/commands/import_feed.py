"""``manage.py import_feed URL [URL ...] [--wait]``: enqueue feed imports."""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from feeds.models import Feed
from feeds.tasks import import_feed


class Command(BaseCommand):
    """Enqueue ``feed.import`` for each URL given, or for every known feed."""

    help = "Enqueue feed.import for each URL given (or every known feed); --wait prints results."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("urls", nargs="*", help="feed URLs (default: every Feed row)")
        parser.add_argument("--wait", action="store_true", help="wait and print each result")
        parser.add_argument("--timeout", type=float, default=300.0)

    def handle(self, *args: Any, **options: Any) -> None:
        urls = options["urls"] or list(Feed.objects.values_list("url", flat=True))
        results = [import_feed.delay(url) for url in urls]
        for url, result in zip(urls, results):
            if options["wait"]:
                self.stdout.write(json.dumps(result.get(timeout=options["timeout"])))
            else:
                self.stdout.write(f"enqueued {url} as {result.id}")

#!/usr/bin/env python
"""The feed importer, done right, with a real worker: ``python examples/djangofeeds/demo.py``.

Everything it needs it starts itself, then stops: an embedded Redis as broker and claim
store, the sample feeds served over HTTP on 127.0.0.1, a migrated SQLite database in a
temporary directory and one real ``celery worker`` (prefork, two children) running this
project. The old cookbook recipe checks a cache key and then sets it; here the claim is
taken in one step and the entries are upserted under its fence, so imports converge
however often they run. ``fenced demo --feeds`` runs this script from a checkout.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fenced.testing import CeleryWorker, RedisServer, available_binaries

EXAMPLE = Path(__file__).resolve().parent


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def _rows(db: Path, url: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT e.guid, e.title FROM feeds_entry e JOIN feeds_feed f ON f.id = e.feed_id "
            "WHERE f.url = ? ORDER BY e.guid",
            (url,),
        ).fetchall()


def main(say: Callable[[str], None] | None = None) -> int:
    """Run the feed importer acts; 0 only if every expectation held."""
    if say is None:
        from rich.console import Console

        say = Console(highlight=False).print
    failures: list[str] = []

    def expect(ok: bool, what: str) -> None:
        say(f"  [green]✔[/] {what}" if ok else f"  [red]✘ {what}[/]")
        if not ok:
            failures.append(what)

    tmp = Path(tempfile.mkdtemp(prefix="fenced-feeds-"))
    www = tmp / "www"
    shutil.copytree(EXAMPLE / "sample_feeds", www)
    db = tmp / "feeds.sqlite3"
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_Quiet, directory=str(www))
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    found = available_binaries()
    binary = found.get("bundled") or found.get("system")
    start = time.monotonic()
    worker: CeleryWorker | None = None
    try:
        with RedisServer(binary) as server:
            base = f"redis://127.0.0.1:{server.port}"
            env = dict(
                os.environ,
                DJANGO_SETTINGS_MODULE="djangofeeds.settings",
                DJANGOFEEDS_DB=str(db),
                DJANGOFEEDS_BROKER_URL=f"{base}/0",
                DJANGOFEEDS_RESULT_BACKEND=f"{base}/0",
                FENCED_REDIS_URL=f"{base}/1",
            )
            say(f"[bold]djangofeeds demo[/]: embedded redis-server {server.version()}")
            subprocess.run(
                [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
                cwd=EXAMPLE,
                env=env,
                check=True,
            )
            worker = CeleryWorker(
                "djangofeeds", name="feeds", log_dir=tmp, cwd=EXAMPLE, env=env, concurrency=2
            )
            worker.start().ready()
            say("a celery worker is ready (prefork, two children); SQLite migrated")
            from celery import Celery

            client = Celery("feeds-demo", broker=f"{base}/0", backend=f"{base}/0")
            url = f"http://127.0.0.1:{httpd.server_address[1]}/news.rss"

            def run(*urls: str) -> list[Any]:
                sent = [client.send_task("feed.import", args=[u]) for u in urls]
                return [s.get(timeout=60, propagate=False) for s in sent]

            say("\n[bold]1. The same feed imported twice at once[/] — one claim, one import")
            out = run(url, url)
            statuses = sorted(str(o.get("status")) for o in out if isinstance(o, dict))
            expect(statuses == ["ok", "skipped"], f"results: {statuses}")
            first = _rows(db, url)
            expect(len(first) > 0, f"{len(first)} entries imported")

            say("\n[bold]2. Imported again[/] — the upsert converges, nothing is duplicated")
            (again,) = run(url)
            expect(isinstance(again, dict) and again.get("status") == "ok", "imported again")
            expect(_rows(db, url) == first, f"still {len(first)} entries, the same values")

            say("\n[bold]3. The feed changes[/] — the changed entry is updated in place")
            text = (www / "news.rss").read_text()
            old_title = first[0][1]
            (www / "news.rss").write_text(text.replace(old_title, old_title + " (updated)", 1))
            run(url)
            after = _rows(db, url)
            changed = [a for a, b in zip(after, first) if a != b]
            expect(
                len(after) == len(first) and len(changed) == 1,
                f"{len(changed)} entry changed, {len(after)} in all",
            )
    finally:
        if worker is not None:
            worker.stop()
        httpd.shutdown()
        httpd.server_close()
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"\ndemo finished in {time.monotonic() - start:.1f}s")
    if failures:
        say(f"[red bold]{len(failures)} expectation(s) failed[/]")
        return 1
    say("[green bold]every expectation held[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())

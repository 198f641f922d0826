"""The two examples, run for real: Celery worker processes (prefork), a test-owned
redis-server as broker, result backend and claim store, feeds served over HTTP."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypedDict

import pytest
import redis
from celery import Celery

from fenced import Claim, ConfigError, StaleFence, records
from fenced.testing import CeleryWorker, RedisServer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
DJANGOFEEDS = EXAMPLES / "djangofeeds"
RESULT_TIMEOUT = 120.0


def _load(path: Path, name: str) -> ModuleType:
    """Import one example module by path, without putting its folder on sys.path."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def example_worker(app: str, cwd: Path, env: dict[str, str], log: Path, name: str) -> CeleryWorker:
    """A ``celery worker`` process (prefork, concurrency 2) for one example."""
    return CeleryWorker(app, name=name, log=log, cwd=cwd, env={**os.environ, **env}, concurrency=2)


def _client(url: str) -> Celery:
    return Celery("examples-client", broker=url, backend=url, set_as_current=False)


def _run_all(client: Celery, task: str, *args_list: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Send every task at once, then wait for every result."""
    sent = [client.send_task(task, args=list(args)) for args in args_list]
    return [s.get(timeout=RESULT_TIMEOUT) for s in sent]


# -- maps --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def maps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A redis-server and one maps worker; yields the client app, output dir and claim store."""
    tmp = tmp_path_factory.mktemp("maps")
    with RedisServer() as server:
        base = server.url.rsplit("/", 1)[0]
        client = _client(f"{base}/0")
        worker = example_worker(
            "maps.tasks",
            EXAMPLES,
            {
                "MAPS_BROKER_URL": f"{base}/0",
                "MAPS_RESULT_BACKEND": f"{base}/0",
                "FENCED_REDIS_URL": f"{base}/1",
                "MAPS_OUTPUT_DIR": str(tmp / "out"),
                # Long enough for a second trigger to arrive while the first one tiles.
                "MAPS_STEP_DELAY": "1.0",
            },
            tmp / "worker.log",
            "maps",
        )
        worker.start().ready()
        claims = redis.Redis.from_url(f"{base}/1", decode_responses=True)
        try:
            yield {"client": client, "out": tmp / "out", "claims": claims, "worker": worker}
        finally:
            worker.stop()
            client.close()
            claims.close()


@pytest.fixture(scope="module")
def maps_build() -> ModuleType:
    """examples/maps/build.py, imported by path."""
    return _load(EXAMPLES / "maps" / "build.py", "fenced_example_maps_build")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".tmp" not in p.relative_to(root).parts
    }


def test_maps_same_rebuild_twice_one_runs_one_skips(maps: dict[str, Any]) -> None:
    results = _run_all(maps["client"], "maps.rebuild_map", ("roads",), ("roads",))
    by_status = {r["status"]: r for r in results}
    assert sorted(by_status) == ["ok", "skipped"], (results, maps["worker"].tail())
    skipped = by_status["skipped"]
    assert skipped["claim"] == "rebuild:roads"
    assert skipped["reason"] == "already running"
    # The skip is recorded as a skip, next to the run that did the work.
    outcomes = [rec.outcome for rec in records.history(maps["claims"], "rebuild:roads", limit=10)]
    assert "skipped" in outcomes and "ok" in outcomes, outcomes
    assert "failed" not in outcomes


def test_maps_repeated_rebuild_writes_identical_bytes(
    maps: dict[str, Any], maps_build: ModuleType
) -> None:
    out: Path = maps["out"]
    (first,) = _run_all(maps["client"], "maps.rebuild_map", ("water",))
    assert first["status"] == "ok", first
    objects_before = _snapshot(out / "objects")
    published_before = maps_build.Output.at(out).published("water")

    (second,) = _run_all(maps["client"], "maps.rebuild_map", ("water",))
    assert second["status"] == "ok", second
    objects_after = _snapshot(out / "objects")
    published_after = maps_build.Output.at(out).published("water")

    # Same bytes at the same paths, the same manifest, published again by a newer fence.
    assert objects_after == objects_before
    assert second["manifest"] == first["manifest"]
    assert published_after.digest == published_before.digest == first["manifest"]
    assert published_after.target == published_before.target
    assert published_after.fence == second["fence"] > first["fence"] == published_before.fence

    store = maps_build.Output.at(out).store
    tiles = store.read_manifest(published_after.digest)
    assert len(tiles) == sum(4**z for z in maps_build.ZOOMS)
    assert store.read_bytes(tiles["3/7/7.png"]) == maps_build.tile_png("water", 3, 7, 7)
    assert store.read_bytes(tiles["0/0/0.png"]).startswith(b"\x89PNG\r\n\x1a\n")


def test_maps_two_layers_run_side_by_side(maps: dict[str, Any]) -> None:
    results = _run_all(maps["client"], "maps.rebuild_map", ("parks",), ("rail",))
    assert [r["status"] for r in results] == ["ok", "ok"], results
    assert results[0]["manifest"] != results[1]["manifest"]
    # Claims named per layer do not contend: the two runs overlapped.
    parks, rail = (records.last(maps["claims"], f"rebuild:{n}") for n in ("parks", "rail"))
    assert parks is not None and rail is not None
    assert parks.outcome == rail.outcome == "ok"
    assert parks.started is not None and parks.finished is not None
    assert rail.started is not None and rail.finished is not None
    assert parks.started < rail.finished and rail.started < parks.finished


def test_maps_stale_publish_is_refused(
    server: RedisServer, tmp_path: Path, maps_build: ModuleType
) -> None:
    client = server.client()
    old = Claim(client, "rebuild:roads", ttl=5, heartbeat=False)
    assert old.acquire()
    old.release()
    new = Claim(client, "rebuild:roads", ttl=5, heartbeat=False)
    assert new.acquire()
    output = maps_build.Output.at(tmp_path)
    manifest, published = maps_build.rebuild("roads", output, fence=new.fence)
    # The old holder wakes up and finishes its rebuild: its publish is refused.
    with pytest.raises(StaleFence):
        maps_build.rebuild("roads", output, fence=old.fence)
    assert output.published("roads") == published
    assert published.digest == manifest.digest
    new.release()


def test_maps_layer_names_are_checked(maps_build: ModuleType) -> None:
    for bad in ("", "../etc", "Roads", "a b", "x" * 65):
        with pytest.raises(ConfigError):
            maps_build.check_layer(bad)


# -- djangofeeds -------------------------------------------------------------------


class _FeedHandler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".rss": "application/rss+xml; charset=utf-8",
        ".atom": "application/atom+xml; charset=utf-8",
    }

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def feeds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Migrated SQLite, an HTTP server for the sample feeds, a redis-server and a worker."""
    tmp = tmp_path_factory.mktemp("djangofeeds")
    docs = tmp / "www"
    shutil.copytree(DJANGOFEEDS / "sample_feeds", docs)
    db = tmp / "feeds.sqlite3"
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_FeedHandler, directory=str(docs))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    with RedisServer() as server:
        base = server.url.rsplit("/", 1)[0]
        env = {
            "DJANGO_SETTINGS_MODULE": "djangofeeds.settings",
            "DJANGOFEEDS_DB": str(db),
            "DJANGOFEEDS_BROKER_URL": f"{base}/0",
            "DJANGOFEEDS_RESULT_BACKEND": f"{base}/0",
            "FENCED_REDIS_URL": f"{base}/1",
        }
        subprocess.run(
            [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"],
            cwd=DJANGOFEEDS,
            env={**os.environ, **env},
            check=True,
        )
        client = _client(f"{base}/0")
        worker = example_worker("djangofeeds", DJANGOFEEDS, env, tmp / "worker.log", "feeds")
        worker.start().ready()
        host, port = httpd.server_address[:2]
        assert isinstance(host, str)  # an AF_INET server's address, never bytes
        try:
            yield {
                "client": client,
                "db": db,
                "docs": docs,
                "base_url": f"http://{host}:{port}",
                "worker": worker,
                "env": env,
            }
        finally:
            worker.stop()
            client.close()
            httpd.shutdown()
            httpd.server_close()


def _entries(db: Path, url: str) -> list[tuple[Any, ...]]:
    """(guid, title, link, published) of a feed's entries, ordered by guid."""
    with sqlite3.connect(db) as conn:
        return conn.execute(
            "SELECT e.guid, e.title, e.link, e.published FROM feeds_entry e "
            "JOIN feeds_feed f ON f.id = e.feed_id WHERE f.url = ? ORDER BY e.guid",
            (url,),
        ).fetchall()


def _fences(db: Path, url: str) -> set[int]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT e.fence FROM feeds_entry e JOIN feeds_feed f ON f.id = e.feed_id "
            "WHERE f.url = ? UNION SELECT fence FROM feeds_feed WHERE url = ?",
            (url, url),
        ).fetchall()
    return {int(r[0]) for r in rows}


def _import(feeds: dict[str, Any], *urls: str) -> list[dict[str, Any]]:
    return _run_all(feeds["client"], "feed.import", *[(u,) for u in urls])


class _Feed(TypedDict):
    count: int
    title: str
    entry: tuple[str, str, str, str]


EXPECTED: dict[str, _Feed] = {
    "news.rss": {
        "count": 4,
        "title": "City Maps Newsroom",
        # (guid, title, link, published) of the entry dated +0200, converted to UTC.
        "entry": (
            "maps-news-2024-0041",
            "Cycle lanes added to the roads layer",
            "https://maps.example.org/news/cycle-lanes",
            "2024-06-03 12:05:00",
        ),
    },
    "releases.atom": {
        "count": 3,
        "title": "fenced releases",
        "entry": (
            "tag:releases.example.org,2024:fenced/0.2.1",
            "0.2.1: heartbeat survives fork",
            "https://releases.example.org/fenced/0.2.1",
            "2024-05-21 06:45:00",
        ),
    },
}


@pytest.mark.parametrize("doc", ["news.rss", "releases.atom"])
def test_feed_import_twice_converges(feeds: dict[str, Any], doc: str) -> None:
    url = f"{feeds['base_url']}/{doc}"
    (first,) = _import(feeds, url)
    assert first["status"] == "ok", (first, feeds["worker"].tail())
    assert first["entries"] == first["written"] - 1 == EXPECTED[doc]["count"]
    rows = _entries(feeds["db"], url)
    expected = EXPECTED[doc]
    assert len(rows) == expected["count"]
    (match,) = [r for r in rows if r[0] == expected["entry"][0]]
    # SQLite keeps the datetime as text; compare to the second.
    assert (*match[:3], str(match[3])[:19]) == expected["entry"]
    with sqlite3.connect(feeds["db"]) as conn:
        (title,) = conn.execute("SELECT title FROM feeds_feed WHERE url = ?", (url,)).fetchone()
    assert title == expected["title"]

    (second,) = _import(feeds, url)
    assert second["status"] == "ok", second
    assert _entries(feeds["db"], url) == rows
    assert _fences(feeds["db"], url) == {second["fence"]}
    assert second["fence"] > first["fence"]


def test_feed_imported_concurrently_twice_converges(feeds: dict[str, Any]) -> None:
    reference = f"{feeds['base_url']}/news.rss?run=reference"
    url = f"{feeds['base_url']}/news.rss?run=concurrent"
    (ref,) = _import(feeds, reference)
    assert ref["status"] == "ok", ref
    results = _import(feeds, url, url)
    statuses = sorted(r["status"] for r in results)
    assert statuses in (["ok", "ok"], ["ok", "skipped"]), results
    for r in results:
        if r["status"] == "skipped":
            assert r["reason"] == "already running"
    results = _import(feeds, url, url)
    assert "ok" in [r["status"] for r in results], results
    assert _entries(feeds["db"], url) == _entries(feeds["db"], reference)


def test_feed_update_converges_and_stale_import_cannot_overwrite(
    feeds: dict[str, Any],
) -> None:
    docs: Path = feeds["docs"]
    original = (docs / "news.rss").read_text()
    changing = docs / "changing.rss"
    changing.write_text(original)
    url = f"{feeds['base_url']}/changing.rss"
    (first,) = _import(feeds, url)
    assert first["status"] == "ok", first
    before = _entries(feeds["db"], url)

    new_title = "Incident layer rebuilt every minute"
    tmp = docs / "changing.rss.tmp"
    tmp.write_text(original.replace("Incident layer rebuilt every five minutes", new_title))
    os.replace(tmp, changing)
    (second,) = _import(feeds, url)
    assert second["status"] == "ok", second
    after = _entries(feeds["db"], url)
    assert len(after) == len(before)
    changed = [(b, a) for b, a in zip(before, after) if b != a]
    assert len(changed) == 1
    assert changed[0][0][1] == "Incident layer rebuilt every five minutes"
    assert changed[0][1][1] == new_title
    (third,) = _import(feeds, url)
    assert _entries(feeds["db"], url) == after

    # An import that held the claim before the last one (its fence is lower) writes the
    # old title: the fenced upsert leaves every newer row as it is.
    importer = _load(DJANGOFEEDS / "feeds" / "importer.py", "fenced_example_feeds_importer")
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{feeds['db']}", connect_args={"timeout": 30})
    try:
        stale = importer.parse(url, original.encode(), "application/rss+xml")
        counts = importer.store_feed(engine, stale, fence=first["fence"])
    finally:
        engine.dispose()
    # Nothing written: the feed row and every entry were kept as the newer import left them.
    assert counts == {**counts, "entries": len(after), "written": 0, "kept": len(after) + 1}
    assert _entries(feeds["db"], url) == after
    assert _fences(feeds["db"], url) == {third["fence"]}


def test_feed_rows_read_back_through_the_django_orm(feeds: dict[str, Any]) -> None:
    url = f"{feeds['base_url']}/releases.atom?run=orm"
    (result,) = _import(feeds, url)
    assert result["status"] == "ok", result
    script = (
        "from feeds.models import Feed\n"
        f"feed = Feed.objects.get(url={url!r})\n"
        "for e in feed.entries.order_by('guid'):\n"
        "    print(e.guid, e.published.isoformat(), e.fence)\n"
    )
    out = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", script],
        cwd=DJANGOFEEDS,
        env={**os.environ, **feeds["env"]},
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    lines = [line for line in out if line.startswith("tag:")]
    assert lines == [
        f"tag:releases.example.org,2024:fenced/0.2.0 2024-05-02T16:20:00+00:00 {result['fence']}",
        f"tag:releases.example.org,2024:fenced/0.2.1 2024-05-21T06:45:00+00:00 {result['fence']}",
        f"tag:releases.example.org,2024:fenced/0.3.0 2024-06-10T12:00:00+00:00 {result['fence']}",
    ]


DJANGO_SETTINGS_PROBE = """
import json, os
from django.conf import settings
settings.CELERY_FENCED_REDIS_URL  # the settings are read now, the environment with them
del os.environ["FENCED_REDIS_URL"]  # from here on only the setting can name the store
from djangofeeds.celery import app
from fenced.celery._options import lock_url
from fenced.doctor import check_celery
app.loader.import_default_modules()
print(json.dumps({
    "url": lock_url(app),
    "ttl": app.tasks["feed.import"]._options().claim.ttl,
    "findings": sorted(f.code for f in check_celery(app) if f.severity != "info"),
}))
"""


def test_feeds_settings_name_the_claim_store_as_celery_fenced_redis_url() -> None:
    """The app reads CELERY_FENCED_* through Celery's CELERY_ namespace, and the doctor
    finds nothing to warn about in its settings."""
    store = "redis://127.0.0.1:1/7"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FENCED_")},
        "DJANGO_SETTINGS_MODULE": "djangofeeds.settings",
        "FENCED_REDIS_URL": store,
        "PYTHONPATH": os.pathsep.join([str(DJANGOFEEDS), str(ROOT / "src")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", DJANGO_SETTINGS_PROBE],
        cwd=DJANGOFEEDS,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe == {"url": store, "ttl": 60.0, "findings": []}

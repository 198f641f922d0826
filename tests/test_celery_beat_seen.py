"""A beat led under fenced, seen from outside: its metrics (ticks sent and refused,
leading; the leaderless alarm's count is in test_celery_beat.py), each entry's next
tick, ``fenced show`` and ``fenced ls`` of its claim, and the dashboard's
``/api/beats/NAME`` (the page itself: test_web_browser.py).

Schedulers in this process on a real redis-server (clocks driven, as in
test_celery_beat.py), and a real ``celery beat`` process serving ``/metrics`` over HTTP.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

import pytest
from celery import Celery
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from _wait import wait_for
from celery_harness import Beat, Services
from fenced import Claim
from fenced._beat import at
from fenced._errors import ConfigError
from fenced._lease import ClaimKeys
from fenced.celery.beat import Scheduler, status, task_id
from fenced.testing import RedisServer, free_port
from fenced.web import create_app
from fenced.web.app import HEADERS
from test_celery_beat import T0, Wall, _app, _scheduler


def value(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    """A sample's value, None when the series does not exist."""
    return reg.get_sample_value(name, labels)


def test_a_beat_counts_what_it_sends_and_what_it_may_no_longer_send(
    server: RedisServer, sent: list[str], registry: CollectorRegistry
) -> None:
    wall = Wall(T0)
    first = _scheduler(_app(server, a={}, b={}), wall)
    assert value(registry, "fenced_beat_leading", beat="unit") == 0  # shown from the start
    first.tick()
    assert value(registry, "fenced_beat_leading", beat="unit") == 1
    wall.ms = T0 + 60_010
    first.tick()
    assert sorted(sent) == [task_id("unit", n, T0 + 60_000) for n in ("a", "b")]
    for entry in ("a", "b"):
        assert value(registry, "fenced_beat_ticks_dispatched_total", beat="unit", entry=entry) == 1
    # Each entry's next tick, where `fenced beat` reads it.
    report = status(server.client(), "unit")
    assert report.upcoming == {"a": at(T0 + 120_000), "b": at(T0 + 120_000)}
    # Cut off: its lease ends behind its back and another holder takes the claim.
    client = server.client()
    client.delete(ClaimKeys.of("beat:unit").lock)
    other = Claim(client, "beat:unit", ttl=10, heartbeat=False)
    assert other.acquire()
    wall.ms = T0 + 120_010
    first.tick()
    assert not first.leading and len(sent) == 2
    assert value(registry, "fenced_beat_leading", beat="unit") == 0
    for entry in ("a", "b"):
        assert value(registry, "fenced_beat_ticks_refused_total", beat="unit", entry=entry) == 1
        assert value(registry, "fenced_beat_ticks_dispatched_total", beat="unit", entry=entry) == 1
    assert value(registry, "fenced_beat_leaderless_alarms_total", beat="unit") is None
    other.release()
    first.close()


def test_a_metrics_port_needs_metrics_on_and_a_port_number() -> None:
    app = Celery("beat_port", broker="memory://")
    app.conf.update(fenced_redis_url="redis://127.0.0.1:1/0", fenced_beat_metrics_port=9809)
    with pytest.raises(ConfigError, match="fenced_beat_metrics_port=9809 serves the beat's"):
        Scheduler(app, lazy=True)
    app = Celery("beat_port2", broker="memory://")
    app.conf.update(
        fenced_redis_url="redis://127.0.0.1:1/0", fenced_metrics=True, fenced_beat_metrics_port=0
    )
    with pytest.raises(ConfigError, match="fenced_beat_metrics_port=0 must be a TCP port"):
        Scheduler(app, lazy=True)


# -- a celery beat process --------------------------------------------------------------------


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    """Every sample a ``/metrics`` shows, by name and labels; None while none answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _fenced(*args: str) -> str:
    shown = subprocess.run(
        [sys.executable, "-m", "fenced.cli", *args], capture_output=True, text=True, check=True
    )
    return shown.stdout


def test_a_beat_process_serves_its_metrics_and_is_shown_as_a_beat(
    redis_server: RedisServer,
) -> None:
    services = Services.on(redis_server)
    port = free_port()
    env = {"FENCED_METRICS": "1", "FENCED_TEST_BEAT_METRICS_PORT": str(port)}
    beat = Beat(services, ttl=1.5, name="seen", env=env).start()
    tests = (("beat", "tests"),)
    sent_one = ("fenced_beat_ticks_dispatched_total", (("beat", "tests"), ("entry", "every-1s")))
    try:

        def scraped() -> Any:
            samples = _scrape(port)
            return samples if samples and samples.get(sent_one) else None

        samples = wait_for("the beat to send a tick", scraped, 60.0, 0.2)
        assert samples[("fenced_beat_leading", tests)] == 1, beat.log()
        lock = services.lock_url

        # fenced beat: who leads, each entry's last tick and next one.
        seen = json.loads(_fenced("beat", "tests", "--redis", lock, "--json"))
        assert seen["leader"]["pid"] == beat.pid
        entry = seen["entries"]["every-1s"]
        assert entry["next"] is not None and entry["next"] > entry["due"]
        assert f"every-1s: {entry['due'][:10]}" in _fenced("beat", "tests", "--redis", lock)

        # fenced show of the leader's claim says it is a beat's, with its status.
        shown = json.loads(_fenced("show", "beat:tests", "--redis", lock, "--json"))
        assert shown["beat"]["beat"] == "tests"
        assert shown["beat"]["leader"]["pid"] == beat.pid
        assert set(shown["beat"]["entries"]) == {"every-1s", "every-2s", "claimed-2s"}
        text = _fenced("show", "beat:tests", "--redis", lock)
        assert "the leader claim of a beat: fenced beat tests" in text
        assert "no run recorded" not in text
        assert ", next " in text

        # fenced ls marks it; other claims are not beats.
        listed = {row["name"]: row for row in json.loads(_fenced("ls", "--redis", lock, "--json"))}
        assert listed["beat:tests"]["beat"] == "tests"
        assert all(row["beat"] is None for name, row in listed.items() if name != "beat:tests")
        assert "beat leader (fenced beat tests)" in _fenced("ls", "--redis", lock, "--wide")

        # The dashboard: /api/beats/NAME as fenced beat --json, the claim's detail and row.
        with TestClient(create_app(services.locks()), base_url="http://testserver") as web:
            answer = web.get("/api/beats/tests")
            assert answer.status_code == 200
            for header, text in HEADERS.items():
                assert answer.headers[header] == text
            data = answer.json()
            assert set(data) == set(seen) | {"now"}
            assert data["leader"]["pid"] == beat.pid and data["claim"] == "beat:tests"
            assert set(data["entries"]) == set(seen["entries"])
            assert web.get("/api/beats/nobody").json()["leader"] is None
            assert web.get("/api/beats/").status_code == 404
            assert web.get("/api/claims/beat%3Atests").json()["beat"]["beat"] == "tests"
            rows = {row["name"]: row for row in web.get("/api/claims").json()["claims"]}
            assert rows["beat:tests"]["beat"] == "tests"
    finally:
        beat.stop()

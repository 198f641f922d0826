"""Lifecycle events (``fenced.events``) from every front end, against real redis-servers.

Each test subscribes a recorder, takes real claims, and reads what was emitted: acquire,
skip (busy and "ran recently"), release, loss (the lease deleted under the holder, or
the server paused past the lease), renewals and their failures, Redis unreachable at
acquire; ``@exclusive``, ``fenced.aio`` and ``fenced run`` say where they come from and
carry their label. The log lines about a claim carry the ``fenced_*`` fields, read here
through a JSON formatter as a log indexer would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aredis
from redis.backoff import NoBackoff
from redis.retry import Retry

import fenced
from _wait import wait_for
from fenced import aio, events
from fenced._lease import ClaimKeys
from fenced._run import RunOptions, run_command
from fenced.celery._options import validate
from fenced.testing import RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


class Recorder:
    """Every event of this process while subscribed (events come from several threads)."""

    def __init__(self) -> None:
        self.events: list[events.ClaimEvent] = []
        self.threads: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, event: events.ClaimEvent) -> None:
        with self._lock:
            self.events.append(event)
            self.threads.append(threading.current_thread().name)

    def of(self, name: str, kind: str | None = None) -> list[events.ClaimEvent]:
        with self._lock:
            return [e for e in self.events if e.name == name and kind in (None, e.kind)]

    def kinds(self, name: str) -> list[str]:
        return [e.kind for e in self.of(name) if e.kind != "renewed"]

    def wait(self, name: str, kind: str, timeout: float = 15) -> events.ClaimEvent:
        return wait_for(
            f"a {kind!r} event of {name!r}", lambda: next(iter(self.of(name, kind)), None), timeout
        )


@pytest.fixture
def seen() -> Iterator[Recorder]:
    recorder = Recorder()
    unsubscribe = events.subscribe(recorder)
    try:
        yield recorder
    finally:
        unsubscribe()
    assert recorder not in events._subscribers


class JsonLines(logging.Formatter):
    """The stdlib-only JSON formatter the README shows: message plus the fenced_* fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"level": record.levelname, "logger": record.name, "message": record.getMessage()}
        line.update({k: v for k, v in vars(record).items() if k.startswith("fenced_")})
        return json.dumps(line, default=str)


class Lines(logging.Handler):
    """The formatted lines of a logger, as a JSON log shipper would receive them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(JsonLines())
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def json_log() -> Iterator[Lines]:
    handler = Lines()
    logger = logging.getLogger("fenced")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def test_acquire_skip_and_release_events(server: RedisServer, seen: Recorder) -> None:
    client = server.client()
    claim = fenced.Claim(client, "rebuild:acme:roads", ttl=10, label="rebuild:{tenant}:{layer}")
    assert claim.acquire()
    other = fenced.Claim(client, "rebuild:acme:roads", ttl=10)
    assert not other.acquire()
    assert claim.release()

    acquired, skipped, released = (
        seen.of("rebuild:acme:roads", kind)[0] for kind in ("acquired", "skipped", "released")
    )
    assert seen.kinds("rebuild:acme:roads") == ["acquired", "skipped", "released"]
    assert acquired.source == "claim" and acquired.label == "rebuild:{tenant}:{layer}"
    assert acquired.fence == claim.fence and acquired.slot is None and acquired.task is None
    assert acquired.holder is not None and acquired.holder.endswith(f":{claim._pid}")
    assert acquired.time > 0
    # The skip names the holder that made it skip; without a label, the name is the label.
    assert skipped.label == "rebuild:acme:roads" and skipped.reason == "already running"
    assert skipped.holder == acquired.holder and skipped.fence == claim.fence
    assert released.outcome == "ok" and released.duration is not None
    assert released.duration >= 0 and released.fence == claim.fence
    # Subscribers share one event: it cannot be changed, only copied with a change.
    with pytest.raises(AttributeError):
        released.outcome = "failed"  # type: ignore[misc]
    assert released._replace(outcome="failed").outcome == "failed" and released.outcome == "ok"
    # A second lease of the same claim: its holder text again, its own fence.
    assert claim.acquire() and claim.release()
    again = seen.of("rebuild:acme:roads", "acquired")[1]
    assert again.holder == acquired.holder and again.fence == claim.fence != acquired.fence


def test_a_cooldown_skip_says_ran_recently_and_a_slot_is_named(
    server: RedisServer, seen: Recorder
) -> None:
    client = server.client()
    with fenced.Claim(client, "report:daily", cooldown=60):
        pass
    assert not fenced.Claim(client, "report:daily", cooldown=60).acquire()
    skipped = seen.of("report:daily", "skipped")[0]
    assert skipped.reason == "ran recently" and skipped.holder is None

    first, second = (fenced.Claim(client, "export", limit=2) for _ in range(2))
    assert first.acquire() and second.acquire()
    slots = sorted(e.slot for e in seen.of("export", "acquired") if e.slot is not None)
    assert slots == [0, 1]
    first.release()
    second.release()


def test_a_lease_handed_over_for_a_retry_is_released_as_retried(
    server: RedisServer, seen: Recorder
) -> None:
    client = server.client()
    first = fenced.Claim(client, "retry:job", task_id="t-1")
    assert first.acquire()
    assert first.hand_over(5.0) == "retried"
    again = fenced.Claim(client, "retry:job", task_id="t-1")
    assert again.take_over()
    again.release()
    kinds = [(e.kind, e.outcome) for e in seen.of("retry:job")]
    assert kinds == [
        ("acquired", None),
        ("released", "retried"),
        ("acquired", None),
        ("released", "ok"),
    ]


def test_a_deleted_lease_is_lost_from_the_heartbeat_thread_with_json_log_fields(
    server: RedisServer, seen: Recorder, json_log: Lines
) -> None:
    client = server.client()
    claim = fenced.Claim(client, "sync:eu", ttl=0.9, label="sync:{region}")
    assert claim.acquire()
    seen.wait("sync:eu", "renewed")
    client.delete(claim.key)  # cleared under the holder: the next renewal finds it gone
    lost = seen.wait("sync:eu", "lost")
    assert lost.reason == "taken" and lost.fence == claim.fence
    assert lost.duration is not None and lost.duration > 0
    assert not claim.release()
    released = seen.of("sync:eu", "released")[0]
    assert released.outcome == "lost"
    renewed = seen.of("sync:eu", "renewed")[0]
    assert renewed.duration is not None and 0 <= renewed.duration < 0.9
    kinds = [(e.kind, t) for e, t in zip(seen.events, seen.threads) if e.name == "sync:eu"]
    assert ("lost", "fenced-heartbeat-lane") in kinds

    # The log line a JSON indexer receives for the loss.
    line = next(x for x in json_log.lines if x.get("fenced_event") == "lost")
    assert line["logger"] == "fenced" and line["level"] == "WARNING"
    assert line["fenced_claim"] == "sync:eu" and line["fenced_label"] == "sync:{region}"
    assert line["fenced_fence"] == claim.fence and line["fenced_outcome"] == "lost"
    assert line["fenced_holder"] == lost.holder


class Stall(logging.Handler):
    """Holds the heartbeat's thread at its "lost" log line until the test lets it go."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.stalled = threading.Event()
        self.go = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "fenced_event", None) == "lost" and not self.stalled.is_set():
            self.stalled.set()
            self.go.wait(15)


def test_a_lost_event_carries_the_lease_lost_when_the_claim_is_taken_again_meanwhile(
    server: RedisServer, seen: Recorder
) -> None:
    # The heartbeat declares the loss, and before it builds the event the owner (another
    # thread) releases and acquires again: the event is still about the lease lost.
    client = server.client()
    claim = fenced.Claim(client, "sync:race", ttl=0.9)
    stall = Stall()
    logger = logging.getLogger("fenced")
    logger.addHandler(stall)
    try:
        assert claim.acquire()
        first = claim.fence
        client.delete(claim.key)
        assert stall.stalled.wait(15), "the heartbeat never found the lease gone"
        assert not claim.release()
        assert claim.acquire() and claim.fence != first
        stall.go.set()
        lost = seen.wait("sync:race", "lost")
        assert lost.fence == first, (lost.fence, first, claim.fence)
        assert claim.release()
    finally:
        stall.go.set()
        logger.removeHandler(stall)


def test_a_paused_server_fails_renewals_then_the_claim_expires(seen: Recorder) -> None:
    with RedisServer() as srv:
        claim = fenced.Claim(srv.client(), "ingest", ttl=1.2)
        assert claim.acquire()
        srv.pause()
        try:
            failed = seen.wait("ingest", "renewal_failed")
            lost = seen.wait("ingest", "lost")
        finally:
            srv.resume()
        assert failed.reason and "Timeout" in failed.reason
        assert failed.duration is not None and failed.duration > 0
        assert lost.reason == "expired"
        claim.release()
    assert seen.kinds("ingest")[0] == "acquired"
    assert seen.kinds("ingest")[-1] == "released"


def test_unreachable_redis_at_acquire_is_unavailable(seen: Recorder) -> None:
    client = redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0))
    with pytest.raises(fenced.ClaimUnavailable):
        fenced.Claim(client, "nightly").acquire()
    (event,) = seen.of("nightly")
    assert event.kind == "unavailable" and event.reason and "ConnectionError" in event.reason


def test_a_raising_subscriber_is_logged_once_and_never_breaks_a_claim(
    server: RedisServer, seen: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(event: events.ClaimEvent) -> None:
        raise RuntimeError("subscriber bug")

    unsubscribe = events.subscribe(broken)
    try:
        client = server.client()
        for _ in range(3):
            with fenced.Claim(client, "cleanup") as claim:
                claim.check()
    finally:
        unsubscribe()
    failures = [r for r in caplog.records if "event subscriber" in r.getMessage()]
    assert len(failures) == 1 and failures[0].name == "fenced"  # at most once a minute
    # The other subscriber saw every event all the same.
    assert seen.kinds("cleanup") == ["acquired", "released"] * 3


def test_nothing_is_built_without_a_subscriber(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nobody listens (whatever else this process subscribed before).
    monkeypatch.setattr(events, "_subscribers", ())
    assert not events.enabled()

    def built(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an event was built with nobody subscribed")

    monkeypatch.setattr(events, "ClaimEvent", built)
    client = server.client()
    with fenced.Claim(client, "quiet") as claim:
        assert not fenced.Claim(client, "quiet").acquire()
        claim.refresh()
    client.set(claim.key, "someone-else")
    claim2 = fenced.Claim(client, "quiet2", ttl=5)
    claim2.acquire()
    client.delete(claim2.key)
    assert not claim2.release()


def test_exclusive_events_carry_the_template_or_the_label(
    server: RedisServer, seen: Recorder
) -> None:
    client = server.client()

    @fenced.exclusive("report:{tenant}", redis=client)
    def report(tenant: str) -> str:
        return tenant

    @fenced.exclusive("report:{tenant}", redis=client, label="reports")
    def labelled(tenant: str) -> str:
        return tenant

    def name_of(tenant: str) -> str:
        return f"by-callable:{tenant}"

    @fenced.exclusive(name_of, redis=client)
    def called(tenant: str) -> str:
        return tenant

    assert report("acme") == "acme" and called("acme") == "acme"
    held = fenced.Claim(client, "report:zeta")
    assert held.acquire()
    assert not labelled("zeta")  # skipped
    held.release()

    assert {e.label for e in seen.of("report:acme")} == {"report:{tenant}"}
    assert {e.source for e in seen.of("report:acme")} == {"exclusive"}
    assert seen.kinds("report:acme") == ["acquired", "released"]
    assert {e.label for e in seen.of("by-callable:acme")} == {name_of.__qualname__}
    skipped = [e for e in seen.of("report:zeta", "skipped") if e.source == "exclusive"]
    assert skipped and skipped[0].label == "reports" and skipped[0].reason == "already running"


def test_aio_claim_events(server: RedisServer, seen: Recorder) -> None:
    async def main() -> None:
        client = aredis.from_url(server.url)
        try:
            async with aio.Claim(client, "aio:job", label="aio:{kind}"):
                pass
        finally:
            await client.aclose()

    asyncio.run(main())
    assert seen.kinds("aio:job") == ["acquired", "released"]
    assert {(e.source, e.label) for e in seen.of("aio:job")} == {("aio", "aio:{kind}")}


def test_fenced_run_events_and_log_fields_carry_its_label(
    server: RedisServer, seen: Recorder, json_log: Lines
) -> None:
    client = server.client()
    opts = RunOptions(
        name="backup:orders",
        argv=[sys.executable, "-c", "import time; time.sleep(30)"],
        claim={"ttl": 1.0, "label": "backup:{db}"},
        grace=0.5,
        quiet=True,
    )
    said: list[str] = []

    def delete_when_acquired() -> None:
        seen.wait("backup:orders", "acquired")
        client.delete(ClaimKeys.of("backup:orders", "fenced").lock)

    deleter = threading.Thread(target=delete_when_acquired)
    deleter.start()
    results: list[dict[str, Any]] = []
    code = run_command(client, opts, say=said.append, on_result=results.append)
    deleter.join()
    assert code == 76 and results[0]["label"] == "backup:{db}"
    assert seen.kinds("backup:orders") == ["acquired", "lost", "released"]
    assert {(e.source, e.label) for e in seen.of("backup:orders")} == {("run", "backup:{db}")}
    assert seen.of("backup:orders", "released")[0].outcome == "lost"
    line = next(x for x in json_log.lines if x.get("fenced_event") == "lost")
    assert line["fenced_claim"] == "backup:orders" and line["fenced_label"] == "backup:{db}"


def fenced_run(url: str, label: str, name: str) -> subprocess.CompletedProcess[str]:
    """``fenced run --label LABEL --json NAME -- true`` as a real subprocess."""
    argv = ["run", "--redis", url, "--label", label, "--json", name, "--", "true"]
    return subprocess.run(
        [sys.executable, "-m", "fenced", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )


def test_fenced_run_reports_its_label_in_json(server: RedisServer) -> None:
    res = fenced_run(server.url, "backup:{db}", "backup:users")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["label"] == "backup:{db}" and result["outcome"] == "ok"


def _check_refused(call: Callable[[], Any], words: str) -> None:
    with pytest.raises(fenced.ConfigError, match=words):
        call()


def test_a_label_is_printable_and_bounded(server: RedisServer) -> None:
    client = server.client()
    _check_refused(lambda: fenced.Claim(client, "x", label="a\nb"), "not printable")
    _check_refused(lambda: fenced.Claim(client, "x", label="l" * 201), "at most 200")
    _check_refused(lambda: fenced.exclusive("x", redis=client, label=""), "non-empty")
    _check_refused(lambda: validate({"claim_label": 7}, "task t"), "task t: claim_label=7")
    _check_refused(lambda: events.subscribe("not callable"), "needs a callable")  # type: ignore[arg-type]
    res = fenced_run("redis://127.0.0.1:1/0", "bad\x1blabel", "job")
    assert res.returncode == 2 and "--label" in res.stderr and "printable" in res.stderr


_FORK_WHILE_SUBSCRIBING = r"""
import os, signal, threading, time
from fenced import events

held = threading.Event()

def subscribing_slowly():  # another thread in the middle of subscribe()
    with events._lock:
        held.set()
        time.sleep(0.5)

threading.Thread(target=subscribing_slowly).start()
held.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(10)
    events.subscribe(print)()  # would wait forever on a lock held at the fork
    os._exit(0)
print(os.waitpid(pid, 0)[1])
"""


def test_a_child_forked_while_another_thread_subscribes_can_subscribe() -> None:
    res = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_SUBSCRIBING], capture_output=True, text=True, timeout=60
    )
    assert res.stdout.split() == ["0"], res.stdout + res.stderr

"""Hostile or malformed data in Redis: the tools show it as unreadable, acquirers honour
the lease or name the key at fault, and nothing reaches a terminal raw.

Each case seeds a real redis-server with a value fenced never writes (bytes that are
not UTF-8, JSON of the wrong shape, a key of the wrong type, terminal escapes) beside a
claim that is fine, and runs the operator tools and the acquirers over it.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from celery import Celery
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

import fenced
import fenced.aio
from _clock import ManualClock
from celery_harness import WAIT, Services, Worker, key
from fenced import Claim, ClaimUnavailable, CorruptKey, exclusive, records
from fenced._inspect import ClaimInfo, ClaimReport, list_claims, read_holder, show_claim
from fenced._lease import ClaimKeys, Holder
from fenced._lock import fence_key
from fenced._printable import printable
from fenced._views import claims_list, claims_table, report_list, report_table
from fenced.celery import ClaimedTask
from fenced.doctor import run_doctor
from fenced.doctor._finding import Finding, Report, format_text, render
from fenced.testing import RedisServer

FENCED = [sys.executable, "-m", "fenced.cli"]
ESC = "\x1b"
#: A host name that clears the screen, sets the window title and hides a link.
EVIL_HOST = "\x1b[2J\x1b]0;owned\x07\x1b]8;;http://evil.example/\x07click\x1b]8;;\x07"
EVIL_REASON = "\x1b[31mred\x1b[0m [bold]markup[/bold] \u202eelif\u202c \x9b2J"

Seed = Callable[[redis.Redis], Any]
#: The burst record of a debounced task's name (fenced.celery._debounce).
BURST = "fenced:{bad}:debounce"


def keys(name: str = "bad") -> ClaimKeys:
    return ClaimKeys("fenced", name)


def held_by(token: str | bytes = "abcd:host:1:") -> Seed:
    return lambda r: r.set(keys().lock, token, px=60_000)


def record(**fields: str | bytes) -> Seed:
    """A held claim whose stream (as an earlier version wrote run records) has one
    started and one finished entry carrying ``fields``."""

    def seed(r: redis.Redis) -> None:
        held_by()(r)
        for event in ("started", "finished"):
            entry: dict[str | bytes, str | bytes] = {"event": event, "token": "t1", "r": "{}"}
            if event == "finished":
                entry["outcome"] = "ok"
            entry.update(fields)
            r.xadd(keys().runs, entry)  # type: ignore[arg-type]

    return seed


def entry(fields: dict[str, Any], r: str | bytes = "{}", *, head: bytes | None = None) -> bytes:
    """A records list entry as the scripts push it: its fields' JSON (``head``, when
    given, in its place), a newline, the record's JSON."""
    if head is None:
        head = json.dumps({"at": "1700000000000", **fields}).encode()
    return head + b"\n" + (r.encode() if isinstance(r, str) else r)


def listed(r: str | bytes = "{}", *, head: bytes | None = None, **fields: str) -> Seed:
    """A held claim whose records list has one started and one finished entry carrying
    ``fields`` (``r`` the record's JSON, ``head`` the fields' JSON as written)."""

    def seed(client: redis.Redis) -> None:
        held_by()(client)
        for event in ("started", "finished"):
            with_event: dict[str, Any] = {"event": event, "token": "t1"}
            if event == "finished":
                with_event["outcome"] = "ok"
            with_event.update(fields)
            client.lpush(keys().records, entry(with_event, r, head=head))

    return seed


def both(*seeds: Seed) -> Seed:
    def seed(r: redis.Redis) -> None:
        for s in seeds:
            s(r)

    return seed


#: case -> (seed, what ``fenced show bad`` says about it)
CASES: dict[str, tuple[Seed, str]] = {
    "token not UTF-8": (held_by(b"\xff\xfe\x00"), "unreadable: the lease's value is not UTF-8"),
    "token pid not a plain integer": (held_by("abcd:host:\u00b2:task"), "host pid ?"),
    "token pid not a number": (held_by("abcd:host:x:"), "host pid ?"),
    "token of another format": (held_by("just-a-value"), "? pid ?"),
    "lock is a hash": (lambda r: r.hset(keys().lock, "a", "b"), "unreadable: "),
    "fence not an integer": (
        both(held_by(), lambda r: r.set(keys().fence, "yesterday")),
        "fence ?",
    ),
    "fence is a hash": (both(held_by(), lambda r: r.hset(keys().fence, "a", "b")), "fence ?"),
    "skips not an integer": (both(held_by(), lambda r: r.set(keys().skips, "many")), "bad"),
    "records is a string": (
        both(held_by(), lambda r: r.set(keys().records, "x")),
        "unreadable: fenced:{bad}:records: WRONGTYPE",
    ),
    "the stream of an earlier version is a string": (
        both(held_by(), lambda r: r.set(keys().runs, "x")),
        "unreadable: fenced:{bad}:runs: WRONGTYPE",
    ),
    "listed r not UTF-8": (listed(b"\xff{"), "unreadable: field 'r' is not UTF-8"),
    "listed r not JSON": (listed("not json"), "unreadable: r is not JSON"),
    "listed r a list": (listed("[1, 2]"), "unreadable: r is a JSON list"),
    "listed fields not UTF-8": (
        listed(head=b'{"event": "\xff"}'),
        "the entry's fields are not UTF-8",
    ),
    "listed fields not JSON": (listed(head=b"event"), "the entry's fields are not JSON: 'event'"),
    "listed fields a list": (listed(head=b"[1]"), "the entry's fields are a JSON list"),
    "listed at not a time": (listed(at="yesterday"), "unreadable: at 'yesterday' is not a"),
    "listed at of 400 digits": (listed(at="9" * 400), "unreadable: at '9999"),
    "listed numbers of 400 digits": (
        listed(json.dumps({"duration": 10**400, "at": 10**400, "pid": 10**400}), fence="9" * 400),
        "is not an integer from 1 to 2**63-2; duration is 1000000",
    ),
    "listed numbers past a float": (
        listed('{"duration": 1e400, "at": -1e400, "pid": 1e308}'),
        "unreadable: duration is",
    ),
    "stream id of 400 digits": (
        both(held_by(), lambda r: r.xadd(keys().runs, {"event": "started"}, id="9" * 19 + "-0")),
        "running",
    ),
    "listed without a newline": (
        both(held_by(), lambda r: r.lpush(keys().records, b'{"event": "started"}')),
        "running",
    ),
    "listed fence not an integer": (listed(fence="ten"), "unreadable: fence 'ten'"),
    "listed outcome unknown": (listed(outcome="\x1b[2J"), "unreadable: outcome"),
    "r not UTF-8": (record(r=b"\xff{"), "unreadable: field 'r' is not UTF-8"),
    "r not JSON": (record(r="not json"), "unreadable: r is not JSON"),
    "r a list": (record(r="[1, 2]"), "unreadable: r is a JSON list"),
    "r a number": (record(r="5"), "unreadable: r is a JSON int"),
    "r a string": (record(r='"text"'), "unreadable: r is a JSON str"),
    "r nested wrong types": (
        record(r='{"pid": "x", "at": "yesterday", "duration": {}, "task_id": [1]}'),
        "unreadable: duration is {}, not a number",
    ),
    "r missing": (
        both(held_by(), lambda r: r.xadd(keys().runs, {"event": "started", "token": "t"})),
        "running",
    ),
    "event missing": (
        both(held_by(), lambda r: r.xadd(keys().runs, {"x": "y"})),
        "unreadable: no event field",
    ),
    "fence field not an integer": (record(fence="ten"), "unreadable: fence 'ten'"),
    "outcome unknown": (record(outcome="\x1b[2J"), "unreadable: outcome"),
    "rerun member not a trigger": (
        both(held_by(), lambda r: r.sadd(keys().rerun, b"\xff", "[1]", "5")),
        "bad",
    ),
    "rate not an integer": (
        both(held_by(), lambda r: r.set(keys().rate, "soon", px=60_000)),
        "unreadable: rate 'soon' is not an integer",
    ),
    "rate a hash, debounce a string": (
        both(
            held_by(),
            lambda r: r.hset(keys().rate, "a", "b"),
            lambda r: r.set(BURST, "x"),
        ),
        "unreadable: rate: WRONGTYPE",
    ),
    "debounce fields not numbers": (
        both(
            held_by(),
            lambda r: r.hset(BURST, mapping={"id": EVIL_HOST, "calls": "many", "due": "later"}),
        ),
        "unreadable: debounce calls 'many' is not an integer",
    ),
    "debounce field not UTF-8": (
        both(held_by(), lambda r: r.hset(BURST, mapping={"id": "t", "first": b"\xff"})),
        "unreadable: debounce",
    ),
    "escapes in the holder and the records": (
        both(
            held_by(f"abcd:{EVIL_HOST}:1:{EVIL_HOST}"),
            record(r=json.dumps({"reason": EVIL_REASON, "worker": EVIL_HOST, "x": EVIL_REASON})),
        ),
        "\\x1b[2J",
    ),
}


@pytest.fixture
def url(redis_server: RedisServer) -> Iterator[str]:
    redis_server.client().flushall()
    yield redis_server.url


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A client that does not decode: it can write any bytes."""
    client = redis_server.client()
    yield client
    client.close()


def good_claim(client: redis.Redis) -> Claim:
    """A claim that is fine, held, with a finished run before it: the rest of a listing."""
    with Claim(client, "good", ttl=30, heartbeat=False, records=True):
        pass
    claim = Claim(client, "good", ttl=30, heartbeat=False, records=True)
    assert claim.acquire()
    return claim


def fenced_cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FENCED_REDIS_URL"}
    env.update(FENCED_REDIS_URL=url, COLUMNS="200")
    return subprocess.run(
        [*FENCED, *args], capture_output=True, text=True, env=env, timeout=60, check=False
    )


def fenced_view(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``fenced ls`` or ``fenced show`` run in this process, as :func:`fenced_cli` runs
    it in a new one (the hostile-data matrix reads a few hundred times: an interpreter
    start each cost about half a second). What escaped the command is in its stderr as
    the traceback a process would print."""
    import traceback

    from typer.testing import CliRunner

    from fenced.cli import app

    assert args[0] in ("ls", "show"), args  # commands that only read
    assert app is not None
    env = {"FENCED_REDIS_URL": url, "COLUMNS": "200"}
    res = CliRunner().invoke(app, list(args), env=env)
    err = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        err += "".join(traceback.format_exception(res.exception))
    return subprocess.CompletedProcess([*FENCED, *args], res.exit_code, res.stdout, err)


def clean(proc: subprocess.CompletedProcess[str]) -> str:
    """The command's whole output, checked for tracebacks and terminal controls, its
    runs of white space (a table's wrapping) made one space."""
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert ESC not in out and "\x9b" not in out and "\u202e" not in out, out
    return " ".join(out.split())


# -- the operator tools -------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_ls_and_show_list_hostile_data_as_unreadable_and_go_on(
    case: str, url: str, raw: redis.Redis
) -> None:
    seed, says = CASES[case]
    good_claim(raw)
    seed(raw)

    ls = fenced_view(url, "ls")
    out = clean(ls)
    assert ls.returncode == 0
    assert "good" in out and "bad" in out

    listed = json.loads(fenced_view(url, "ls", "--json").stdout)
    assert {c["name"] for c in listed} == {"good", "bad"}
    assert next(c for c in listed if c["name"] == "good")["holder"]["host"] != "?"

    show = fenced_view(url, "show", "bad")
    out = clean(show)
    assert show.returncode == 0
    assert says in out

    shown = json.loads(fenced_view(url, "show", "bad", "--json").stdout)
    assert shown["name"] == "bad"
    assert "good" in clean(fenced_view(url, "show", "good"))


def test_a_key_name_that_is_not_utf8_is_listed_as_unreadable(url: str, raw: redis.Redis) -> None:
    good_claim(raw)
    raw.set(b"fenced:{\xff\x1b[2J}:lock", "abcd:host:1:", px=60_000)
    out = clean(fenced_view(url, "ls"))
    assert "unreadable: the key name is not UTF-8" in out
    assert "good" in out
    listed = json.loads(fenced_view(url, "ls", "--json").stdout)
    assert [c["name"] for c in listed] == ["\\xff\x1b[2J", "good"]


def test_escapes_in_a_name_a_host_and_a_reason_never_reach_the_terminal(
    url: str, raw: redis.Redis
) -> None:
    name = "evil\x1b]0;title\x07\x1b[2J"  # not a name fenced makes: someone wrote the keys
    raw.set(ClaimKeys("fenced", name).lock, f"abcd:{EVIL_HOST}:1:task{EVIL_HOST}", px=60_000)
    raw.xadd(
        ClaimKeys("fenced", name).runs,
        {"event": "skipped", "holder": f"x:{EVIL_HOST}:2:", "reason": EVIL_REASON, "r": "{}"},
    )
    for args in (("ls",), ("ls", "--wide")):
        out = clean(fenced_view(url, *args))
        assert "evil\\x1b]0;title\\x07\\x1b[2J" in out
        assert "\\x1b[2J\\x1b]0;owned\\x07" in out
    with Claim(raw, "plain", ttl=30, heartbeat=False):
        pass
    # The stored name is not one `show` can be given, so the records are read as a view.
    report = ClaimReport(name, "fenced", read_holder(raw, "plain"), [])
    report.runs = records.from_entries(name, raw.xrevrange(ClaimKeys("fenced", name).runs))
    text = rendered(report_table(report)) + rendered(report_list(report))
    assert ESC not in text and "\u202e" not in text and "\x9b" not in text
    assert "[bold]markup[/bold]" in text  # data, not markup
    assert "\\u202eelif\\u202c" in text


def test_release_of_hostile_claims(url: str, raw: redis.Redis) -> None:
    raw.hset(keys().lock, "a", "b")
    refused = fenced_cli(url, "release", "bad", "--force", "--reason", "gone")
    out = clean(refused)
    assert refused.returncode == 69
    assert "'fenced:{bad}:lock' is a hash" in out and "DEL fenced:{bad}:lock" in out

    raw.delete(keys().lock)
    both(held_by(), lambda r: r.set(keys().records, "x"))(raw)
    unrecorded = fenced_cli(url, "release", "bad", "--force", "--reason", "gone")
    out = clean(unrecorded)
    assert unrecorded.returncode == 69, out
    assert "cannot record the release of claim 'bad'" in out
    assert "DEL fenced:{bad}:records" in out
    assert raw.get(keys().lock) is None  # cleared, but not recorded: the message says so
    raw.delete(keys().records)

    raw.set(keys().lock, f"abcd:{EVIL_HOST}:1:".encode() + b"\xff", px=60_000)
    asked = fenced_cli(url, "release", "bad")
    assert asked.returncode == 1 and "unreadable" in clean(asked)
    released = fenced_cli(url, "release", "bad", "--force", "--reason", "gone")
    assert released.returncode == 0 and "released" in clean(released)
    assert raw.get(keys().lock) is None
    raw.set(keys().lock, f"abcd:{EVIL_HOST}:1:", px=60_000)
    released = fenced_cli(url, "release", "bad", "--force", "--reason", "gone")
    assert released.returncode == 0 and "\\x1b[2J" in clean(released)


@pytest.mark.parametrize("case", list(CASES))
def test_library_readers_never_fail_on_hostile_data(case: str, r: Any, server: Any) -> None:
    CASES[case][0](server.client())
    holder = read_holder(r, "bad")
    assert holder is not None
    runs = records.history(r, "bad")
    records.last(r, "bad")
    records.consecutive_skips(r, "bad")
    listed = list_claims(r)
    assert [i.name for i in listed] == ["bad"]
    report = show_claim(r, "bad")
    for text in (json.dumps(report.as_dict()), json.dumps([i.as_dict() for i in listed])):
        json.loads(text)
    assert ESC not in rendered(report_table(report)) + rendered(claims_table(listed, "t"))
    assert all(run.outcome in (*records.OUTCOMES, records.UNREADABLE) for run in runs)


def test_the_doctor_reads_past_hostile_records(raw: redis.Redis, redis_server: Any) -> None:
    for case in (
        "r not JSON",
        "r a list",
        "records is a string",
        "the stream of an earlier version is a string",
        "r not UTF-8",
        "event missing",
        "listed r not JSON",
        "listed fields not JSON",
    ):
        raw.flushall()
        CASES[case][0](raw)
        for client in (raw, redis_server.client(decode_responses=True)):
            report = run_doctor(client, None)
            json.loads(report.as_json())


def test_doctor_findings_are_printed_escaped() -> None:
    # Findings quote argument names and templates from the run records.
    found = Finding("warning", "naming.too-coarse", f"x {EVIL_HOST}", EVIL_REASON, EVIL_HOST)
    report = Report([found])
    out = io.StringIO()
    render(report, Console(file=out, width=200, color_system=None))
    for text in (format_text(report), out.getvalue()):
        assert "\\x1b]0;owned" in text and ESC not in text and "\u202e" not in text


# -- the acquirers ---------------------------------------------------------------------------

#: case -> what an acquire meets: "busy" (the lease is honoured) or the key at fault.
ACQUIRE: dict[str, tuple[Seed, str]] = {
    "token not UTF-8": (held_by(b"\xff\xfe\x00"), "busy"),
    "token pid not a plain integer": (held_by("abcd:host:\u00b2:task"), "busy"),
    "token of another format": (held_by("just-a-value"), "busy"),
    "lock is a hash": (lambda r: r.hset(keys().lock, "a", "b"), "lock"),
    "fence not an integer, free": (lambda r: r.set(keys().fence, "yesterday"), "fence"),
    "fence not an integer, held": (
        both(held_by(), lambda r: r.set(keys().fence, "yesterday")),
        "busy",
    ),
    "fence is a hash": (lambda r: r.hset(keys().fence, "a", "b"), "fence"),
    "skips not an integer, held": (
        both(held_by(), lambda r: r.set(keys().skips, "many")),
        "skips",
    ),
    "records is a string": (lambda r: r.set(keys().records, "x"), "records"),
    "the stream of an earlier version is a string, held": (
        both(held_by(), lambda r: r.set(keys().runs, "x")),
        "busy",
    ),
    "rerun is a hash, held": (both(held_by(), lambda r: r.hset(keys().rerun, "a", "b")), "rerun"),
    "garbage records": (record(r="not json", fence="x"), "busy"),
}


def check_acquired(expect: str, outcome: Any, claim: Any, raw: redis.Redis) -> None:
    if expect == "busy":
        assert outcome is False
        assert claim.holder is not None
        assert raw.exists(keys().lock)  # honoured, never taken over
        return
    assert isinstance(outcome, CorruptKey), outcome
    assert isinstance(outcome, ClaimUnavailable)  # every caller already fails closed on it
    assert outcome.key == getattr(keys(), expect)
    assert f"DEL {outcome.key}" in str(outcome)
    # A script that stopped midway left no lease of ours behind.
    lock: Any = raw.get(keys().lock) if raw.type(keys().lock) == b"string" else None
    assert lock is None or not lock.startswith(str(claim.token or "-").encode())


@pytest.mark.parametrize("case", list(ACQUIRE))
def test_claim_acquire_honours_or_names_the_key(case: str, r: Any, server: Any) -> None:
    raw = server.client()
    seed, expect = ACQUIRE[case]
    seed(raw)
    claim = Claim(r, "bad", ttl=10, heartbeat=False, records=True)
    try:
        outcome: Any = claim.acquire(request_rerun="x")
    except CorruptKey as exc:
        outcome = exc
    check_acquired(expect, outcome, claim, raw)
    if expect == "busy":
        assert claim.holder is not None
        assert "unreadable" in str(claim.holder) or claim.holder.pid in (None, 1)


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decoded"])
@pytest.mark.parametrize("case", list(ACQUIRE))
def test_aio_claim_acquire_honours_or_names_the_key(
    case: str, decode: bool, redis_server: RedisServer, raw: redis.Redis
) -> None:
    raw.flushall()
    seed, expect = ACQUIRE[case]
    seed(raw)

    async def main() -> tuple[Any, fenced.aio.Claim]:
        client = redis.asyncio.Redis.from_url(redis_server.url, decode_responses=decode)
        claim = fenced.aio.Claim(client, "bad", ttl=10, heartbeat=False, records=True)
        try:
            try:
                return await claim.acquire(request_rerun="x"), claim
            except CorruptKey as exc:
                return exc, claim
        finally:
            await client.aclose()

    outcome, claim = asyncio.run(main())
    check_acquired(expect, outcome, claim, raw)


def test_a_lock_whose_fence_is_not_an_integer_is_corrupt_and_left_free(
    redis_server: RedisServer, raw: redis.Redis
) -> None:
    raw.flushall()
    raw.set(fence_key("report"), "yesterday")
    with pytest.raises(CorruptKey, match="DEL fenced:lock:\\{report\\}:fence"):
        fenced.Lock(raw, "report", timeout=10).acquire(blocking=False)
    assert raw.get("report") is None  # the lock the script set before it stopped is gone

    async def main() -> None:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            with pytest.raises(CorruptKey):
                await fenced.aio.Lock(client, "report", timeout=10).acquire(blocking=False)
        finally:
            await client.aclose()

    asyncio.run(main())
    assert raw.get("report") is None
    raw.delete(fence_key("report"))
    lock = fenced.Lock(raw, "report", timeout=10)
    assert lock.acquire(blocking=False)
    lock.release()


def test_exclusive_skips_an_unreadable_holder_and_names_a_corrupt_key(r: Any, server: Any) -> None:
    raw = server.client()
    ran: list[int] = []

    @exclusive("bad", redis=r, ttl=10)
    def job() -> int:
        ran.append(1)
        return 1

    held_by(b"\xff\xfe")(raw)
    skipped = job()
    assert not skipped and "unreadable" in str(skipped)
    raw.delete(keys().lock)
    raw.set(keys().fence, "yesterday")
    with pytest.raises(CorruptKey, match="fenced:\\{bad\\}:fence"):
        job()
    raw.delete(keys().fence)
    assert job() == 1
    assert ran == [1]


def test_the_heartbeat_renews_the_others_when_one_lease_is_replaced_by_garbage(
    r: Any, server: Any, fake_time: ManualClock
) -> None:
    ours = Claim(r, "bad", ttl=1.5, clock=fake_time)
    other = Claim(r, "other", ttl=1.5, clock=fake_time)
    assert ours.acquire() and other.acquire()
    raw = server.client()
    raw.delete(keys().lock)
    raw.hset(keys().lock, "a", "b")  # REFRESH now meets WRONGTYPE
    fake_time.run_until("the replaced lease to be lost", lambda: ours.lost, 60)
    # Two more ttls: the other lease lives on only if it is still being renewed.
    fake_time.run(2 * other.ttl)
    assert other.held
    assert raw.get(ClaimKeys("fenced", "other").lock) == str(other.token).encode()
    assert other.release()


@pytest.mark.parametrize(
    "seed",
    [
        lambda r: r.set(keys().records, "x"),
        lambda r: r.hset(keys().rerun, "a", "b"),
    ],
    ids=["records is a string", "rerun is a hash"],
)
def test_a_skip_refused_at_a_corrupt_key_writes_nothing(seed: Seed, r: Any, server: Any) -> None:
    raw = server.client()
    held_by()(raw)
    seed(raw)
    with pytest.raises(CorruptKey):
        Claim(r, "bad", ttl=10, heartbeat=False, records=True).acquire(request_rerun="x")
    assert raw.get(keys().skips) is None  # no skip counted that was not recorded
    assert raw.type(keys().records) in (b"string", b"none")


def test_a_release_past_a_records_key_of_another_type_releases_and_names_it(
    r: Any, server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    raw = server.client()
    claim = Claim(r, "bad", ttl=10, heartbeat=False, records=True)
    assert claim.acquire()
    raw.set(keys().records, "x")
    with caplog.at_level("WARNING", logger="fenced"):
        assert claim.release() is True
    assert not claim.vanished and claim.lost_reason is None
    assert raw.get(keys().lock) is None
    assert "its run was not recorded" in caplog.text and "DEL fenced:{bad}:records" in caplog.text

    # The block ends as it ran: the release answered, only its record is missing.
    raw.delete(keys().records)
    with Claim(r, "bad", ttl=10, heartbeat=False, records=True):
        raw.delete(keys().records)
        raw.hset(keys().records, "a", "b")
    assert raw.get(keys().lock) is None


def test_an_aio_release_past_a_records_key_of_another_type_releases(
    redis_server: RedisServer, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    raw.flushall()

    async def main() -> fenced.aio.Claim:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            claim = fenced.aio.Claim(client, "bad", ttl=10, heartbeat=False, records=True)
            assert await claim.acquire()
            raw.set(keys().records, "x")
            assert await claim.release() is True
            return claim
        finally:
            await client.aclose()

    with caplog.at_level("WARNING", logger="fenced"):
        claim = asyncio.run(main())
    assert not claim.vanished
    assert raw.get(keys().lock) is None
    assert "DEL fenced:{bad}:records" in caplog.text


def test_a_hand_over_past_a_records_key_of_another_type_keeps_the_lease(
    r: Any, server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    raw = server.client()
    claim = Claim(r, "bad", ttl=10, heartbeat=False, records=True, task_id="t1")
    assert claim.acquire()
    raw.set(keys().records, "x")
    with caplog.at_level("WARNING", logger="fenced"):
        assert claim.hand_over(30) == "retried"
    assert raw.get(keys().lock) == f"retry-{claim.token}".encode()
    assert "DEL fenced:{bad}:records" in caplog.text
    raw.delete(keys().records)
    retry = Claim(r, "bad", ttl=10, heartbeat=False, records=True, task_id="t1")
    assert retry.take_over()
    assert retry.release()


def test_fenced_run_skips_an_unreadable_holder_and_names_a_corrupt_key(
    url: str, raw: redis.Redis, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    held_by(f"abcd:{EVIL_HOST}:1:".encode() + b"\xff")(raw)
    skip = fenced_cli(url, "run", "bad", *command)
    assert skip.returncode == 0 and "someone unknown" in clean(skip)
    raw.set(keys().lock, f"abcd:{EVIL_HOST}:1:task{EVIL_HOST}", px=60_000)
    skip = fenced_cli(url, "run", "bad", *command)
    assert skip.returncode == 0 and "\\x1b]0;owned" in clean(skip)
    raw.delete(keys().lock)
    raw.set(keys().fence, "yesterday")
    refused = fenced_cli(url, "run", "bad", *command)
    assert refused.returncode == 69 and "DEL fenced:{bad}:fence" in clean(refused)
    assert not marker.exists()
    raw.delete(keys().fence)
    record(r="not json", fence="x")(raw)
    raw.delete(keys().lock)
    ran = fenced_cli(url, "run", "bad", *command)
    assert ran.returncode == 0 and marker.exists(), clean(ran)


def test_a_redelivered_task_runs_past_garbage_records(redis_server: RedisServer) -> None:
    redis_server.client().flushall()
    app = Celery("fenced_hostile", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = redis_server.url
    ran: list[str] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="job:{x}")
    def job(self: ClaimedTask, x: str) -> str:
        ran.append(x)
        return "done"

    raw = redis_server.client()
    runs = ClaimKeys("fenced", "job:a").runs
    for value in (b"\xff", "not json", "[1]", '{"task_id": {}, "duration": "x"}'):
        raw.xadd(runs, {"event": "started", "token": "t", "fence": "x", "r": value})
    raw.xadd(runs, {"nothing": "here"})
    garbage = [b"\xff", b"not json", b"[1]", entry({"event": "started", "fence": "x"}, "[1]")]
    raw.lpush(ClaimKeys("fenced", "job:a").records, *garbage)
    raw.sadd(ClaimKeys("fenced", "job:a").rerun, b"\xff", "[1]", "5", '"x"')
    result = job.apply(("a",), task_id="first", retries=1)
    assert result.successful(), result.traceback
    assert ran == ["a"]


def test_a_redelivered_task_in_a_real_worker_runs_past_garbage_records() -> None:
    with RedisServer() as server:
        services = Services.on(server)
        client = services.client()
        try:
            with Worker(services, concurrency=1, name="hostile"):
                k = key()
                task_id = f"again-{k}"
                locks = redis.Redis.from_url(services.lock_url)
                runs = ClaimKeys("fenced", f"rebuild:{k}:roads").runs
                # An earlier attempt of this task id that never ended, and garbage around it.
                started = json.dumps({"task_id": task_id, "duration": {}})
                locks.xadd(
                    runs, {"event": "started", "token": "a:h:1:x", "fence": "?", "r": started}
                )
                for value in (b"\xff", "not json", "[1]", '{"task_id": [], "pid": "x"}'):
                    locks.xadd(runs, {"event": "finished", "token": "b", "fence": "x", "r": value})
                locks.xadd(runs, {"no": "event"})
                result = client.send_task(
                    "t.rebuild",
                    args=(k, "roads"),
                    kwargs={"steps": 1, "step_time": 0.01, "run": k},
                    queue=services.queue,
                    task_id=task_id,
                    retries=1,  # as a redelivered message arrives
                )
                assert result.get(timeout=WAIT)["status"] == "ok"
                outcomes = [run.outcome for run in records.history(locks, f"rebuild:{k}:roads")]
                assert outcomes[0] == "ok" and "aborted" in outcomes
        finally:
            client.close()


# -- properties ------------------------------------------------------------------------------

anything = st.one_of(st.binary(max_size=40), st.text(max_size=40))
FIELD = st.sampled_from(["event", "token", "fence", "r", "outcome", "holder", "reason", "note"])
EVENT = st.sampled_from(["started", "finished", "skipped", "released"])
RECORD_KEY = st.sampled_from(["pid", "at", "duration", "reason", "task_id", "host", "args", "by"])
#: JSON of any shape, with the keys a run record has.
JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(RECORD_KEY, inner, max_size=4),
    max_leaves=8,
)


@st.composite
def entries(draw: st.DrawFn) -> list[tuple[bytes, dict[Any, Any]]]:
    out = []
    for i in range(draw(st.integers(0, 6))):
        fields: dict[Any, Any] = {b"event": draw(st.one_of(EVENT, anything))}
        fields.update(draw(st.dictionaries(FIELD, anything, max_size=5)))
        fields[b"r"] = draw(st.one_of(anything, JSON.map(json.dumps)))
        out.append((f"{1700000000000 + i}-0".encode(), fields))
    return out


@settings(max_examples=300, deadline=None)
@given(entries())
def test_any_entries_assemble_into_runs_and_render(given_entries: list[Any]) -> None:
    runs = records.from_entries("n", given_entries)
    report = ClaimReport("n", "fenced", None, runs)
    json.dumps(report.as_dict())
    text = rendered(report_table(report)) + rendered(report_list(report))
    assert ESC not in text


@settings(max_examples=300, deadline=None)
@given(anything, st.one_of(st.none(), st.integers()), st.one_of(st.none(), st.integers()))
def test_any_token_parses_and_renders(token: Any, pttl: int | None, fence: int | None) -> None:
    holder = Holder.parse(token, pttl, fence)
    json.dumps(holder.as_dict())
    info = ClaimInfo("n", holder, None, holder.expires_in, fence, 0, None, None)
    text = str(holder) + rendered(claims_table([info], "t")) + rendered(claims_list([info], "t"))
    assert ESC not in text


@given(st.text())
def test_printable_leaves_no_control_and_is_idempotent(text: str) -> None:
    shown = printable(text)
    assert printable(shown) == shown
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in shown)
    shown.encode("utf-8")  # no lone surrogate: a terminal can write it


def rendered(view: Any) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None, markup=False, emoji=False).print(view)
    return out.getvalue()


# -- a beat's stored state ---------------------------------------------------------------------

#: case -> the fields of beat ``proj``'s hash (fenced.celery.beat writes them) beside one
#: entry that is fine.
BEAT_CASES: dict[str, dict[bytes, bytes]] = {
    "escapes in a state": {b"entry:a": f"1700000000000:5:{EVIL_REASON}".encode()},
    "escapes in an entry's name": {f"entry:{EVIL_HOST}".encode(): b"1700000000000:5:sent"},
    "superscript digits": {b"entry:a": "\u00b2:\u00b3:sent".encode(), b"tick": "\u00b2".encode()},
    "digits past int()'s limit": {
        b"entry:a": b"9" * 4400 + b":1:sent",
        b"tick": b"9" * 4400,
        b"next:a": b"9" * 4400,
    },
    "a due time past year 9999": {
        b"entry:a": b"999999999999999:1:sent",
        b"tick": b"999999999999999",
        b"next:ok": b"999999999999999",
    },
    "a fence past 2**63": {b"entry:a": b"1700000000000:" + b"9" * 30 + b":sent"},
    "values not UTF-8": {b"entry:a": b"\xff\xfe:1:sent", b"tick": b"\xff", b"next:ok": b"\xff"},
    "names not UTF-8": {b"entry:\xff\x1b[2J": b"1700000000000:1:sent", b"next:\xff": b"1"},
}


@pytest.mark.parametrize("case", list(BEAT_CASES))
def test_a_beats_hostile_state_is_shown_escaped_and_never_breaks_a_reader(
    case: str, url: str, raw: redis.Redis
) -> None:
    from starlette.testclient import TestClient

    from fenced.web import create_app

    beat = keys("beat:proj").beat
    fields: dict[Any, Any] = {b"entry:ok": b"1700000000000:7:sent", **BEAT_CASES[case]}
    raw.hset(beat, mapping=fields)
    raw.set(keys("beat:proj").lock, "abcd:host:1:", px=60_000)
    out = clean(fenced_cli(url, "beat", "proj"))
    assert "ok: 2023-11-14T22:13:20+00:00 sent (fence 7)" in out, out
    shown = json.loads(fenced_cli(url, "beat", "proj", "--json").stdout)
    assert shown["entries"]["ok"]["fence"] == 7
    assert "Traceback" not in json.dumps(shown)
    out = clean(fenced_view(url, "show", "beat:proj"))
    assert "beat:proj" in out
    assert json.loads(fenced_view(url, "show", "beat:proj", "--json").stdout)["beat"]
    answer = TestClient(create_app(raw)).get("/api/beats/proj")
    assert answer.status_code == 200, answer.text
    assert answer.json()["entries"]["ok"]["fence"] == 7
    assert ESC not in answer.text

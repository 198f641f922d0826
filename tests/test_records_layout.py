"""Run records as a capped list per name: small, newest first, read as the stream was.

Each name's records are one Redis list (``{ns}:{name}:records``): an entry is its
fields' JSON (with the server's time in ms), a newline, the record's JSON. A stream an
earlier version wrote (``{ns}:{name}:runs``) is still read beside it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from fenced import Claim, records
from fenced._inspect import LS_RUNS, force_release, list_claims, show_claim
from fenced._lease import ClaimKeys
from fenced._scripts import STREAK_ENTRIES, as_text
from fenced.doctor._naming import load_records
from fenced.records import RunRecord


def _one_run(client: Any, name: str, **options: Any) -> Claim:
    claim = Claim(client, name, ttl=10, heartbeat=False, records=True, **options)
    assert claim.acquire()
    assert claim.release()
    return claim


def _shown(runs: list[RunRecord]) -> list[tuple[Any, ...]]:
    """What a run shows: outcome, holder, fence, times, and the rest."""
    return [
        (
            run.outcome,
            run.holder,
            run.fence,
            run.started,
            run.finished,
            run.duration,
            run.task_id,
            run.worker,
            run.token,
            run.reason,
            run.extra,
            run.unreadable,
        )
        for run in runs
    ]


def _untimed(shown: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """What :func:`_shown` says, but for when each run finished."""
    return [row[:4] + row[5:] for row in shown]


def _as_stream(client: Any, source: str, target: str) -> None:
    """Write ``source``'s list entries to ``target``'s stream, as an earlier version kept
    them: the same fields and record, the entry's time as the stream id."""
    listed = client.lrange(ClaimKeys("fenced", source).records, 0, -1)
    seq: dict[int, int] = {}
    ms = 0
    for item in reversed(listed):  # oldest first, as XADD appends
        text = item.decode() if isinstance(item, bytes) else item
        head, record = text.split("\n", 1)
        fields = json.loads(head)
        # a release's entry has no time of its own: the one before it, as it is read
        ms = int(fields.pop("at", ms))
        seq[ms] = seq.get(ms, -1) + 1
        client.xadd(ClaimKeys("fenced", target).runs, {**fields, "r": record}, id=f"{ms}-{seq[ms]}")


def test_an_idle_names_records_take_under_a_kilobyte(r: Any) -> None:
    claim = _one_run(r, "report:acme", task_id="0b3e5c52-6f6e-4a57-9d51-6b2a4f1f9d0e")
    keys = claim.keys
    assert r.type(keys.records) in (b"list", "list")
    assert r.llen(keys.records) == 2  # started, finished
    assert not r.exists(keys.runs)  # nothing writes the stream any more
    assert r.memory_usage(keys.records, samples=0) < 1024
    # The same two entries in a stream, as earlier versions kept them: a listpack node
    # preallocated at its first entry.
    _as_stream(r, "report:acme", "as-stream")
    assert r.memory_usage(ClaimKeys("fenced", "as-stream").runs, samples=0) > 4 * 1024


def test_records_read_back_newest_first_as_from_the_stream(r: Any) -> None:
    name = "feed:weather"
    first = _one_run(r, name, task_id="t-1")
    holder = Claim(r, name, ttl=10, heartbeat=False, records=True, task_id="t-2")
    assert holder.acquire()
    assert not Claim(r, name, ttl=10, heartbeat=False, records=True, task_id="t-3").acquire()
    assert holder.release("failed")
    stuck = Claim(r, name, ttl=10, heartbeat=False, records=True, task_id="t-4")
    assert stuck.acquire()
    assert force_release(r, name, reason="holder gone", by="ops") is not None
    runs = records.history(r, name)
    # Newest first by when each began: the skip came while the failed run held the name.
    assert [run.outcome for run in runs] == ["released", "skipped", "failed", "ok"]
    released, skipped, failed, ok = runs
    assert released.fence == stuck.fence and released.task_id == "t-4"
    assert released.reason == "holder gone"
    assert failed.fence == holder.fence and failed.task_id == "t-2"
    assert skipped.task_id == "t-3" and skipped.holder and "t-2" in skipped.holder
    assert ok.fence == first.fence and ok.task_id == "t-1"
    assert ok.started is not None and ok.finished is not None and ok.duration is not None
    assert ok.started <= ok.finished <= (failed.started or 0) <= (released.finished or 0)
    # Read from a stream holding the same entries, the runs are the very same; but for
    # when a release ended them: the list times that by its run's start and duration
    # (within what Redis saw next), the stream by the entry's id.
    _as_stream(r, name, "copy")
    copied = records.history(r, "copy")
    assert _untimed(_shown(copied)) == _untimed(_shown([replace(run, name="copy") for run in runs]))
    assert (failed.started or 0) <= (failed.finished or 0) <= (released.finished or 0)
    assert _shown(show_claim(r, name).runs) == _shown(runs)


def test_the_list_is_cut_to_max_records_and_expires_when_idle(r: Any) -> None:
    for _ in range(4):
        claim = _one_run(r, "capped", max_records=3, idle_ttl=3600)
    assert r.llen(claim.keys.records) == 4  # 3, and an eighth more (at least one)
    claim = _one_run(r, "capped", max_records=3, idle_ttl=3600)
    assert r.llen(claim.keys.records) == 4  # cut back to 3 by the push that made it 5
    assert 0 < r.pttl(claim.keys.records) <= 3600 * 1000
    assert [run.outcome for run in records.history(r, "capped")] == ["ok", "ok"]


def test_records_an_earlier_version_kept_in_a_stream_are_still_shown(r: Any) -> None:
    name = "upgrade:job"
    keys = ClaimKeys("fenced", name)
    now_ms = int(r.time()[0]) * 1000
    # As an earlier version wrote a run: its started and finished entries in the stream.
    token = "0123456789abcdef0123456789abcdef:oldhost:7:t-old"
    started = json.dumps({"task_id": "t-old", "host": "oldhost", "pid": 7, "at": 1.0})
    ended = json.dumps({"task_id": "t-old", "host": "oldhost", "pid": 7, "duration": 2.0})
    r.xadd(keys.runs, {"event": "started", "token": token, "fence": "5", "r": started},
           id=f"{now_ms - 60_000}-0")  # fmt: skip
    r.xadd(keys.runs, {"event": "finished", "token": token, "fence": "5", "outcome": "ok",
                       "r": ended}, id=f"{now_ms - 58_000}-0")  # fmt: skip
    assert [run.task_id for run in records.history(r, name)] == ["t-old"]
    assert [run.name for run in load_records_names(r)] == [name]
    new = Claim(r, name, ttl=10, heartbeat=False, records=True, task_id="t-new")
    assert new.acquire()
    # Newest first, across both: the run holding the name now, then the old one.
    runs = records.history(r, name)
    assert [(run.task_id, run.outcome) for run in runs] == [("t-new", "running"), ("t-old", "ok")]
    assert runs[1].fence == 5 and runs[1].duration == 2.0 and runs[1].worker == "oldhost:7"
    assert [run.task_id for run in show_claim(r, name).runs] == ["t-new", "t-old"]
    [listed] = list_claims(r)
    assert listed.name == name and listed.last_outcome == "ok"
    assert new.release()
    assert [run.outcome for run in records.history(r, name)] == ["ok", "ok"]
    assert r.type(keys.runs) in (b"stream", "stream")  # read, never written


def load_records_names(client: Any) -> list[RunRecord]:
    """The names the doctor's naming checks find records of, as runs."""
    return [RunRecord(name=rec["name"], outcome=rec["outcome"]) for rec in load_records(client)]


@pytest.mark.parametrize("part", ["records", "runs"])
def test_a_records_key_of_another_type_is_unreadable_and_named(r: Any, part: str) -> None:
    _one_run(r, "odd")
    key = getattr(ClaimKeys("fenced", "odd"), part)
    r.delete(key)
    r.hset(key, "a", "b")
    [bad] = [run for run in records.history(r, "odd") if run.outcome == records.UNREADABLE]
    assert bad.unreadable and bad.unreadable.startswith(f"{key}: WRONGTYPE")
    assert any(run.unreadable and key in run.unreadable for run in show_claim(r, "odd").runs)
    if part == "runs":
        # Nothing writes the old stream: a claim goes on, and its runs are recorded.
        _one_run(r, "odd")
        assert "ok" in [run.outcome for run in records.history(r, "odd")]


def _listed(fields: dict[str, Any], record: dict[str, Any]) -> str:
    """One entry of the records list, as the scripts push it."""
    return json.dumps(fields) + "\n" + json.dumps(record)


def test_a_release_entry_without_a_time_is_placed_by_its_neighbours() -> None:
    """A release's entry carries no time: its run ends at its start plus the holder's
    duration, never after the entry pushed above it; one whose start is outside the
    window takes the time of the entry above it (newest first, as LRANGE reads)."""
    tok_a, tok_b = "a" * 32 + ":h:1:", "b" * 32 + ":h:1:"
    entries = [
        _listed({"event": "started", "token": tok_b, "fence": "7", "at": "1000900"}, {}),
        _listed(
            {"event": "finished", "token": "aaaaaaaa", "fence": "6", "outcome": "ok"},
            {"duration": 5.0},
        ),
        _listed({"event": "skipped", "reason": "already running", "at": "1000200"}, {}),
        _listed({"event": "started", "token": tok_a, "fence": "6", "at": "1000100"}, {}),
        _listed(
            {"event": "finished", "token": "cccccccc", "fence": "5", "outcome": "failed"},
            {"duration": 1.0},
        ),
    ]
    runs = records.from_entries("job", entries)
    by_fence = {run.fence: run for run in runs}
    assert [run.outcome for run in runs] == ["running", "skipped", "ok", "failed"]
    assert by_fence[6].started == 1000.1
    # start + 5 s would be 1005.1: bounded by the entry pushed above it (1000.9)
    assert by_fence[6].finished == 1000.9 and by_fence[6].duration == 5.0
    # the oldest in the window: the time of the entry above it
    assert by_fence[5].finished == 1000.1 and by_fence[5].unreadable is None


@pytest.mark.parametrize(
    "task_id", ["0b3e5c52-6f6e-4a57-9d51-6b2a4f1f9d0e", 'a "quoted" \\ task/id\nwith é, \x01']
)
def test_each_entry_head_is_json_whatever_the_token_holds(r: Any, task_id: str) -> None:
    # A plain token's entry head is written out by the script; one JSON must escape is
    # encoded: both read back as the same fields.
    claim = _one_run(r, f"head:{len(task_id)}", task_id=task_id)
    finished, started = (
        json.loads(as_text(raw).split("\n", 1)[0]) for raw in r.lrange(claim.keys.records, 0, -1)
    )
    assert set(started) == {"at", "event", "token", "fence"}
    assert started["event"] == "started" and started["token"] == claim.token
    assert started["fence"] == str(claim.fence) and started["at"] == started["fence"][:-3]
    assert finished == {
        "event": "finished",
        "token": (claim.token or "")[:8],
        "fence": str(claim.fence),
        "outcome": "ok",
    }
    (run,) = records.history(r, claim.name)
    assert (run.outcome, run.task_id, run.fence) == ("ok", task_id, claim.fence)


def _head(event: str, **fields: str) -> str:
    """A list entry of ``event`` as the scripts write its fields (cjson: no spaces)."""
    return json.dumps({"at": "1000100", "event": event, **fields}, separators=(",", ":")) + "\n{}"


#: The newest entries of a name's records (newest first), and the skips in a row shown
#: beside a count of 3 the skip counter holds.
STREAKS = {
    "a start is the newest entry": (["started"], 0),
    "a skip is newer than the start": (["skipped", "started"], 3),
    "ends and a release above the start": (["finished", "released", "started", "skipped"], 0),
    "a start deeper than the entries read": (["finished"] * STREAK_ENTRIES + ["started"], 3),
    "no records": ([], 3),
    "an entry fenced never wrote above the start": (["junk", "started"], 0),
}


@pytest.mark.parametrize("case", list(STREAKS))
@pytest.mark.parametrize("window", [False, True], ids=["busy", "cooldown"])
def test_the_skips_shown_are_those_the_next_skip_counts_on(r: Any, case: str, window: bool) -> None:
    """What the readers show and what the scripts count the next skip on are one rule:
    the next skip's count is the count shown before it, plus one."""
    events, expected = STREAKS[case]
    keys = ClaimKeys.of(f"streak:{list(STREAKS).index(case)}")
    for event in reversed(events):  # oldest first, as LPUSH stacks them
        r.lpush(keys.records, "junk" if event == "junk" else _head(event, token="t"))
    r.set(keys.skips, "3")
    if window:  # a run ended ok within the window: the skip is "ran recently"
        r.set(keys.cooldown, "1", px=60_000)
    else:
        r.set(keys.lock, "abcd:host:1:", px=60_000)
    assert records.consecutive_skips(r, keys.name) == expected
    assert show_claim(r, keys.name).skips == expected
    assert [info.skips for info in list_claims(r) if info.name == keys.name] == [expected]
    claim = Claim(r, keys.name, ttl=10, heartbeat=False, records=True, cooldown=60 if window else 0)
    assert not claim.acquire()
    assert claim.skips == expected + 1
    assert records.consecutive_skips(r, keys.name) == expected + 1


def test_the_readers_read_as_many_records_as_the_scripts_count_skips_on() -> None:
    assert records.entries_for(0) >= STREAK_ENTRIES
    assert records.entries_for(LS_RUNS) >= STREAK_ENTRIES

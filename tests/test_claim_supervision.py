"""Claim features a task runner builds on: record extras, rerun requests, redeliveries
recognised by task id, and a supervisor's release of a dead holder's lease."""

from __future__ import annotations

import os
from typing import Any

from fenced import Claim, records
from fenced._inspect import force_release, list_claims, read_holder, show_claim
from fenced._lease import short_token
from fenced._scripts import as_text


def test_record_extra_rides_on_every_record(r: Any) -> None:
    extra = {"task": "maps.rebuild", "args": {"layer": "roads"}}
    a = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, records=True, record_extra=extra)
    b = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, records=True, record_extra=extra)
    assert a.acquire()
    assert not b.acquire()
    a.release()
    runs = records.history(r, "rebuild:roads")
    assert [run.outcome for run in runs] == ["skipped", "ok"]  # newest start first
    for run in runs:
        assert run.extra["task"] == "maps.rebuild"
        assert run.extra["args"] == {"layer": "roads"}


def test_rerun_requests_coalesce_and_go_to_the_holder(r: Any) -> None:
    holder = Claim(r, "sync:feed", ttl=5, heartbeat=False, records=True)
    assert holder.acquire()
    for _ in range(10):
        trigger = Claim(r, "sync:feed", ttl=5, heartbeat=False, records=True)
        assert trigger.acquire(request_rerun=True) is False
    assert trigger.rerun_requested == 1  # ten equal triggers: one rerun
    skips = [run for run in records.history(r, "sync:feed") if run.outcome == "skipped"]
    assert skips and all("rerun requested" in (run.reason or "") for run in skips)
    assert holder.release() is True
    assert holder.rerun_requested == 1  # the holder runs once more, whatever the count
    again = Claim(r, "sync:feed", ttl=5, heartbeat=False)
    assert again.acquire()
    assert again.release() is True
    assert again.rerun_requested == 0  # taken once only


def test_distinct_triggers_each_reach_the_holder_once(r: Any) -> None:
    holder = Claim(r, "rebuild:acme", ttl=5, heartbeat=False)
    assert holder.acquire()
    for layer in ("rivers", "rivers", "rails", "rivers", "roads"):
        assert not Claim(r, "rebuild:acme", ttl=5, heartbeat=False).acquire(
            request_rerun=f'[["acme","{layer}"],{{}}]'
        )
    assert holder.release() is True
    assert sorted(holder.rerun_triggers) == [
        '[["acme","rails"],{}]',
        '[["acme","rivers"],{}]',
        '[["acme","roads"],{}]',
    ]
    assert holder.rerun_requested == 3


def test_a_rerun_request_survives_a_holder_that_died(r: Any) -> None:
    a = Claim(r, "sync:feed", ttl=5, heartbeat=False)
    assert a.acquire()
    assert not Claim(r, "sync:feed", ttl=5, heartbeat=False).acquire(request_rerun=True)
    # The holder dies without releasing; a supervisor clears its lease.
    assert force_release(r, "sync:feed") is not None
    b = Claim(r, "sync:feed", ttl=5, heartbeat=False)
    assert b.acquire()
    assert b.release() is True
    assert b.rerun_requested == 1  # one run too many rather than a trigger lost


def test_own_task_id_is_a_redelivery_not_a_skip(r: Any) -> None:
    earlier = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, task_id="t-1", records=True)
    assert earlier.acquire()
    again = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, task_id="t-1", records=True)
    assert again.acquire(request_rerun=True) is False
    assert again.holder is not None and again.holder.task_id == "t-1"
    assert again.skips == 0 and again.rerun_requested == 0
    assert records.consecutive_skips(r, "rebuild:roads") == 0
    other = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, task_id="t-2", records=True)
    assert other.acquire() is False
    assert other.skips == 1
    # A task id that merely ends like ours is somebody else.
    tail = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, task_id="1", records=True)
    assert tail.acquire() is False
    assert tail.skips == 2
    earlier.release()


def _skip(r: Any, name: str) -> int:
    """One call that finds the name busy: the count of skips its acquire answered."""
    other = Claim(r, name, ttl=30, heartbeat=False, records=True)
    assert not other.acquire()
    return other.skips


def _shown(r: Any, name: str) -> tuple[int, int | None, int]:
    """The name's skips in a row as each reader shows them: ``consecutive_skips``,
    ``fenced ls`` (None when it lists no holder) and ``fenced show``."""
    listed = [info.skips for info in list_claims(r) if info.name == name]
    shown = show_claim(r, name).skips
    return records.consecutive_skips(r, name), listed[0] if listed else None, shown


def test_skips_behind_a_holder_cleared_by_hand_are_not_counted_beside_the_next(
    r: Any,
) -> None:
    name = "sync:stale"
    stuck = Claim(r, name, ttl=30, heartbeat=False, records=True)
    assert stuck.acquire()
    assert [_skip(r, name) for _ in range(2)] == [1, 2]
    assert _shown(r, name) == (2, 2, 2)
    # Its process hangs; an operator clears its lease: no run started or ended ok since.
    assert force_release(r, name, reason="hung") is not None
    assert _shown(r, name) == (2, None, 2)
    fresh = Claim(r, name, ttl=30, heartbeat=False, records=True)
    assert fresh.acquire()
    assert _shown(r, name) == (0, 0, 0)  # work moves again: the old count is not its
    assert _skip(r, name) == 1
    # The hung process comes back and ends: lost, recorded between the new holder's skips.
    assert stuck.release() is False
    assert '"outcome":"lost"' in as_text(r.lindex(stuck.keys.records, 0))
    assert _shown(r, name) == (1, 1, 1)
    assert _skip(r, name) == 2
    assert _shown(r, name) == (2, 2, 2)
    assert fresh.release() is True  # an ok run resets the count, as it always did
    assert _shown(r, name) == (0, None, 0)
    assert r.get(fresh.keys.skips) is None


def test_skips_behind_one_stuck_holder_count_on_past_the_alert_threshold(r: Any) -> None:
    name = "sync:stuck"
    stuck = Claim(r, name, ttl=30, heartbeat=False, records=True, task_id="t-1")
    assert stuck.acquire()
    counts = [_skip(r, name) for _ in range(6)]
    # A redelivery of the holder's own task is no skip, and no start: the count goes on.
    again = Claim(r, name, ttl=30, heartbeat=False, records=True, task_id="t-1")
    assert not again.acquire() and again.skips == 6
    counts += [_skip(r, name) for _ in range(6)]
    assert counts == list(range(1, 13))  # claim_alert_after_skips=5 fires at 5 and 10
    assert _shown(r, name) == (12, 12, 12)
    stuck.release()


def test_force_release_matches_task_id_and_process(r: Any) -> None:
    a = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, task_id="t:1", records=True)
    assert a.acquire()
    assert force_release(r, "rebuild:roads", task_id="t:2") is None
    assert force_release(r, "rebuild:roads", task_id="t:1", pid=os.getpid() + 1) is None
    elsewhere = force_release(r, "rebuild:roads", task_id="t:1", host="other", pid=os.getpid())
    assert elsewhere is None
    assert read_holder(r, "rebuild:roads") is not None
    cleared = force_release(
        r, "rebuild:roads", task_id="t:1", pid=os.getpid(), outcome="aborted", reason="killed"
    )
    assert cleared is not None and cleared.token == short_token(a.token)
    assert read_holder(r, "rebuild:roads") is None
    run = records.last(r, "rebuild:roads")
    assert run is not None
    assert run.outcome == "aborted" and run.reason == "killed"
    assert run.task_id == "t:1" and run.fence == a.fence
    assert a.release() is False  # the owner's late release finds nothing of its own


def test_force_release_by_an_operator_is_recorded_as_released(r: Any) -> None:
    a = Claim(r, "rebuild:roads", ttl=5, heartbeat=False, records=True)
    assert a.acquire()
    assert force_release(r, "rebuild:roads", reason="stuck") is not None
    assert [run.outcome for run in records.history(r, "rebuild:roads")][:1] == ["released"]

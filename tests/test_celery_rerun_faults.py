"""A rerun trigger outlives the holder that took it (``claim_on_busy="rerun"``).

The holder's release takes the triggers that arrived during its run, then the worker
publishes one rerun per call. A worker killed between the two (here: SIGKILL of the
whole worker as it publishes, from a ``before_task_publish`` receiver) must not lose the
trigger: it stays in Redis until its rerun is published, and the name's next release
publishes it. Killed just after the publish, the rerun is published a second time under
the same task id, and that copy does not run again.

The holder's own message comes back too, and is ignored as completed: with the name
free, it takes the claim and its release finds the trigger; with the name held (the
dying worker's other child had started the rerun, whose lease waits out its ttl), it
is ignored with no record of its own, and the rerun's release finds the trigger.
"""

from __future__ import annotations

from typing import Any

import pytest
from redis.cluster import RedisCluster

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key, notes
from fenced import Claim, records
from fenced._inspect import read_holder
from fenced.testing import RedisServer

DUPLICATE = "duplicate delivery of a completed task"


@pytest.mark.parametrize(
    ("when", "started"),
    [
        pytest.param("before", False, id="before"),
        pytest.param("after", False, id="after"),
        # As when the victim's other child started the rerun as the worker died: its
        # lease still holds the name when the holder's message comes back.
        pytest.param("after", True, id="after-rerun-started"),
    ],
)
def test_a_rerun_survives_its_holder_dying_as_it_publishes(
    when: str, started: bool, redis_server: RedisServer
) -> None:
    services = Services.on(redis_server, ttl=8.0)
    client = services.client()
    obs, locks = services.obs(), services.locks()
    k = key()
    name = f"gated:{k}"
    # Spelled out, not read from fenced: where the triggers wait is part of what is tested.
    rerun, sending = f"fenced:{{{name}}}:rerun", f"fenced:{{{name}}}:rerun:sending"

    def runs(layer: str) -> list[dict[str, Any]]:
        return [r for r in notes(obs, f"runs:{k}") if r.get("layer") == layer]

    try:
        with Worker(services, concurrency=2, name="victim") as victim:
            holder = client.send_task("t.rerun_layers", args=(k, "roads"), queue=services.queue)
            wait_for("the holder's run", lambda: runs("roads"))
            skipped = client.send_task("t.rerun_layers", args=(k, "rivers"), queue=services.queue)
            assert skipped.get(timeout=WAIT)["status"] == "skipped"
            obs.set(f"die:{when}:{k}", 1)
            for n in range(3):  # the holder ends; its rerun will not wait either
                obs.set(f"gate:{k}:{n}", 1)
            assert victim.proc is not None
            proc = victim.proc
            wait_for("the worker to die publishing the rerun", lambda: proc.poll() is not None)
        assert obs.get(f"die:{when}:{k}") is None  # it died where the test asked
        # The holder released (ok) before it died, and took the trigger with it. (After
        # the publish, the victim's other child may have started the rerun as the group
        # died: its lease then waits out its ttl.)
        left = read_holder(locks, name)
        assert left is None or (when == "after" and left.task_id != holder.id), left
        assert [r.outcome for r in records.history(locks, name) if r.task_id == holder.id] == ["ok"]
        assert locks.smembers(rerun) or locks.scard(sending), "the trigger is gone from Redis"
        [died] = notes(obs, f"died:{k}")
        if started and left is None and died["task_id"] in services.unacked():
            # The state a start of the rerun leaves: its message held unacknowledged (the
            # broker brings it back), its lease on the name. (Its message lost, the
            # trigger waits for the name's next release: a lease that expires is none.)
            lease = Claim(locks, name, ttl=services.ttl, heartbeat=False, task_id=died["task_id"])
            assert lease.acquire()
            left = read_holder(locks, name)
        # Redis brings the holder's unacknowledged message back after the visibility
        # timeout; it is ignored as completed (a release finds the trigger). One process:
        # the holder's message never finds the name held by a live rerun.
        with Worker(services, concurrency=1, visibility=4, name="successor"):
            wait_for("the rerun", lambda: runs("rivers"))
            wait_for("the rerun to end", lambda: len(notes(obs, f"ends:{k}")) == 2)
            rerun_id = runs("rivers")[0]["task_id"]

            def ignored(task_id: str) -> bool:
                # The victim died inside the holder's run, before its postrun: this one
                # is the redelivered message's.
                return any(
                    n["task_id"] == task_id and n["state"] == "IGNORED"
                    for n in notes(obs, "signal:postrun")
                )

            wait_for("the holder's message to come back", lambda: ignored(holder.id))
            if left is None:  # it took the free name: its release recorded why it ended
                why = [r.reason for r in records.history(locks, name) if r.task_id == holder.id]
                assert DUPLICATE in why, why
            wait_for("the trigger to be cleared", lambda: locks.scard(sending) == 0)
        if when == "after":
            # Published by the victim, and again by the name's next release under the same
            # task id: whichever copy runs first, the other finds its done marker. (The
            # victim's copy may also be lost with it: a Redis broker drops a message its
            # consumer had popped but not yet recorded as unacknowledged.)
            assert died["task_id"] == rerun_id
        # Ran to the end once (a start the dying victim cut short does not end).
        assert [n["task_id"] for n in notes(obs, f"ends:{k}")].count(rerun_id) == 1
        assert len(runs("rivers")) in ((1,) if left is None else (1, 2))
        assert len(runs("roads")) == 1
        assert not locks.exists(rerun)
    finally:
        client.close()


def _holder(r: Any, name: str) -> Claim:
    claim = Claim(r, name, ttl=5, heartbeat=False, records=True)
    claim.keeps_reruns = True
    assert claim.acquire()
    return claim


def test_a_release_keeps_its_triggers_until_they_are_sent(r: Any) -> None:
    from fenced._scripts import RERUN_SENT

    first = _holder(r, "kept")
    for trigger in ("a", "b"):
        assert not Claim(r, "kept", ttl=5).acquire(request_rerun=trigger)
    assert first.token is not None
    # Its reply lost, the release is sent again: the same triggers, under the same fields.
    answer = first._store.release(first._release_call("ok", ""))
    assert first.release() is True
    assert sorted(first.rerun_triggers) == ["a", "b"]
    fields = dict(first.rerun_sending)
    assert sorted(answer[2]) == sorted([*fields, "a", "b"])
    assert all(f.startswith(first.token[:32] + ":") for f in fields)
    sending = first.keys.rerun_sending
    assert r.scard(sending) == 2 and not r.exists(first.keys.rerun)
    # Only "a" was sent before its holder died: the next release gets "b" back, with
    # its own new trigger, and "b" keeps its field (so its rerun keeps its task id).
    assert RERUN_SENT(r, [sending], [next(f for f, t in fields.items() if t == "a")]) == 1
    second = _holder(r, "kept")
    assert not Claim(r, "kept", ttl=5).acquire(request_rerun="c")
    assert second.release() is True
    again = dict(second.rerun_sending)
    assert sorted(again.values()) == ["b", "c"]
    assert {f for f, t in again.items() if t == "b"} == {f for f, t in fields.items() if t == "b"}
    # A plain claim still takes and clears them, and touches no sending set.
    plain = Claim(r, "kept", ttl=5, heartbeat=False)
    assert plain.acquire()
    assert not Claim(r, "kept", ttl=5).acquire(request_rerun="d")
    assert plain.release() is True
    assert plain.rerun_triggers == ["d"] and r.scard(sending) == 2
    # The sending key holding another type: taken as before (kept nowhere, no error).
    r.delete(sending)
    r.set(sending, "not a set")
    third = _holder(r, "kept")
    assert not Claim(r, "kept", ttl=5).acquire(request_rerun="e")
    assert third.release() is True
    assert third.rerun_sending == [("", "e")] and not r.exists(third.keys.rerun)


def test_kept_triggers_on_a_cluster(cluster_server: RedisServer) -> None:
    from fenced._scripts import RERUN_SENT

    # Every key RELEASE touches, the sending set too, is in the name's slot.
    r = RedisCluster(host="127.0.0.1", port=cluster_server.port, decode_responses=True)
    try:
        holder = _holder(r, "kept:cluster")
        assert not Claim(r, "kept:cluster", ttl=5).acquire(request_rerun="a")
        assert holder.release() is True
        assert [t for _f, t in holder.rerun_sending] == ["a"]
        assert r.scard(holder.keys.rerun_sending) == 1
        RERUN_SENT(r, [holder.keys.rerun_sending], [f for f, _t in holder.rerun_sending])
        assert not r.exists(holder.keys.rerun_sending)
    finally:
        r.close()

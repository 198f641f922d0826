"""fenced.celery.beat when its Redis misbehaves: a ``BEAT_DISPATCH`` reply lost after the
script ran (redis-py sends it again and gets the first answer: the tick is sent once),
and a Redis paused or killed under the leader (it leads on while its lease holds, then
steps down, stays up, and leads again once Redis is back).

Schedulers in this process on real redis-servers (through a real TCP proxy for the lost
reply), their wall clocks driven as in test_celery_beat.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from _wait import wait_for
from fenced import Claim
from fenced._lease import ClaimKeys
from fenced._scripts import BEAT_DISPATCH
from fenced.celery.beat import ALL_LIMIT, Scheduler, status, task_id
from fenced.testing import RedisServer, TcpProxy
from test_celery_beat import T0, Wall, _app


def _scripts_run(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def test_the_same_call_of_a_leader_gets_the_same_answer(server: RedisServer) -> None:
    client = server.client()
    keys = ClaimKeys.of("beat:x")

    def dispatch(claim: Claim, call: str, *triples: tuple[str, int, str]) -> list[Any]:
        args: list[Any] = [claim.token, str(claim.fence), "0", call]
        for triple in triples:
            args.extend(triple)
        return list(BEAT_DISPATCH(client, [keys.lock, keys.fence, keys.beat], args))

    with Claim(client, "beat:x", ttl=5, heartbeat=False) as claim:
        dispatch(claim, "c0", ("a", T0, "skip"), ("b", T0, "skip"))
        triples = [("a", T0 + 1000, "500"), ("a", T0 + 2000, "500"), ("b", T0, "500")]
        first = dispatch(claim, "c1", *triples)
        assert [int(x) for x in first[3:]] == [1, 1, 0]
        # The same call again (its reply was lost): the same answer, ticks included.
        assert dispatch(claim, "c1", *triples) == first
        stored = client.hget(keys.beat, "entry:a").decode()
        assert stored == f"{T0 + 2000}:{claim.fence}:pending"
        # Another call asking for the same due times: refused, as ever.
        assert [int(x) for x in dispatch(claim, "c2", *triples)[3:]] == [0, 0, 0]
    # A leader that lost its lease is not answered from what it was granted.
    assert dispatch(claim, "c1", *triples) == [0]


def test_a_lost_reply_of_the_dispatch_script_sends_the_tick_once(
    redis_server: RedisServer, sent: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = redis_server.client()
    direct.flushall()
    with TcpProxy(redis_server.port) as proxy:
        app = _app(redis_server, a={})
        # redis-py's own retry sends the script again on a new connection after 0.5 s.
        app.conf.update(
            fenced_redis_url=proxy.url,
            fenced_redis_options={"socket_timeout": 0.5, "retry": Retry(NoBackoff(), 2)},
        )
        wall = Wall(T0)
        sched = Scheduler(app)
        sched.wall = wall
        try:
            sched.tick()  # leads; the entry's cadence starts
            assert sched.leading
            dispatch = BEAT_DISPATCH
            lost: list[int] = []

            def reply_lost_once(client: Any, keys: Any, args: Any) -> Any:
                if not lost:
                    # The script lands and runs; its reply is held on this connection
                    # until the client gives up on it and sends the script again.
                    lost.append(_scripts_run(direct))
                    proxy.hold_replies()
                try:
                    return dispatch(client, keys, args)
                finally:
                    proxy.heal()

            monkeypatch.setattr("fenced.celery.beat.BEAT_DISPATCH", reply_lost_once)
            wall.ms = T0 + 60_010
            sched.tick()
            assert _scripts_run(direct) - lost[0] >= 2, "the script was not sent again"
            assert sched.leading
            assert sent == [task_id("unit", "a", T0 + 60_000)]
            entry = status(direct, "unit").entries["a"]
            assert (entry.due_ms, entry.state) == (T0 + 60_000, "sent")
            wall.ms = T0 + 60_500
            sched.tick()
            assert sent == [task_id("unit", "a", T0 + 60_000)]  # and only once
        finally:
            sched.close()


def test_a_grant_whose_reply_never_came_is_sent_by_the_same_leader(
    redis_server: RedisServer, sent: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    direct = redis_server.client()
    direct.flushall()
    wall = Wall(T0)
    sched = Scheduler(_app(redis_server, a={}))
    sched.wall = wall
    try:
        sched.tick()
        dispatch = BEAT_DISPATCH

        def ran_then_lost(client: Any, keys: Any, args: Any) -> Any:
            dispatch(client, keys, args)  # the script ran; every retry's reply was lost
            raise redis.TimeoutError("Timeout reading from socket")

        monkeypatch.setattr("fenced.celery.beat.BEAT_DISPATCH", ran_then_lost)
        wall.ms = T0 + 60_010
        sched.tick()
        assert sched.leading and sent == []
        assert status(direct, "unit").entries["a"].state == "pending"
        monkeypatch.setattr("fenced.celery.beat.BEAT_DISPATCH", dispatch)
        wall.ms = T0 + 60_100
        sched.tick()  # its own grant, not known to be sent: sent now, not by a next leader
        assert sent == [task_id("unit", "a", T0 + 60_000)]
        assert status(direct, "unit").entries["a"].state == "sent"
        sched.tick()
        assert sent == [task_id("unit", "a", T0 + 60_000)]
    finally:
        sched.close()


def test_a_leader_leads_on_while_its_lease_holds_then_stands_by(
    own_server: RedisServer, sent: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    app = _app(own_server, a={})
    app.conf.update(
        fenced_beat_ttl=1.5,
        fenced_redis_options={
            "socket_timeout": 0.25,
            "socket_connect_timeout": 0.25,
            "retry": Retry(NoBackoff(), 0),
        },
    )
    wall = Wall(T0)
    sched = Scheduler(app)
    sched.wall = wall
    caplog.set_level(logging.INFO, logger="fenced.beat")
    try:
        sched.tick()
        assert sched.leading and sched._claim is not None
        fence = sched._claim.fence
        # A Redis that answers nothing for less than a lease: the leader says it still
        # leads (no other beat can before its lease ends), and goes on once it answers.
        own_server.pause()
        try:
            wall.ms = T0 + 60_010
            sched.tick()
            assert sched.leading
        finally:
            own_server.resume()
        unreachable = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
        assert unreachable and "still leading" in unreachable[-1], unreachable
        assert "standing by" not in unreachable[-1]
        sched.tick()
        assert sched._claim is not None and sched._claim.fence == fence
        assert sent == [task_id("unit", "a", T0 + 60_000)]
        # Redis gone for longer than a lease: the leader steps down when its lease ends,
        # says so, and stays up as a stand-by.
        caplog.clear()
        own_server.kill()
        wait_for("the leader to step down", lambda: sched.tick() > 0 and not sched.leading, 20)
        said = [r.getMessage() for r in caplog.records]
        assert any("no longer leading" in m for m in said), said
        sched.tick()
        assert "standing by" in caplog.records[-1].getMessage()
        # Redis back (empty): a beat leads again, under a higher fence.
        own_server.start()
        wait_for("the beat to lead again", lambda: sched.tick() > 0 and sched.leading, 20)
        assert sched._claim is not None and (sched._claim.fence or 0) > (fence or 0)
    finally:
        sched.close()


def test_a_writer_of_the_beat_hash_replays_only_configured_entries(server: RedisServer) -> None:
    from celery import signals as celery_signals

    published: list[tuple[str, str, Any]] = []

    def on_publish(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
        published.append((headers["task"], headers["id"], tuple(body[0])))

    catch_up = {"fenced_catch_up": "all", "fenced_catch_up_window": 3600}
    app = _app(server, a=catch_up)
    app.conf.beat_schedule["a"].update(schedule=1.0, args=(1, 2))
    wall = Wall(T0)
    sched = Scheduler(app)
    sched.wall = wall
    celery_signals.after_task_publish.connect(on_publish, weak=False)
    try:
        sched.tick()  # leads; the entry's cadence starts at T0
        client = server.client()
        key = ClaimKeys.of("beat:unit").beat
        # A writer sets the entry's last due time back ~33 min, and adds entries of its own.
        client.hset(key, "entry:a", f"{T0 - 2_000_000}:1:sent")
        client.hset(key, "entry:evil", f"{T0 - 2_000_000}:1:pending")
        client.hset(key, "entry:other", f"{T0 - 2_000_000}:1:sent")
        wall.ms = T0 + 10
        sched.tick()
        assert len(published) == ALL_LIMIT  # at most 1,000 runs for the tick
        assert {(task, args) for task, _tid, args in published} == {("unit.tick", (1, 2))}
        assert all(tid.startswith("fenced-beat:unit:a:") for _task, tid, _args in published)
        assert published[-1][1] == task_id("unit", "a", T0)
    finally:
        celery_signals.after_task_publish.disconnect(on_publish)
        sched.close()

"""The Celery integration against someone who can write the claims' Redis, read the
workers' configuration dumps, or reach a worker over the network.

- rerun triggers: only ``claim_on_busy="rerun"`` takes them; with a secret key only
  signed ones whose call names the holder's claim run, and a hostile one never turns a
  run whose body succeeded into a failure;
- ``celery inspect conf`` and ``celery report`` show ``fenced_redis_url`` without its
  password;
- the enqueue marker's value is never handed back as a task id unless it is one, nor
  logged raw;
- a worker's ``/metrics`` listens on loopback unless ``fenced_metrics_address`` says.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery

from _wait import wait_for
from celery_harness import ROOT, WAIT, Services, Worker, key, notes
from fenced import ConfigError, records
from fenced._lease import ClaimKeys
from fenced.celery import ClaimedTask, metrics
from fenced.testing import RedisServer, free_port

SECRET = "0123456789abcdef-test-secret-key"
PASSWORD = "Pw-in-the-url-7f3a9c"
DEEP = "[" * 100_000 + "]" * 100_000


def body(task: str, call: str, kind: str = "r") -> str:
    """What a trigger stores: its kind (r: rerun, d: debounced call), its task, its call."""
    return f"{kind}:{len(task)}:{task}{call}"


def sign(name: str, call: str, secret: str = SECRET, task: str = "t.rerun", kind: str = "r") -> str:
    """A trigger of ``task`` as a caller holding ``secret`` writes it (the format,
    spelled out)."""
    k = hmac.new(secret.encode(), b"fenced rerun trigger v1", hashlib.sha256).digest()
    data, text = name.encode(), body(task, call, kind)
    mac = hmac.new(k, len(data).to_bytes(8, "big") + data + text.encode(), hashlib.sha256)
    return f"m2:{mac.hexdigest()}:{text}"


def sign_v1(name: str, call: str) -> str:
    """A trigger as fenced before tasks were signed wrote it: no task, no kind."""
    k = hmac.new(SECRET.encode(), b"fenced rerun trigger v1", hashlib.sha256).digest()
    data = name.encode()
    mac = hmac.new(k, len(data).to_bytes(8, "big") + data + call.encode(), hashlib.sha256)
    return f"m1:{mac.hexdigest()}:{call}"


def call(*args: Any, **kwargs: Any) -> str:
    return json.dumps([list(args), kwargs], sort_keys=True, separators=(",", ":"))


@dataclass
class Sec:
    services: Services
    worker: Worker
    client: Celery
    obs: redis.Redis
    locks: redis.Redis
    env: dict[str, str]

    def send(self, task: str, *args: Any) -> Any:
        return self.client.send_task(task, args=args, queue=self.services.queue)

    def runs(self, k: str) -> list[dict[str, Any]]:
        return notes(self.obs, f"runs:{k}")

    def open_gate(self, k: str, n: int) -> None:
        self.obs.set(f"gate:{k}:{n}", 1)

    def history(self, name: str) -> list[records.RunRecord]:
        return records.history(self.locks, name, limit=50)


@pytest.fixture(scope="module")
def sec(redis_server: RedisServer) -> Iterator[Sec]:
    # The claims' Redis wants a password, given in the URL as operators do.
    redis_server.client().execute_command(
        "ACL", "SETUSER", "fencer", "on", f">{PASSWORD}", "~*", "&*", "+@all"
    )
    lock_url = redis_server.url.rsplit("/", 1)[0].replace("redis://", f"redis://fencer:{PASSWORD}@")
    services = Services.on(redis_server, lock_url=f"{lock_url}/2")
    client = services.client()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FENCED_TEST_SECRET_KEY", SECRET)
        with Worker(services, app="tests.celery_security_app", name="sec") as worker:
            env = dict(os.environ)
            yield Sec(services, worker, client, services.obs(), services.locks(), env)
    client.close()


# -- rerun triggers ------------------------------------------------------------------------


def test_a_task_that_asks_for_no_reruns_leaves_planted_triggers_alone(sec: Sec) -> None:
    k = key()
    rerun = ClaimKeys("fenced", f"gated:{k}").rerun
    planted = sign(f"gated:{k}", call(k))  # even one signed with the app's key
    sec.locks.sadd(rerun, planted, call(k))
    first = sec.send("t.gated", k)  # claim_on_busy="skip"
    wait_for("the run", lambda: sec.runs(k))
    sec.open_gate(k, 0)
    assert first.get(timeout=WAIT)["status"] == "ok"
    # Not taken at release: no rerun was sent for them.
    assert sec.locks.smembers(rerun) == {planted, call(k)}
    assert "asked for another run" not in sec.worker.log()


def test_only_signed_triggers_naming_the_claim_run_and_none_fails_the_run(sec: Sec) -> None:
    k, other = key(), key()
    name = f"gated:{k}"
    first = sec.send("t.rerun_layers", k, "roads")
    wait_for("the first run", lambda: sec.runs(k))
    task = "t.rerun_layers"
    planted = [
        call(k, "unsigned"),  # no signature
        "t2:" + body(task, call(k, "unsigned")),  # no signature, in today's format
        "m2:" + "0" * 64 + ":" + body(task, call(k, "forged")),  # a made-up one
        sign(name, call(other, "elsewhere"), task=task),  # its call names another claim
        sign(f"gated:{other}", call(k, "replayed"), task=task),  # signed for another name
        sign(name, call(k, "wrong key"), secret="another-secret-key-0123456789", task=task),
        sign(name, DEEP, task=task),  # signed, 100,000 deep: refused before it is parsed
        sign(name, "not json", task=task),
        sign(name, call(k, "debounced"), task=task, kind="d"),  # a burst's call, replayed
        sign_v1(name, call(k, "older")),  # an older fenced's: names no task
    ]
    sec.locks.sadd(ClaimKeys("fenced", name).rerun, *planted)
    # A genuine trigger, written by a skipped call of a worker that has the key.
    assert sec.send("t.rerun_layers", k, "rivers").get(timeout=WAIT)["status"] == "skipped"
    sec.open_gate(k, 0)
    assert first.get(timeout=WAIT)["status"] == "ok"
    wait_for("the genuine rerun", lambda: sec.runs(k)[1:])
    sec.open_gate(k, 1)
    wait_for("the rerun to end", lambda: len(notes(sec.obs, f"ends:{k}")) == 2)
    # Every planted trigger was dropped as the first run released, before the genuine
    # rerun was sent: no other run can follow.
    assert [r["layer"] for r in sec.runs(k)] == ["roads", "rivers"]
    log = sec.worker.log()
    assert log.count(f"dropped a rerun trigger of claim {name!r}") == len(planted)
    assert f"ran while a trigger asked for another run of {name!r}" in log
    records = [r for r in sec.history(name) if r.outcome != "skipped"]
    assert [r.outcome for r in records] == ["ok", "ok"]


def test_a_rerun_asked_for_by_another_task_on_the_name_runs_as_that_task(sec: Sec) -> None:
    """t.rerun and t.rerun_other share their names (one resource): a call of one,
    skipped while the other runs, is sent after it as its own task, never as the
    holder's."""
    k = key()
    name = f"gated:{k}"
    rerun = ClaimKeys("fenced", name).rerun
    first = sec.send("t.rerun", k)
    wait_for("the first run", lambda: sec.runs(k))
    assert sec.send("t.rerun_other", k).get(timeout=WAIT)["status"] == "skipped"
    sec.open_gate(k, 0)
    assert first.get(timeout=WAIT)["status"] == "ok"
    # t.rerun's release sends the other's call as t.rerun_other.
    wait_for("the rerun of t.rerun_other", lambda: sec.runs(k)[1:])
    sec.open_gate(k, 1)
    wait_for("the rerun to end", lambda: len(notes(sec.obs, f"ends:{k}")) == 2)
    assert [r.get("by") for r in sec.runs(k)] == [None, "t.rerun_other"]
    assert sec.locks.scard(rerun) == 0


def test_a_rerun_of_a_task_this_worker_does_not_know_is_left_for_it(sec: Sec) -> None:
    """A valid trigger of a task sharing the name that the releasing worker does not
    have is put back for that task's own release, never sent as the holder's task."""
    k = key()
    name = f"gated:{k}"
    rerun = ClaimKeys("fenced", name).rerun
    first = sec.send("t.rerun", k)
    wait_for("the first run", lambda: sec.runs(k))
    stranger = sign(name, call(k), task="t.elsewhere")
    sec.locks.sadd(rerun, stranger)
    sec.open_gate(k, 0)
    assert first.get(timeout=WAIT)["status"] == "ok"
    wait_for("the call left for t.elsewhere", lambda: sec.locks.smembers(rerun) == {stranger})
    time.sleep(1.0)
    assert len(sec.runs(k)) == 1, "another task's call was sent as t.rerun"


def test_a_deeply_nested_trigger_does_not_fail_a_run_that_succeeded(sec: Sec) -> None:
    k = key()
    name = f"gated:{k}"
    result = sec.send("t.rerun", k)
    wait_for("the run", lambda: sec.runs(k))
    sec.locks.sadd(ClaimKeys("fenced", name).rerun, DEEP, sign(name, DEEP), sign(name, call(k)))
    sec.open_gate(k, 0)
    assert result.get(timeout=WAIT)["status"] == "ok"
    assert result.status == "SUCCESS"
    # The signed trigger naming the claim is the one rerun.
    wait_for("the rerun", lambda: sec.runs(k)[1:])
    sec.open_gate(k, 1)
    wait_for("the rerun to end", lambda: len(notes(sec.obs, f"ends:{k}")) == 2)


def test_without_a_key_triggers_are_checked_for_their_name_and_shape(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("FENCED_SECRET_KEY", raising=False)
    app = Celery("fenced_unsigned", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = redis_server.url
    ran: list[tuple[str, str]] = []

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="job:{x}", claim_on_busy="rerun")
    def job(self: ClaimedTask, x: str, layer: str) -> str:
        ran.append((x, layer))
        return "done"

    x = key()
    rerun = ClaimKeys("fenced", f"job:{x}").rerun
    mine = [f"t2:{body(job.name, c)}" for c in (call(x, "same name"), call(key(), "other"), "*")]
    redis_server.client().sadd(rerun, *mine, DEEP, "[[1", call(x, "older fenced"))
    before = dict(metrics)
    with caplog.at_level(logging.WARNING, logger="fenced.celery"):
        result = job.apply((x, "roads"))
    assert result.successful(), result.traceback
    assert ran == [(x, "roads")]
    assert metrics["reruns_dropped"] - before.get("reruns_dropped", 0) == 4
    # Sent (to the memory broker): the same-name call, and "*" (the holder's own call).
    assert metrics["reruns"] - before.get("reruns", 0) == 2
    assert "are not signed" in caplog.text


def test_triggers_are_bounded_before_they_are_parsed() -> None:
    from fenced.celery import _rerun

    k = _rerun.rerun_key(SECRET)
    assert k is not None
    # A signed trigger is the format sign() spells out, and reads back as its call.
    encoded = _rerun.encode(("a",), {"n": 1}, "job:a", k, "t.rerun")
    assert encoded == sign("job:a", call("a", n=1))
    assert _rerun.decode(encoded, "job:a", k) == ("t.rerun", (("a",), {"n": 1}))
    # Brackets inside strings are text, not depth; unbalanced or deep ones are refused.
    text = call("[" * 200 + '\\"', "{")
    assert _rerun.decode(sign("job:a", text), "job:a", k)[1] == (("[" * 200 + '\\"', "{"), {})
    for bad in (DEEP, "]]" + "[[" * 40, "x" * (_rerun.MAX_BYTES + 1)):
        with pytest.raises(_rerun.Refused):
            _rerun.decode(sign("job:a", bad), "job:a", k)
    # What JSON cannot carry, or more than a trigger may hold: the holder's own call.
    assert _rerun.call_text((object(),), {}) == _rerun.OWN
    assert _rerun.call_text(("x" * _rerun.MAX_BYTES,), {}) == _rerun.OWN
    assert _rerun.call_text(([[[[]]]] * 2,) * 20, {}) != _rerun.OWN
    with pytest.raises(ConfigError, match="at least 16"):
        _rerun.rerun_key("short")


# -- the Redis password in Celery's configuration dumps ------------------------------------


def test_inspect_conf_and_report_do_not_show_the_lock_password(sec: Sec) -> None:
    replies = sec.client.control.inspect(timeout=10).conf()
    assert replies, "the worker answered inspect conf"
    (conf,) = [c for node, c in replies.items() if node.startswith("sec-")]
    assert "***@127.0.0.1" in conf["fenced_redis_url"]
    assert conf["fenced_secret_key"] != SECRET
    assert PASSWORD not in json.dumps(replies)
    assert SECRET not in json.dumps(replies)
    report = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.celery_security_app", "report"],
        cwd=ROOT,
        env={
            **sec.env,
            "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
            "FENCED_REDIS_URL": sec.services.lock_url,
            "FENCED_TEST_BROKER_URL": sec.services.broker_url,
            "FENCED_TEST_OBS_URL": sec.services.obs_url,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "fenced_redis_url" in report.stdout
    assert PASSWORD not in report.stdout + report.stderr


# -- the enqueue marker ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "planted", ["abc\nforged line", "\x1b]0;owned\x07", "x" * 300, "a b\u202e"]
)
def test_a_hostile_enqueue_marker_is_not_a_task_id(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, planted: str
) -> None:
    app = Celery("fenced_marker", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = redis_server.url

    @app.task(
        shared=False, base=ClaimedTask, bind=True, claim="m:{x}", claim_enqueue="until_started"
    )
    def job(self: ClaimedTask, x: str) -> None:
        pass

    x = key()
    redis_server.client().set(ClaimKeys("fenced", f"m:{x}").queued, planted)
    with caplog.at_level(logging.INFO, logger="fenced.celery"):
        sent = job.apply_async((x,))
    assert sent.id != planted
    assert all(ord(c) >= 0x20 and c not in "\x7f\u202e" for c in caplog.text.replace("\n", ""))
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all("\n" not in m and "\x1b" not in m for m in lines)
    assert "not a task id" in caplog.text


# -- where /metrics listens -----------------------------------------------------------------


def _listening(port: int) -> set[str]:
    """The local addresses a TCP socket listens on at ``port`` (from /proc/net)."""
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            host, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(host)
            # /proc prints each 32-bit word in host order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add(socket.inet_ntop(family, raw))
    return found


@pytest.mark.parametrize("given", [None, "0.0.0.0"])
def test_worker_metrics_listen_on_loopback_unless_told(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, given: str | None
) -> None:
    port = free_port()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv("FENCED_METRICS", "1")
    monkeypatch.setenv("FENCED_METRICS_PORT", str(port))
    if given is None:
        monkeypatch.delenv("FENCED_METRICS_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("FENCED_METRICS_ADDRESS", given)
    services = Services.on(redis_server)
    with Worker(services, name="metrics-addr", pool="threads", concurrency=1) as worker:
        wait_for("the metrics server", lambda: "claim metrics served" in worker.log())
        assert _listening(port) == {given or "127.0.0.1"}


def test_the_metrics_address_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from fenced.celery._metrics import address

    monkeypatch.delenv("FENCED_METRICS_ADDRESS", raising=False)
    app = Celery("metrics-address", set_as_current=False)
    assert address(app) == "127.0.0.1"
    app.conf.fenced_metrics_address = "::1"
    assert address(app) == "::1"
    app.conf.fenced_metrics_address = "0.0.0.0; rm"
    with pytest.raises(ConfigError, match="not an address to listen on"):
        address(app)
    # A known setting: a task's options resolve with it given.
    app.conf.fenced_metrics_address = "127.0.0.1"
    app.conf.fenced_redis_url = "redis://127.0.0.1:1/0"

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="a:{x}")
    def job(self: ClaimedTask, x: str) -> None:
        pass

    assert job._options() is not None


def test_doctor_warns_of_unsigned_reruns(monkeypatch: pytest.MonkeyPatch) -> None:
    from fenced.doctor import check_celery

    monkeypatch.delenv("FENCED_SECRET_KEY", raising=False)
    app = Celery("doctor-reruns", set_as_current=False)
    app.conf.fenced_redis_url = "redis://127.0.0.1:1/0"

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="r:{x}", claim_on_busy="rerun")
    def again(self: ClaimedTask, x: str) -> None:
        pass

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="s:{x}")
    def once(self: ClaimedTask, x: str) -> None:
        pass

    found = [f for f in check_celery(app) if f.code == "celery.rerun-unsigned"]
    assert [(f.severity, f.subject) for f in found] == [("warning", again.name)]
    app.conf.fenced_secret_key = SECRET
    assert "celery.rerun-unsigned" not in {f.code for f in check_celery(app)}

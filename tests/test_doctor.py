"""The doctor against real misconfigured Redis servers and Celery apps built here."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from _wait import wait_for
from fenced import Claim, ConfigError, doctor, records
from fenced.celery import DEFAULTS, ClaimedTask, lock_redis
from fenced.doctor import (
    CONTENDED_OUTCOMES,
    Finding,
    Report,
    check_celery,
    check_naming,
    check_redis,
    format_text,
    load_records,
    lock_store_url,
    name_shape,
    render,
    run_doctor,
    version_findings,
)
from fenced.testing import RedisServer

QUIET = ("error", "warning")


def codes(found: list[Finding], *severities: str) -> set[str]:
    return {f.code for f in found if not severities or f.severity in severities}


def severity_of(found: list[Finding], code: str) -> str:
    matches = {f.severity for f in found if f.code == code}
    assert len(matches) == 1, (code, found)
    return matches.pop()


# -- Redis ------------------------------------------------------------------------------


def test_default_server_has_no_errors_or_warnings(own_server: RedisServer) -> None:
    found = check_redis(own_server.client())
    assert codes(found, *QUIET) == set()
    persistence = [f for f in found if f.code == "redis.persistence"]
    assert persistence and "keeps nothing across a restart" in persistence[0].what


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl"])
def test_evicting_policy_is_an_error(own_server: RedisServer, policy: str) -> None:
    client = own_server.client(decode_responses=True)
    client.config_set("maxmemory-policy", policy)
    found = check_redis(client)
    assert severity_of(found, "redis.maxmemory-policy") == "error"
    finding = next(f for f in found if f.code == "redis.maxmemory-policy")
    assert policy in finding.what
    assert "CONFIG SET maxmemory-policy noeviction" in finding.fix
    assert "redis.conf" in finding.fix
    if policy.startswith("volatile"):
        assert "TTL" in finding.why
    assert run_doctor(client, records=[]).exit_code == 1


def test_real_evictions_are_reported(own_server: RedisServer) -> None:
    client = own_server.client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", str(used + 512 * 1024))
    value = b"x" * 16384
    for i in range(2000):
        client.set(f"cache:{i}", value)
        if i % 50 == 0 and int(client.info("stats")["evicted_keys"]) > 0:
            break
    assert int(client.info("stats")["evicted_keys"]) > 0
    found = check_redis(client)
    assert severity_of(found, "redis.evicted-keys") == "warning"
    assert severity_of(found, "redis.maxmemory-policy") == "error"

    # The policy fixed, past evictions still deserve a look until stats are reset.
    client.config_set("maxmemory-policy", "noeviction")
    found = check_redis(client)
    assert "redis.maxmemory-policy" not in codes(found)
    assert severity_of(found, "redis.evicted-keys") == "warning"
    assert severity_of(found, "redis.maxmemory") == "info"
    client.config_resetstat()
    assert "redis.evicted-keys" not in codes(check_redis(client))


@pytest.fixture
def replica(own_server: RedisServer, redis_binary: str) -> Iterator[RedisServer]:
    srv = RedisServer(
        redis_binary, extra=["--replicaof", "127.0.0.1", str(own_server.port)]
    ).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_replica_is_an_error_and_master_notes_replication(
    own_server: RedisServer, replica: RedisServer
) -> None:
    master = own_server.client()
    wait_for("replica link", lambda: int(master.info("replication")["connected_slaves"]) >= 1)
    found = check_redis(replica.client())
    assert severity_of(found, "redis.replica") == "error"
    finding = next(f for f in found if f.code == "redis.replica")
    assert f"127.0.0.1:{own_server.port}" in finding.fix

    found = check_redis(master)
    assert severity_of(found, "redis.replication") == "info"
    assert "WAIT" in next(f for f in found if f.code == "redis.replication").fix
    assert codes(found, *QUIET) == set()


def test_cluster_mode_is_noted(cluster_server: RedisServer) -> None:
    found = check_redis(cluster_server.client())
    assert severity_of(found, "redis.cluster") == "info"
    assert "hash tag" in next(f for f in found if f.code == "redis.cluster").why


def test_clock_skew_beyond_the_margin_warns(own_server: RedisServer) -> None:
    client = own_server.client()
    found = check_redis(client, clock=lambda: time.time() - 5.0)
    assert severity_of(found, "redis.clock-skew") == "warning"
    assert "ahead of" in next(f for f in found if f.code == "redis.clock-skew").what
    assert "redis.clock-skew" not in codes(check_redis(client, clock=lambda: time.time() + 0.1))


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.8.24", {"redis.version"}),
        ("4.0.14", {"redis.version"}),
        ("5.0.0", set()),
        ("7.2.4", set()),
    ],
)
def test_version_floor(version: str, expected: set[str]) -> None:
    assert codes(version_findings(version)) == expected


def test_unreachable_redis_is_an_error(redis_binary: str) -> None:
    srv = RedisServer(redis_binary).start()
    client = srv.client(socket_timeout=1)
    srv.stop()
    report = run_doctor(client)
    assert report.codes("error") == {"redis.unreachable"}
    assert report.exit_code == 1


# -- Celery -----------------------------------------------------------------------------


def make_app(broker: str = "redis://127.0.0.1:6399/0", **conf: Any) -> Celery:
    app = Celery("t", broker=broker, set_as_current=False)
    app.conf.update(conf)
    return app


GOOD_CONF: dict[str, Any] = {
    "fenced_redis_url": "redis://127.0.0.1:6399/1",
    "result_backend": "redis://127.0.0.1:6399/2",
    "task_acks_late": True,
    "task_reject_on_worker_lost": True,
    "worker_prefetch_multiplier": 1,
    "worker_cancel_long_running_tasks_on_connection_loss": True,
    "broker_transport_options": {"visibility_timeout": 7200},
}


def good_app() -> Celery:
    app = make_app(**GOOD_CONF)

    @app.task(
        base=ClaimedTask,
        shared=False,
        name="t.rebuild",
        claim="rebuild:{a}",
        claim_ttl=60,
        time_limit=3600,
    )
    def rebuild(a: str) -> str:
        return a

    @app.task(shared=False, name="t.plain", time_limit=30)
    def plain() -> None:
        return None

    return app


def test_well_configured_app_has_no_errors_or_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    found = check_celery(good_app())
    assert codes(found, *QUIET) == set(), found


def test_misconfigured_app_gets_each_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = make_app(
        fenced_redis_url="redis://127.0.0.1:6399/1",
        broker_transport_options={"visibility_timeout": 300},
    )

    # No acks_late, and a time limit below its claim TTL.
    @app.task(
        base=ClaimedTask,
        shared=False,
        name="t.rebuild",
        claim="rebuild:{a}",
        claim_ttl=60,
        time_limit=30,
    )
    def rebuild(a: str) -> str:
        return a

    # A long acks_late task: its time limit outlasts the visibility timeout.
    @app.task(
        base=ClaimedTask,
        shared=False,
        name="t.tiles",
        claim="tiles:{a}",
        claim_ttl=60,
        acks_late=True,
        time_limit=900,
    )
    def tiles(a: str) -> str:
        return a

    found = check_celery(app)
    assert severity_of(found, "celery.acks-late") == "warning"
    assert "t.rebuild" in next(f for f in found if f.code == "celery.acks-late").what
    assert severity_of(found, "celery.time-limit") == "error"
    limit = next(f for f in found if f.code == "celery.time-limit")
    assert limit.subject == "t.rebuild" and "time_limit=" in limit.fix
    assert severity_of(found, "celery.visibility-timeout") == "error"
    vis = next(f for f in found if f.code == "celery.visibility-timeout")
    assert "t.tiles" in vis.what and "visibility_timeout" in vis.fix
    assert severity_of(found, "celery.prefetch-multiplier") == "warning"
    assert (
        "worker_prefetch_multiplier = 1"
        in next(f for f in found if f.code == "celery.prefetch-multiplier").fix
    )
    assert severity_of(found, "celery.reject-on-worker-lost") == "warning"
    assert severity_of(found, "celery.cancel-on-connection-loss") == "warning"
    report = run_doctor(app=app)
    assert report.exit_code == 1


def test_claim_ttls_argument_overrides_the_task_attribute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = good_app()
    assert "celery.time-limit" not in codes(check_celery(app))
    found = check_celery(app, {"t.rebuild": 3600})
    assert severity_of(found, "celery.time-limit") == "error"


def test_time_limit_from_app_config_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = make_app(**{**GOOD_CONF, "task_time_limit": 45})

    @app.task(base=ClaimedTask, shared=False, name="t.x", claim="x:{a}", claim_ttl=60)
    def x(a: str) -> str:
        return a

    assert severity_of(check_celery(app), "celery.time-limit") == "error"


def test_eta_beyond_visibility_timeout_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = good_app()
    assert "celery.visibility-timeout" not in codes(check_celery(app, longest_eta=3600))
    found = check_celery(app, longest_eta=86400)
    assert severity_of(found, "celery.visibility-timeout") == "error"
    assert "ETA" in next(f for f in found if f.code == "celery.visibility-timeout").what


def test_default_visibility_timeout_is_an_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    conf = {k: v for k, v in GOOD_CONF.items() if k != "broker_transport_options"}
    app = make_app(**conf)

    @app.task(
        base=ClaimedTask, shared=False, name="t.x", claim="x:{a}", claim_ttl=60, time_limit=5400
    )
    def x(a: str) -> str:
        return a

    found = check_celery(app)
    assert "3600 s" in next(f for f in found if f.code == "celery.visibility-timeout").what


def test_unbounded_acks_late_task_on_redis_broker_warns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = make_app(**GOOD_CONF)

    @app.task(base=ClaimedTask, shared=False, name="t.x", claim="x:{a}", claim_ttl=60)
    def x(a: str) -> str:
        return a

    assert severity_of(check_celery(app), "celery.unbounded-task") == "warning"
    # An AMQP broker has no visibility timeout to outrun.
    amqp = make_app("amqp://guest@127.0.0.1//", **GOOD_CONF)

    @amqp.task(base=ClaimedTask, shared=False, name="t.x", claim="x:{a}", claim_ttl=60)
    def y(a: str) -> str:
        return a

    assert codes(check_celery(amqp), *QUIET) == set()


def lock_store_app(broker: str = "redis://localhost:6399", **extra: Any) -> Celery:
    """A well configured app with one claimed task, minus its lock store unless given."""
    conf = {k: v for k, v in GOOD_CONF.items() if k != "fenced_redis_url"}
    app = make_app(broker, **{**conf, **extra})

    @app.task(base=ClaimedTask, shared=False, name="t.x", claim="x:{a}", time_limit=600)
    def x(a: str) -> str:
        return a

    return app


def connection_of(client: Any) -> tuple[Any, ...]:
    kwargs = client.connection_pool.connection_kwargs
    return (kwargs.get("host"), kwargs.get("port"), kwargs.get("db"), kwargs.get("password"))


@pytest.mark.parametrize(
    ("setting", "env", "expected"),
    [
        ("redis://127.0.0.1:6399/1", None, "redis://127.0.0.1:6399/1"),
        (None, "redis://127.0.0.1:6399/5", "redis://127.0.0.1:6399/5"),
        ("redis://127.0.0.1:6399/1", "redis://127.0.0.1:6399/5", "redis://127.0.0.1:6399/1"),
        (None, None, None),
    ],
    ids=["setting", "environment", "setting-wins", "neither"],
)
def test_lock_store_url_resolves_as_lock_redis(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, env: str | None, expected: str | None
) -> None:
    if env is None:
        monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    else:
        monkeypatch.setenv("FENCED_REDIS_URL", env)
    # The broker is a Redis in every case: it is never the lock store.
    app = lock_store_app(**({"fenced_redis_url": setting} if setting else {}))
    assert lock_store_url(app) == expected
    if expected is None:
        with pytest.raises(ConfigError):
            lock_redis(app)
    else:
        assert connection_of(lock_redis(app)) == connection_of(redis.Redis.from_url(expected))


@pytest.mark.parametrize("broker", ["redis://localhost:6399", "amqp://guest@127.0.0.1//"])
def test_no_lock_store_is_an_error_whatever_the_broker(
    monkeypatch: pytest.MonkeyPatch, broker: str
) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    found = check_celery(lock_store_app(broker))
    assert severity_of(found, "fenced.lock-store-missing") == "error"
    missing = next(f for f in found if f.code == "fenced.lock-store-missing")
    for text in (missing.what, missing.fix):
        assert "fenced_redis_url" in text and "FENCED_REDIS_URL" in text
    assert "ConfigError" in missing.why
    # No finding may claim that the broker stands in for the lock store.
    assert not any("fall back" in f.what + f.why + f.fix for f in found)
    assert "fenced.lock-store-implicit" not in codes(found)
    assert run_doctor(app=lock_store_app(broker)).exit_code == 1


def test_lock_store_sharing_a_database(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    # localhost:6399 with no db is 127.0.0.1:6399/0: the broker's own database.
    shared = check_celery(lock_store_app(fenced_redis_url="redis://127.0.0.1:6399/0"))
    assert severity_of(shared, "fenced.lock-store-shared") == "warning"
    assert {f.subject for f in shared if f.code == "fenced.lock-store-shared"} == {"broker"}
    backend = check_celery(lock_store_app(fenced_redis_url="redis://127.0.0.1:6399/2"))
    assert {f.subject for f in backend if f.code == "fenced.lock-store-shared"} == {
        "result backend"
    }
    separate = lock_store_app(fenced_redis_url="redis://127.0.0.1:6399/1")
    assert codes(check_celery(separate), *QUIET) == set()

    # The environment variable is compared the same way.
    monkeypatch.setenv("FENCED_REDIS_URL", "redis://127.0.0.1:6399/0")
    assert severity_of(check_celery(lock_store_app()), "fenced.lock-store-shared") == "warning"
    monkeypatch.setenv("FENCED_REDIS_URL", "redis://127.0.0.1:6399/5")
    assert codes(check_celery(lock_store_app()), *QUIET) == set()
    monkeypatch.delenv("FENCED_REDIS_URL")

    # Passwords are not printed.
    secret = check_celery(
        lock_store_app(
            "redis://:hunter2@127.0.0.1:6399/0", fenced_redis_url="redis://127.0.0.1:6399/0"
        )
    )
    finding = next(f for f in secret if f.code == "fenced.lock-store-shared")
    assert "hunter2" not in finding.what and ":***@127.0.0.1:6399" in finding.what


class RunOnlyClaim(ClaimedTask):
    """A ClaimedTask whose ``claim`` is the held claim in a run and nothing outside one."""

    @property
    def claim(self) -> Any:
        return None


def test_claimed_tasks_are_found_by_their_claim_template(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = make_app(**GOOD_CONF)

    @app.task(base=RunOnlyClaim, shared=False, name="t.x", claim="x:{a}", time_limit=30)
    def x(a: str) -> str:
        return a

    task = app.tasks["t.x"]
    assert isinstance(task, RunOnlyClaim)  # the registry is typed as holding any Task
    assert task.claim is None and task.claim_template == "x:{a}"
    found = check_celery(app)
    assert "celery.no-claimed-tasks" not in codes(found)
    assert severity_of(found, "celery.time-limit") == "error"


def test_claim_option_on_a_plain_task_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = make_app(**GOOD_CONF)

    # Celery keeps an unknown option as an attribute: without ClaimedTask nothing reads it.
    @app.task(shared=False, name="t.unclaimed", claim="x:{a}", time_limit=30)
    def unclaimed(a: str) -> str:
        return a

    found = check_celery(app)
    assert severity_of(found, "celery.claim-not-applied") == "error"
    finding = next(f for f in found if f.code == "celery.claim-not-applied")
    assert finding.subject == "t.unclaimed"
    assert "base=ClaimedTask" in finding.fix
    # It takes no claim, so the claim checks (time limit versus TTL) do not apply to it.
    assert "celery.time-limit" not in codes(found)


def test_claim_ttl_defaults_are_the_tasks_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    default = DEFAULTS["claim_ttl"]
    # The doctor keeps no default of its own that could drift from the tasks'.
    assert getattr(doctor, "DEFAULT_CLAIM_TTL", default) == default

    def limit_finding(**conf: Any) -> Finding | None:
        app = make_app(**{**GOOD_CONF, **conf})

        @app.task(base=ClaimedTask, shared=False, name="t.x", claim="x:{a}", time_limit=45)
        def x(a: str) -> str:
            return a

        return next((f for f in check_celery(app) if f.code == "celery.time-limit"), None)

    # No claim_ttl anywhere: the task's default lease outlasts a 45 s limit.
    finding = limit_finding()
    assert default >= 45
    assert finding is not None and f"claim TTL {default:g} s" in finding.what
    # The app's default for its tasks counts as the task would count it.
    assert limit_finding(fenced_claim_ttl=20) is None
    finding = limit_finding(fenced_claim_ttl=90)
    assert finding is not None and "claim TTL 90 s" in finding.what


def test_app_without_claimed_tasks_is_noted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = make_app()

    @app.task(shared=False, name="t.plain")
    def plain() -> None:
        return None

    found = check_celery(app)
    assert codes(found) == {"celery.no-claimed-tasks"}


# -- naming -----------------------------------------------------------------------------


def test_timestamp_in_the_key_is_too_fine() -> None:
    recs = [
        {
            "name": f"export:acme:{1700000000 + i}",
            "template": "export:{tenant}:{ts}",
            "args": {"tenant": "acme", "ts": 1700000000 + i},
            "outcome": "ok",
        }
        for i in range(25)
    ]
    found = check_naming(recs)
    assert codes(found) == {"naming.too-fine"}
    finding = found[0]
    assert finding.severity == "warning"
    assert "{ts}" in finding.what
    assert "'export:{tenant}'" in finding.fix
    assert "protects nothing" in finding.why
    # Fewer runs than the threshold: not enough evidence.
    assert check_naming(recs[:10]) == []


def test_one_lock_for_every_layer_is_too_coarse() -> None:
    recs: list[dict[str, Any]] = [
        {"name": "rebuild", "template": "rebuild", "args": {"layer": "roads"}, "outcome": "ok"}
    ]
    for layer in ["rivers", "rail", "parks", "bus", "bike", "rivers"]:
        recs.append(
            {
                "name": "rebuild",
                "template": "rebuild",
                "args": {"layer": layer},
                "outcome": "skipped",
            }
        )
    found = check_naming(recs)
    assert codes(found) == {"naming.too-coarse"}
    finding = found[0]
    assert finding.subject == "rebuild"
    assert "layer (6 values)" in finding.what
    assert "runs one at a time" in finding.why
    assert "'rebuild:{layer}'" in finding.fix


def test_well_named_claims_have_no_findings() -> None:
    recs = []
    for day in range(30):
        for layer in ["roads", "rivers", "rail"]:
            recs.append(
                {
                    "name": f"rebuild:{layer}",
                    "template": "rebuild:{layer}",
                    "args": {"layer": layer, "day": day},
                    "outcome": "skipped" if day % 7 == 0 else "ok",
                }
            )
    assert check_naming(recs) == []


def test_records_are_read_from_redis(server: RedisServer) -> None:
    client = server.client(decode_responses=True)
    for i in range(25):
        records.record(
            client, f"export:{i}", "ok", token=f"t{i}", template="export:{ts}", args={"ts": i}
        )
    for i in range(6):
        records.record(
            client,
            "rebuild",
            "skipped",
            event="skipped",
            template="rebuild",
            args={"layer": f"l{i}"},
        )
    loaded = load_records(client)
    assert len(loaded) == 31
    assert {
        "name": "rebuild",
        "template": "rebuild",
        "args": {"layer": "l0"},
        "outcome": "skipped",
    } in loaded
    report = run_doctor(client)
    assert {"naming.too-fine", "naming.too-coarse"} <= report.codes("warning")


def test_names_with_a_time_in_them_are_too_fine_from_every_front_end(
    server: RedisServer,
) -> None:
    from fenced import exclusive
    from fenced._run import RunOptions, run_command

    client = server.client(decode_responses=True)
    for _ in range(21):  # as cron runs `fenced run "nightly:$(date +%s%N)" -- true`
        opts = RunOptions(name=f"nightly:{time.time_ns()}", argv=["true"], quiet=True)
        assert run_command(client, opts) == 0

    @exclusive(lambda day: f"report:{day}", redis=client, ttl=10)
    def report(day: str) -> None:
        pass

    @exclusive("export:{ts}", redis=client, ttl=10)
    def export(ts: int) -> None:
        pass

    for i in range(21):
        report(f"2026-01-{i + 1:02d}T03:00:00")
        export(1764558000 + i)
        # The same name every time: nothing to flag.
        run_command(client, RunOptions(name="backup:db", argv=["true"], quiet=True))

    found = {f.subject: f for f in check_naming(load_records(client))}
    assert set(found) == {"nightly:{n}", "report:{date}", "export:{ts}"}
    nightly = found["nightly:{n}"]
    assert nightly.code == "naming.too-fine"
    assert "21 different names in 21 runs" in nightly.what
    assert "fenced run -- true" in nightly.what
    assert "'nightly'" in nightly.fix
    assert "test_doctor" in found["report:{date}"].what  # the function that ran it
    assert "'report'" in found["report:{date}"].fix
    assert "{ts}" in found["export:{ts}"].what


def test_name_shapes_keep_resources_and_digests() -> None:
    assert name_shape("nightly:1764558000123456789") == "nightly:{n}"
    assert name_shape("run-20261201") == "run-{n}"
    assert name_shape("job:0b7f3c1e-9a3b-4c1d-8e2f-1234567890ab") == "job:{id}"
    assert name_shape("report:2026-01-02T03:00:00") == "report:{date}"
    for kept in ("backup:db", "tile:12:34", "user:4711", "feed:h1-" + "1" * 40):
        assert name_shape(kept) is None


def test_contended_outcomes_are_outcomes_run_records_carry() -> None:
    assert CONTENDED_OUTCOMES
    assert set(CONTENDED_OUTCOMES) <= set(records.OUTCOMES)


def test_runs_that_lose_the_race_for_one_claim_show_it_too_coarse(server: RedisServer) -> None:
    client = server.client(decode_responses=True)
    holder = Claim(client, "rebuild", ttl=30, heartbeat=False, records=True)
    assert holder.acquire()
    try:
        for layer in ["roads", "rivers", "rail", "parks", "bus", "bike"]:
            loser = Claim(
                client,
                "rebuild",
                ttl=30,
                heartbeat=False,
                records=True,
                record_extra={"template": "rebuild", "args": {"layer": layer}},
            )
            assert not loser.acquire()
    finally:
        holder.release(outcome="ok")
    loaded = load_records(client)
    assert {r["outcome"] for r in loaded} == {"ok", "skipped"}
    found = check_naming(loaded)
    assert codes(found) == {"naming.too-coarse"}
    assert "layer (6 values)" in found[0].what


# -- the report -------------------------------------------------------------------------


def test_well_configured_setup_has_no_errors_or_warnings(
    own_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    report = run_doctor(own_server.client(), good_app())
    assert report.errors == [] and report.warnings == [], format_text(report)
    assert report.exit_code == 0


def test_report_renders_as_json_and_text(own_server: RedisServer) -> None:
    client = own_server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    report = run_doctor(client)
    data = json.loads(report.as_json())
    assert data["exit_code"] == 1
    assert data["counts"]["error"] == 1
    first = data["findings"][0]
    assert first["severity"] == "error"
    assert set(first) == {"severity", "code", "what", "why", "fix", "subject"}

    text = format_text(report)
    assert text.startswith("ERROR    redis.maxmemory-policy")
    assert "fix: `CONFIG SET maxmemory-policy noeviction`" in text

    from rich.console import Console

    out = io.StringIO()
    render(report, Console(file=out, width=100))
    assert "redis.maxmemory-policy" in out.getvalue()
    assert "CONFIG SET" in out.getvalue()


def test_empty_report() -> None:
    report = Report([])
    assert report.exit_code == 0
    assert "no findings" in format_text(report)


def test_render_without_rich_prints_plain_text(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "rich.console", None)
    finding = Finding("warning", "x.y", "what", "why", "fix")
    render(Report([finding]))
    out = capsys.readouterr().out
    assert out.startswith("WARNING  x.y: what")
    assert "0 error(s), 1 warning(s), 0 note(s)" in out


def test_a_redelivery_window_shorter_than_the_visibility_timeout_is_an_error() -> None:
    assert "celery.redelivery-window" not in codes(check_celery(good_app()))
    app = make_app(**{**GOOD_CONF, "fenced_claim_redelivery_window": 600})

    @app.task(base=ClaimedTask, shared=False, name="t.once", claim="once:{a}", time_limit=60)
    def once(a: str) -> str:
        return a

    found = check_celery(app)
    assert severity_of(found, "celery.redelivery-window") == "error"
    finding = next(f for f in found if f.code == "celery.redelivery-window")
    assert "t.once" in finding.what and "fenced_claim_redelivery_window = 14400" in finding.fix


def test_replace_with_enqueue_until_finished_is_flagged_as_contradictory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    app = make_app(**GOOD_CONF)

    @app.task(
        base=ClaimedTask,
        shared=False,
        name="t.newest",
        claim="newest:{a}",
        claim_on_busy="replace",
        claim_enqueue="until_finished",
        time_limit=3600,
    )
    def newest(a: str) -> str:
        return a

    found = check_celery(app)
    (refused,) = [f for f in found if f.code == "celery.task-refused"]
    assert refused.severity == "error"
    assert "claim_on_busy='replace' contradicts claim_enqueue='until_finished'" in refused.what

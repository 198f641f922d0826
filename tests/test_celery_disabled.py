"""fenced switched off (``fenced_enabled = False``, ``FENCED_ENABLED=0``): claimed tasks run
eagerly with no Redis at all, the doctor warns, and a worker says so when it starts; a
worker switched on says when its claims' Redis does not answer as it starts."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from _wait import wait_for
from celery_harness import WAIT, Services, Worker, key
from fenced import ConfigError
from fenced.celery import ClaimedTask, lock_redis
from fenced.celery import _options as options_module
from fenced.celery._disabled import LocalClaim, enabled
from fenced.celery._task import _claims_client
from fenced.doctor import check_celery
from fenced.testing import RedisServer


def closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
def no_switch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("FENCED_ENABLED", raising=False)
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    yield


def eager_app(**conf: Any) -> tuple[Celery, Any]:
    app = Celery("unit", broker="memory://", set_as_current=False)
    app.conf.update(
        task_always_eager=True,
        fenced_redis_url=f"redis://127.0.0.1:{closed_port()}/1",
        **conf,
    )

    @app.task(base=ClaimedTask, bind=True, shared=False, name="u.rebuild", claim="rb:{layer}")
    def rebuild(self: Any, layer: str) -> dict[str, Any]:
        claim = self.claim
        claim.check()
        steps = list(claim.steps(range(3)))
        return {
            "layer": layer,
            "name": claim.name,
            "fence": claim.fence,
            "held": claim.held,
            "lost": claim.lost,
            "refreshed": claim.refresh(),
            "steps": steps,
            "local": isinstance(claim, LocalClaim),
        }

    return app, rebuild


def test_switched_off_an_eager_task_runs_with_a_local_claim_and_no_redis(no_switch: None) -> None:
    app, rebuild = eager_app(fenced_enabled=False)
    first = rebuild.apply(args=("roads",)).get()
    second = rebuild.delay("roads").get()
    assert first["local"] and first["held"] and not first["lost"] and first["refreshed"]
    assert first["name"] == "rb:roads" and first["steps"] == [0, 1, 2]
    assert second["fence"] > first["fence"] > 0
    # No client was made for the app, so no connection was tried.
    assert app not in options_module._clients


def test_the_environment_switches_it_off_when_the_setting_is_not_given(
    no_switch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCED_ENABLED", "0")
    app, rebuild = eager_app()
    assert rebuild.apply(args=("rivers",)).get()["local"]
    assert app not in options_module._clients
    # The setting wins over the environment.
    app.conf.fenced_enabled = True
    assert enabled(app)


def test_on_by_default_and_bad_values_are_refused(
    no_switch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, _rebuild = eager_app()
    assert enabled(app)
    app.conf.fenced_enabled = "no"
    with pytest.raises(ConfigError, match="must be True or False"):
        enabled(app)
    app.conf.fenced_enabled = None
    monkeypatch.setenv("FENCED_ENABLED", "maybe")
    with pytest.raises(ConfigError, match="FENCED_ENABLED='maybe'"):
        enabled(app)


def test_the_doctor_warns_about_an_app_with_claims_switched_off(
    no_switch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, _rebuild = eager_app()
    assert "celery.fenced-disabled" not in {f.code for f in check_celery(app)}
    app.conf.fenced_enabled = False
    found = {f.code: f for f in check_celery(app)}
    assert found["celery.fenced-disabled"].severity == "warning"
    assert "u.rebuild" in found["celery.fenced-disabled"].what
    app.conf.fenced_enabled = None
    monkeypatch.setenv("FENCED_ENABLED", "0")
    assert "celery.fenced-disabled" in {f.code for f in check_celery(app)}
    monkeypatch.setenv("FENCED_ENABLED", "maybe")
    found = {f.code: f for f in check_celery(app)}
    assert found["celery.fenced-enabled-invalid"].severity == "error"


def test_a_worker_switched_off_warns_at_start_and_runs_without_redis_for_claims(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCED_ENABLED", "0")
    services = Services.on(redis_server)
    client = services.client()
    nowhere = f"redis://127.0.0.1:{closed_port()}/2"
    try:
        with Worker(services, concurrency=1, lock_url=nowhere, name="off") as worker:
            k = key()
            result = client.send_task(
                "t.rebuild", args=(k, "roads"), kwargs={"steps": 1}, queue=services.queue
            ).get(timeout=WAIT)
            assert result["status"] == "ok" and result["fence"] > 0
            log = worker.log()
            assert "WARNING" in log and "claims are switched off for this worker" in log
            assert "did not answer" not in log  # switched off: its Redis is not asked
    finally:
        client.close()


def test_a_worker_switched_on_does_not_warn(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FENCED_ENABLED", raising=False)
    services = Services.on(redis_server)
    with Worker(services, concurrency=1, name="on") as worker:
        assert "claims are switched off" not in worker.log()
        assert "did not answer" not in worker.log()  # its claims' Redis answered


def test_a_worker_whose_claims_redis_does_not_answer_warns_at_start(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One PING at start: a closed port is named (its password hidden) in one WARNING,
    and the worker starts all the same."""
    monkeypatch.delenv("FENCED_ENABLED", raising=False)
    services = Services.on(redis_server)
    port = closed_port()
    nowhere = f"redis://:hunter2-claims@127.0.0.1:{port}/2"
    with Worker(services, concurrency=1, lock_url=nowhere, name="nowhere") as worker:

        def warned() -> str | None:
            log = worker.log()
            return log if "did not answer" in log else None

        log = wait_for("the warning", warned)
    said = [line for line in log.splitlines() if "did not answer" in line]
    assert len(said) == 1 and "WARNING" in said[0], said
    assert f"the claims' Redis at redis://:***@127.0.0.1:{port}/2 did not answer" in said[0]
    assert "Connection refused" in said[0] and "no claimed task starts" in said[0]
    assert "hunter2-claims" not in log and "Traceback" not in log


def test_the_switch_changed_between_runs_holds_from_the_next_run(
    no_switch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    app, rebuild = eager_app(fenced_enabled=False)
    assert rebuild.apply(args=("a",)).get()["local"]
    # Every run asks; the answer given before must not outlive a change of the setting,
    # of the environment, or of the settings object.
    app.conf.fenced_enabled = True
    assert enabled(app)
    app.conf.fenced_enabled = False
    assert not enabled(app)
    changes = app.conf.changes
    assert changes is not None
    del changes["fenced_enabled"]
    assert enabled(app)
    monkeypatch.setenv("FENCED_ENABLED", "off")
    assert not enabled(app)
    monkeypatch.setenv("FENCED_ENABLED", "on")
    assert enabled(app)

    class Settings:
        fenced_enabled = False

    app.config_from_object(Settings)
    assert not enabled(app)
    assert rebuild.apply(args=("b",)).get()["local"]


def test_switched_off_a_secret_field_is_named_with_the_apps_key(
    no_switch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same name as with claims on: the key comes from the app's setting.
    monkeypatch.delenv("FENCED_SECRET_KEY", raising=False)
    app = Celery("unit-secret", broker="memory://", set_as_current=False)
    app.conf.update(task_always_eager=True, fenced_enabled=False, fenced_secret_key="k" * 32)

    @app.task(base=ClaimedTask, bind=True, shared=False, name="u.sync", claim="sync:{token:secret}")
    def sync(self: Any, token: str) -> str:
        return str(self.claim.name)

    name = sync.apply(args=("hunter2",)).get()
    assert name == sync.claim_name_for(("hunter2",), {})
    assert "hunter2" not in name


def test_switched_off_claim_enqueue_touches_no_redis(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery_enqueue_app import make_app

    monkeypatch.setenv("FENCED_ENABLED", "0")  # the worker's switch
    monkeypatch.delenv("FENCED_REDIS_URL", raising=False)
    # Eagerly: the marker's hooks (before_start, after_return) run and connect nowhere.
    app, _rebuild = eager_app(fenced_enabled=False)

    @app.task(
        base=ClaimedTask,
        bind=True,
        shared=False,
        name="u.once",
        claim="once:{layer}",
        claim_enqueue="until_finished",
    )
    def once(self: Any, layer: str) -> str:
        return str(self.claim.name)

    assert once.delay("roads").get() == "once:roads"
    assert once.apply(args=("roads",)).get() == "once:roads"
    assert app not in options_module._clients
    # In a real worker, sent from an app whose claims' Redis is a closed port.
    services = Services.on(redis_server)
    nowhere = f"redis://127.0.0.1:{closed_port()}/2"
    sender = make_app(
        services.broker_url, services.backend_url, nowhere, services.obs_url, services.queue
    )
    sender.conf.fenced_enabled = False
    task = sender.tasks["e.finished"]
    k = key()
    services.obs().set(f"go:{k}", 1)
    with Worker(
        services, concurrency=1, lock_url=nowhere, name="off", app="tests.celery_enqueue_app"
    ) as worker:
        # Nothing marks the name: each call is sent, and each runs.
        first, second = task.delay(k), task.delay(k)
        assert first.id != second.id
        assert first.get(timeout=WAIT) == first.id
        assert second.get(timeout=WAIT) == second.id
        assert sender not in options_module._clients
        assert "queued mark" not in worker.log()
    sender.close()


def test_each_run_asks_once_and_follows_each_apps_switch_and_url(
    no_switch: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    one, _ = eager_app(fenced_enabled=False)
    two, _ = eager_app()
    # Runs of two apps in turn: neither is handed the other's answer.
    for _ in range(2):
        assert _claims_client(one) is None
        assert _claims_client(two) is lock_redis(two)
    one.conf.fenced_enabled = True
    assert _claims_client(one) is lock_redis(one) is not lock_redis(two)
    monkeypatch.setenv("FENCED_ENABLED", "0")
    changes = one.conf.changes
    assert changes is not None
    del changes["fenced_enabled"]
    assert _claims_client(one) is None and _claims_client(two) is None
    monkeypatch.delenv("FENCED_ENABLED")
    before = _claims_client(two)
    two.conf.fenced_redis_url = f"redis://127.0.0.1:{closed_port()}/2"
    after = _claims_client(two)
    assert after is not before and after is lock_redis(two)

"""`fenced doctor` as a command: real Redis servers, Celery apps imported by --app."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from fenced.testing import RedisServer


def doctor(
    *args: str, cwd: Path | None = None, lock_env: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FENCED_REDIS_URL"}
    if lock_env is not None:
        env["FENCED_REDIS_URL"] = lock_env
    return subprocess.run(
        [sys.executable, "-m", "fenced.cli", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env=env,
    )


def codes(out: str) -> dict[str, str]:
    return {f["code"]: f["severity"] for f in json.loads(out)["findings"]}


def test_evicting_redis_is_an_error(own_server: RedisServer) -> None:
    own_server.client().config_set("maxmemory-policy", "allkeys-lru")
    res = doctor("--redis", own_server.url, "--json")
    assert res.returncode == 1, res.stderr
    found = codes(res.stdout)
    assert found["redis.maxmemory-policy"] == "error"
    text = doctor("--redis", own_server.url)
    assert "noeviction" in text.stdout  # the fix is named


def test_well_configured_redis_passes(own_server: RedisServer) -> None:
    res = doctor("--redis", own_server.url, "--json")
    assert res.returncode == 0, res.stdout
    assert all(sev == "info" for sev in codes(res.stdout).values())


APP = textwrap.dedent(
    """
    from celery import Celery
    from fenced.celery import ClaimedTask

    app = Celery("bad", broker="{broker}")
    app.conf.fenced_redis_url = {locks!r}
    app.conf.broker_transport_options = {{"visibility_timeout": 60}}

    @app.task(base=ClaimedTask, bind=True, claim="rebuild:{{layer}}", claim_ttl=300,
              time_limit=120)
    def rebuild(self, layer):
        return layer
    """
)


def test_misconfigured_celery_app(own_server: RedisServer, tmp_path: Path) -> None:
    base = own_server.url.rsplit("/", 1)[0]
    (tmp_path / "badapp.py").write_text(APP.format(broker=f"{base}/0", locks=f"{base}/2"))
    res = doctor("--app", "badapp:app", "--json", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    found: dict[str, Any] = codes(res.stdout)
    assert found["celery.acks-late"] == "warning"
    assert found["celery.time-limit"] == "error"
    assert found["celery.visibility-timeout"] == "error"
    # The lock store came from the app's setting: the Redis checks ran too.
    assert "redis.persistence" in found


def test_app_without_lock_store_is_an_error_and_its_broker_is_not_checked(
    own_server: RedisServer, tmp_path: Path
) -> None:
    # A healthy Redis broker: were it taken for the lock store, its checks would pass.
    (tmp_path / "nostore.py").write_text(APP.format(broker=own_server.url, locks=None))
    res = doctor("--app", "nostore:app", "--json", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    found = codes(res.stdout)
    assert found["fenced.lock-store-missing"] == "error"
    assert not [code for code in found if code.startswith("redis.")], found
    missing = next(
        f for f in json.loads(res.stdout)["findings"] if f["code"] == "fenced.lock-store-missing"
    )
    assert "FENCED_REDIS_URL" in missing["fix"] and "fenced_redis_url" in missing["fix"]


def test_app_setting_wins_over_the_environment_as_in_the_workers(
    own_server: RedisServer, server: RedisServer, tmp_path: Path
) -> None:
    # The app's setting names an evicting Redis; the environment names a healthy one.
    own_server.client().config_set("maxmemory-policy", "allkeys-lru")
    (tmp_path / "evicting.py").write_text(APP.format(broker="memory://", locks=own_server.url))
    res = doctor("--app", "evicting:app", "--json", cwd=tmp_path, lock_env=server.url)
    assert codes(res.stdout).get("redis.maxmemory-policy") == "error", res.stdout
    # Only the environment: it is the lock store, and it is checked.
    (tmp_path / "fromenv.py").write_text(APP.format(broker="memory://", locks=None))
    res = doctor("--app", "fromenv:app", "--json", cwd=tmp_path, lock_env=own_server.url)
    found = codes(res.stdout)
    assert found.get("redis.maxmemory-policy") == "error", res.stdout
    assert "fenced.lock-store-missing" not in found
    # An explicit --redis is what the operator asked to check.
    res = doctor("--app", "evicting:app", "--redis", server.url, "--json", cwd=tmp_path)
    assert "redis.maxmemory-policy" not in codes(res.stdout)


def test_bad_lock_store_url_names_the_setting(tmp_path: Path) -> None:
    (tmp_path / "badurl.py").write_text(APP.format(broker="memory://", locks="http://locks:80/1"))
    res = doctor("--app", "badurl:app", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "fenced_redis_url" in res.stderr and "http://locks:80/1" in res.stderr


def test_nothing_to_check_is_a_usage_error() -> None:
    res = doctor()
    assert res.returncode == 2
    assert "--redis" in res.stderr and "--app" in res.stderr


def test_unimportable_app_names_the_fix(tmp_path: Path) -> None:
    res = doctor("--app", "no_such_module:app", cwd=tmp_path)
    assert res.returncode == 2
    assert "cannot import" in res.stderr


DJANGOFEEDS = Path(__file__).resolve().parent.parent / "examples" / "djangofeeds"


def test_app_is_found_as_celery_finds_it_with_autodiscovered_tasks(
    own_server: RedisServer,
) -> None:
    # A Django project: the app lives in djangofeeds/celery.py and its one claimed task in
    # feeds/tasks.py, which only autodiscovery (the Django app registry) imports.
    for spec in ("djangofeeds", "djangofeeds.celery:app", "djangofeeds.celery"):
        res = doctor("--app", spec, "--json", cwd=DJANGOFEEDS, lock_env=own_server.url)
        assert res.returncode == 0, spec + res.stdout + res.stderr
        findings = json.loads(res.stdout)["findings"]
        found = {f["code"]: f for f in findings}
        assert "celery.no-claimed-tasks" not in found, (spec, findings)
        assert found["celery.claimed-tasks"]["subject"] == "feed.import", spec


def test_app_module_without_an_app_names_the_forms(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("VALUE = 1\n")
    res = doctor("--app", "plain", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "names no Celery app" in res.stderr and "celery -A" in res.stderr
    res = doctor("--app", "plain:VALUE", cwd=tmp_path)
    assert res.returncode == 2
    assert "not a Celery app" in res.stderr


def test_a_missing_attribute_is_named_not_the_whole_spec(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("VALUE = 1\n")
    res = doctor("--app", "plain:nope", cwd=tmp_path)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "module 'plain' has no attribute 'nope'" in res.stderr, res.stderr
    assert "No module named" not in res.stderr


REFUSED = """
from celery import Celery
from fenced.celery import ClaimedTask

app = Celery("refused", broker="memory://")
app.conf.fenced_redis_url = {locks!r}


@app.task(base=ClaimedTask, claim="nb:{{tenant}}")
def build(notebook_id):
    pass


@app.task(base=ClaimedTask, claim="ok:{{key}}", claim_ttll=5)
def typo(key):
    pass


@app.task(base=ClaimedTask, claim="fine:{{key}}")
def fine(key):
    pass
"""


def test_a_task_whose_definition_is_refused_is_a_finding_not_a_traceback(
    own_server: RedisServer, tmp_path: Path
) -> None:
    (tmp_path / "refused.py").write_text(REFUSED.format(locks=own_server.url))
    res = doctor("--app", "refused:app", "--json", cwd=tmp_path)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    findings = json.loads(res.stdout)["findings"]
    refused = [f["what"] for f in findings if f["code"] == "celery.task-refused"]
    assert len(refused) == 2, findings
    assert any("names tenant" in w and "notebook_id" in w for w in refused), refused
    assert any("claim_ttll" in w and "claim_ttl" in w for w in refused), refused
    # The task defined correctly is still checked.
    claimed = [f for f in findings if f["code"] == "celery.claimed-tasks"]
    assert claimed and "fine" in claimed[0]["subject"], findings
    res = doctor("--app", "refused:app", cwd=tmp_path)
    assert res.returncode == 1 and "Traceback" not in res.stdout + res.stderr

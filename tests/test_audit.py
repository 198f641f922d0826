"""The fenced.audit log: one structured line per act that clears another holder's lease."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from typing import Any

import pytest
from celery import Celery
from typer.testing import CliRunner

from fenced import Claim, ClaimUnavailable, force_release, records
from fenced._audit import FIELDS, LOGGER
from fenced._inspect import force_release as operator_release
from fenced._lease import ClaimKeys, short_token
from fenced.celery import ClaimedTask
from fenced.cli import app as cli_app
from fenced.testing import RedisServer, free_port


@pytest.fixture
def audit(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Captures the fenced.audit lines of the test, however the root logger is configured."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def _lines(audit: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    lines = [rec for rec in audit.records if rec.name == LOGGER]
    for rec in lines:
        assert rec.levelno == logging.INFO
        assert all(hasattr(rec, field) for field in FIELDS), rec.__dict__
    return [{f: getattr(rec, f) for f in FIELDS} | {"message": rec.getMessage()} for rec in lines]


def _held(r: Any, name: str, **options: Any) -> Claim:
    claim = Claim(r, name, ttl=30, heartbeat=False, records=True, **options)
    assert claim.acquire()
    return claim


def test_a_force_release_logs_who_what_and_why(r: Any, audit: pytest.LogCaptureFixture) -> None:
    claim = _held(r, "rebuild:roads")
    assert force_release(r, "rebuild:roads", reason="stuck", by="ops@bastion") is not None
    assert claim.fence is not None and claim.token is not None
    [line] = _lines(audit)
    assert line["fenced_action"] == "force_release"
    assert line["fenced_name"] == "rebuild:roads"
    assert line["fenced_token_prefix"] == short_token(claim.token)
    assert claim.token not in line["message"] and line["fenced_token_prefix"] in line["message"]
    assert line["fenced_fence"] == claim.fence
    assert line["fenced_by"] == "ops@bastion"
    assert line["fenced_uid"] == os.getuid()
    assert line["fenced_host"] == socket.gethostname()
    assert line["fenced_pid"] == os.getpid()
    assert line["fenced_reason"] == "stuck"
    assert line["fenced_outcome"] == "released"
    # Nothing held: the attempt is an act too.
    audit.clear()
    assert force_release(r, "rebuild:roads", reason="again", token_prefix="ffff0000") is None
    [line] = _lines(audit)
    assert line["fenced_outcome"] == "not_held" and line["fenced_fence"] is None
    assert line["fenced_token_prefix"] == "ffff0000" and line["fenced_by"]


def test_the_audit_line_outlives_trimmed_run_records(
    r: Any, audit: pytest.LogCaptureFixture
) -> None:
    _held(r, "sync:feed")
    assert force_release(r, "sync:feed", reason="holder gone", by="ops", max_records=1)
    # Anyone who can reach Redis can trim the records; the line already left the process.
    r.ltrim(ClaimKeys.of("sync:feed").records, 1, 0)
    assert records.history(r, "sync:feed") == []
    [line] = _lines(audit)
    assert line["fenced_outcome"] == "released" and line["fenced_reason"] == "holder gone"


def test_an_unreachable_redis_is_logged_too(audit: pytest.LogCaptureFixture) -> None:
    import redis

    gone = redis.Redis(port=free_port(), socket_connect_timeout=2)
    with pytest.raises(ClaimUnavailable):
        force_release(gone, "rebuild:roads", reason="stuck", by="ops")
    [line] = _lines(audit)
    assert line["fenced_outcome"] == "unreachable" and line["fenced_fence"] is None


def test_the_operator_release_logs_the_operator(r: Any, audit: pytest.LogCaptureFixture) -> None:
    claim = _held(r, "rebuild:roads")
    operator_release(r, "rebuild:roads", reason="stuck")
    [line] = _lines(audit)
    assert line["fenced_outcome"] == "released" and line["fenced_fence"] == claim.fence
    assert line["fenced_by"].endswith("@" + socket.gethostname())


def test_fenced_release_on_the_command_line(
    server: RedisServer, audit: pytest.LogCaptureFixture
) -> None:
    client = server.client(decode_responses=True)
    claim = _held(client, "job:nightly")
    assert cli_app is not None
    res = CliRunner().invoke(
        cli_app,
        ["release", "job:nightly", "--force", "--reason", "hung", "--redis", server.url],
    )
    assert res.exit_code == 0, res.output
    [line] = _lines(audit)
    assert line["fenced_name"] == "job:nightly" and line["fenced_fence"] == claim.fence
    assert line["fenced_reason"] == "hung" and line["fenced_outcome"] == "released"


def test_fenced_release_prints_the_audit_line_where_no_logging_is_set_up(
    server: RedisServer,
) -> None:
    claim = _held(server.client(), "job:nightly")
    assert claim.token is not None
    env = {k: v for k, v in os.environ.items() if k != "FENCED_REDIS_URL"}
    command = ["release", "job:nightly", "--force", "--reason", "hung", "--redis", server.url]
    res = subprocess.run(
        [sys.executable, "-m", "fenced", *command],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    assert "force release of 'job:nightly': released" in res.stderr
    assert short_token(claim.token) in res.stderr and claim.token not in res.stderr


def test_a_celery_worker_releasing_a_dead_childs_claim(
    server: RedisServer, audit: pytest.LogCaptureFixture
) -> None:
    app = Celery("fenced_audit_tests", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = server.url

    @app.task(shared=False, base=ClaimedTask, bind=True, claim="rebuild:{layer}")
    def rebuild(self: Any, layer: str) -> None: ...

    claim = _held(server.client(), "rebuild:roads", task_id="t-1")
    task: Any = rebuild
    holder = task.release_dead_holder("t-1", os.getpid(), (), {"layer": "roads"}, "child died")
    assert holder is not None
    [line] = _lines(audit)
    assert line["fenced_name"] == "rebuild:roads" and line["fenced_fence"] == claim.fence
    assert line["fenced_reason"] == "child died" and line["fenced_outcome"] == "released"
    assert line["fenced_uid"] == os.getuid() and line["fenced_by"]

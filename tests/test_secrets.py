"""No secret at rest or on screen: secrets seeded through each entry point, looked for
everywhere fenced writes (every key and value in Redis) and prints (stdout, stderr)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from _wait import wait_for
from fenced import (
    Claim,
    ClaimHeld,
    ClaimOptions,
    ConfigError,
    Skipped,
    claim_name,
    exclusive,
    hash_value,
    read_holder,
    records,
)
from fenced._inspect import force_release, list_claims, show_claim
from fenced._lease import ClaimKeys, LeaseStore
from fenced._naming import KEYED_PREFIX
from fenced._redact import exception_text, redact
from fenced.celery import ClaimedTask
from fenced.testing import RedisServer, free_port

FENCED = [sys.executable, "-m", "fenced.cli"]
SECRET = "hunter2"
KEY = "k" * 32
REDIS_PASSWORD = "RedisPw-53cr3t"


class PasswordServer(RedisServer):
    """A redis-server that wants a password: its URL carries it."""

    def __init__(self) -> None:
        super().__init__(extra=["--requirepass", REDIS_PASSWORD])

    @property
    def url(self) -> str:
        return f"redis://:{REDIS_PASSWORD}@127.0.0.1:{self.port}/0"


@pytest.fixture(scope="module")
def pw_server() -> Iterator[PasswordServer]:
    server = PasswordServer()
    with server:
        yield server


@pytest.fixture
def r(pw_server: PasswordServer) -> Iterator[Any]:
    client = pw_server.client(decode_responses=True)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_SECRET_KEY", raising=False)


def everything(client: Any) -> str:
    """Every key and every value in the server, as one text."""
    parts: list[str] = []
    for key in client.scan_iter(count=1000):
        parts.append(key)
        kind = client.type(key)
        if kind == "string":
            parts.append(client.get(key))
        elif kind == "stream":
            parts += [json.dumps(fields) for _id, fields in client.xrange(key)]
        elif kind == "list":
            parts += client.lrange(key, 0, -1)
        elif kind == "hash":
            parts.append(json.dumps(client.hgetall(key)))
        elif kind in ("set", "zset"):
            parts += client.smembers(key) if kind == "set" else client.zrange(key, 0, -1)
    return "\n".join(parts)


def env_for(url: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    env["FENCED_REDIS_URL"] = url
    # A Redis that is down, or refuses the password, fails at the first try, not after
    # redis-py's seconds of retries (the message is the same).
    env["FENCED_REDIS_RETRIES"] = "0"
    env.update(more)
    return env


def fenced(url: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FENCED, *args], capture_output=True, text=True, env=env_for(url, **env), timeout=60
    )


def cannot_release(client: Any, name: str, token: str | None) -> None:
    """``token``, as an API handed it out, neither releases nor renews the holder."""
    before = read_holder(client, name)
    assert before is not None
    if token:
        store = LeaseStore(client, ClaimKeys.of(name), ClaimOptions(ttl=60))
        assert store.refresh(token) is False
        assert store.release(store.release_call(token, "{}", "released", None))[0] is False
    after = read_holder(client, name)
    assert after is not None and after.token == before.token


# -- 1. fenced run records the program and a digest, not the command line -------------


def test_run_records_the_program_and_a_digest_not_the_arguments(r: Any, pw_server: Any) -> None:
    url = pw_server.url
    argv = ["sh", "-c", 'exit "$1"', "sh", "0", f"--db-password={SECRET}"]
    runner = subprocess.Popen(
        [*FENCED, "run", "backup:db", "--", "sh", "-c", 'sleep 60; exit "$1"', "sh", "0", argv[-1]],
        env=env_for(url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for("the claim held", lambda: read_holder(r, "backup:db"), proc=runner)
        listed = fenced(url, "ls", "--json")
        assert listed.returncode == 0, listed.stderr
        (info,) = json.loads(listed.stdout)
        assert info["extra"]["program"] == "sh" and info["extra"]["command_digest"]
        shown = fenced(url, "show", "backup:db")
        for out in (listed, shown, fenced(url, "show", "backup:db", "--json")):
            assert SECRET not in out.stdout + out.stderr
    finally:
        runner.send_signal(signal.SIGTERM)
        runner.communicate(timeout=60)
    for _ in range(2):
        done = fenced(url, "run", "--json", "backup:db", "--", *argv)
        assert done.returncode == 0, done.stderr
        assert SECRET not in done.stdout + done.stderr
    other = fenced(url, "run", "backup:db", "--", *argv[:-1], "--db-password=other")
    assert other.returncode == 0, other.stderr
    report = json.loads(fenced(url, "show", "backup:db", "--json").stdout)
    assert SECRET not in json.dumps(report) and SECRET not in everything(r)
    digests = [run["extra"]["command_digest"] for run in report["runs"]]
    # Two runs of one line compare equal; another line differs.
    assert digests[1] == digests[2] and digests[0] != digests[1]
    assert {run["extra"]["program"] for run in report["runs"]} == {"sh"}
    assert all("command" not in run["extra"] for run in report["runs"])


def test_run_digest_is_keyed_when_a_secret_key_is_set(r: Any, pw_server: Any) -> None:
    argv = ["sh", "-c", "true", f"--password={SECRET}"]
    done = fenced(pw_server.url, "run", "keyed", "--", *argv, FENCED_SECRET_KEY=KEY)
    assert done.returncode == 0, done.stderr
    (run,) = records.history(r, "keyed")
    digest = run.extra["command_digest"]
    # Unkeyed, a guess of the whole line could be confirmed against the record.
    assert digest.startswith(KEYED_PREFIX) and digest != hash_value(" ".join(argv))


def test_record_command_keeps_the_whole_line(r: Any, pw_server: Any) -> None:
    done = fenced(pw_server.url, "run", "--record-command", "whole", "--", "sh", "-c", "true")
    assert done.returncode == 0, done.stderr
    (run,) = records.history(r, "whole")
    assert run.extra["command"] == "sh -c true"


# -- 2. template fields marked secret --------------------------------------------------


def test_claim_name_secret_field_is_a_keyed_digest(no_key: None) -> None:
    name = claim_name(
        "sync:{account}:{api_key:secret}", account="acme", api_key=SECRET, secret_key=KEY
    )
    assert name.startswith("sync:acme:" + KEYED_PREFIX) and SECRET not in name
    again = claim_name(
        "sync:{account}:{api_key:secret}", account="acme", api_key=SECRET, secret_key=KEY
    )
    other_key = claim_name(
        "sync:{account}:{api_key:secret}", account="acme", api_key=SECRET, secret_key="x" * 32
    )
    assert again == name and other_key != name
    # The unkeyed digest of the value is not in the name: a guess cannot be checked.
    assert hash_value(SECRET)[3:] not in name
    with pytest.raises(ConfigError, match="FENCED_SECRET_KEY"):
        claim_name("sync:{api_key:secret}", api_key=SECRET)
    with pytest.raises(ConfigError, match="at least 16"):
        claim_name("sync:{api_key:secret}", api_key=SECRET, secret_key="short")
    with pytest.raises(ConfigError, match="everywhere"):
        claim_name("sync:{api_key:secret}:{api_key}", api_key=SECRET, secret_key=KEY)
    with pytest.raises(ConfigError, match=r"\{api_key:secret\}"):
        claim_name("sync:{api_key:>10}", api_key=SECRET)


def test_claim_name_takes_the_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FENCED_SECRET_KEY", KEY)
    from_env = claim_name("sync:{api_key:secret}", api_key=SECRET)
    assert from_env == claim_name("sync:{api_key:secret}", api_key=SECRET, secret_key=KEY)
    monkeypatch.setenv("FENCED_SECRET_KEY", "short")
    with pytest.raises(ConfigError, match="FENCED_SECRET_KEY is 5 bytes"):
        claim_name("sync:{api_key:secret}", api_key=SECRET)


def test_a_value_that_looks_like_a_keyed_digest_is_hashed(no_key: None) -> None:
    digest = claim_name("{v:secret}", v=SECRET, secret_key=KEY)
    assert claim_name("{v}", v=digest) != digest


def test_exclusive_secret_field_stays_out_of_redis(r: Any, no_key: None) -> None:
    @exclusive("sync:{account}:{api_key:secret}", redis=r, secret_key=KEY)
    def sync(account: str, api_key: str) -> str:
        return "synced"

    long_secret = "https://user:" + SECRET + "@api.example.com/v1?token=" + "z" * 80
    assert sync("acme", SECRET) == "synced"
    assert sync("acme", long_secret) == "synced"
    runs = records.history(r, claim_name("sync:{a}:{k:secret}", a="acme", k=SECRET, secret_key=KEY))
    (run,) = runs
    assert run.extra["args"]["api_key"].startswith(KEYED_PREFIX)
    assert "api_key" not in run.extra.get("arg_text", {})
    stored = everything(r)
    assert SECRET not in stored and "api.example.com" not in stored


def test_exclusive_secret_field_without_a_key_fails_at_decoration(r: Any, no_key: None) -> None:
    with pytest.raises(ConfigError, match="FENCED_SECRET_KEY") as info:

        @exclusive("sync:{api_key:secret}", redis=r)
        def sync(api_key: str) -> None: ...

    assert "sync" in str(info.value)


def test_exclusive_coroutine_secret_field(pw_server: Any, r: Any, no_key: None) -> None:
    @exclusive("async:{api_key:secret}", redis=pw_server.url, secret_key=KEY)
    async def work(api_key: str) -> int:
        return 1

    assert asyncio.run(work(SECRET)) == 1
    assert SECRET not in everything(r)
    assert any(key.startswith("fenced:{async:" + KEYED_PREFIX) for key in r.scan_iter())


@pytest.fixture
def app(pw_server: PasswordServer, r: Any) -> Iterator[Celery]:
    app = Celery("fenced_secret_tests", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = pw_server.url
    app.conf.fenced_claim_ttl = 5
    app.conf.fenced_secret_key = KEY
    yield app


def test_claimed_task_secret_field(app: Celery, r: Any, no_key: None) -> None:
    @app.task(shared=False, base=ClaimedTask, claim="sync:{account}:{api_key:secret}")
    def sync(account: str, api_key: str) -> str:
        return "synced"

    app.finalize()
    assert sync("acme", SECRET) == "synced"
    name = sync.claim_name_for(("acme", SECRET), {})
    assert name == claim_name("sync:{a}:{k:secret}", a="acme", k=SECRET, secret_key=KEY)
    (run,) = records.history(r, name)
    assert run.extra["args"] == {"account": "acme", "api_key": name.rsplit(":", 1)[1]}
    assert SECRET not in everything(r)


def test_claimed_task_secret_field_without_a_key_fails_when_built(
    pw_server: PasswordServer, no_key: None
) -> None:
    app = Celery("fenced_secret_nokey", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = pw_server.url

    @app.task(shared=False, base=ClaimedTask, claim="sync:{api_key:secret}")
    def sync(api_key: str) -> None: ...

    with pytest.raises(ConfigError, match=r"app\.conf\.fenced_secret_key"):
        app.finalize()


def test_claimed_task_short_secret_key_names_the_setting_and_task(
    pw_server: PasswordServer, no_key: None
) -> None:
    app = Celery("fenced_secret_short", set_as_current=False, broker="memory://")
    app.conf.fenced_redis_url = pw_server.url
    app.conf.fenced_secret_key = "short"

    @app.task(shared=False, base=ClaimedTask, claim="sync:{api_key:secret}", name="sync")
    def sync(api_key: str) -> None: ...

    with pytest.raises(ConfigError, match=r"task sync: app\.conf\.fenced_secret_key is 5 bytes"):
        app.finalize()


# -- 3. failure records keep the exception's type and a redacted message ---------------

LEAKY = (
    f"login failed: password={SECRET} at redis://bob:{SECRET}@db:6379/0, "
    f"api_key: '{SECRET}', Authorization: Bearer {SECRET}, retry with password {SECRET}9"
)


def test_redact_leaves_out_secret_values() -> None:
    text = redact(LEAKY)
    assert SECRET not in text
    assert "password=***" in text and "redis://bob:***@db:6379/0" in text
    assert "login failed" in text
    assert redact("the token expired at noon; see https://example.com/a?b=1") == (
        "the token expired at noon; see https://example.com/a?b=***"
    )
    assert redact("no secret here: 3 rows") == "no secret here: 3 rows"
    text = exception_text(ValueError(LEAKY * 20))
    assert text.startswith("ValueError: login failed") and len(text) <= 500
    assert SECRET not in text
    assert exception_text(KeyError()) == "KeyError"
    # A message of many secret words and pairs is read once: bounded, and redacted.
    huge = exception_text(RuntimeError("my_password_x" * 10_000 + f" password={SECRET} " * 5_000))
    assert huge.startswith("RuntimeError: my_password_x") and len(huge) == 500
    assert SECRET not in exception_text(RuntimeError(f"token={SECRET} " * 5_000))


@pytest.mark.parametrize(
    "message, kept",
    [
        # CalledProcessError shows the argv list: the option's value is the next item.
        (
            str(subprocess.CalledProcessError(1, ["mysql", "--password", SECRET, "-u", "bob"])),
            "Command '['mysql', '--password', '***', '-u', 'bob']' returned",
        ),
        (
            str(subprocess.CalledProcessError(2, [b"pg_dump", b"--db-password", SECRET.encode()])),
            "[b'pg_dump', b'--db-password', b'***']",
        ),
        (f"Command 'mysql --password {SECRET} -u bob' failed", "mysql --password *** -u bob"),
        # Authorization with any scheme: the credential, not only the scheme's word.
        (f"Authorization: Token {SECRET}", "Authorization: "),
        (f"proxy-authorization: Negotiate {SECRET}", "proxy-authorization: "),
        # A bytes (or raw) value: the whole literal, not its prefix.
        (str({"password": SECRET.encode()}), "{'password': ***}"),
        (f"{{'api_key': rb'{SECRET}', 'n': 1}}", "{'api_key': ***, 'n': 1}"),
    ],
)
def test_redact_command_lines_auth_schemes_and_bytes_values(message: str, kept: str) -> None:
    text = redact(message)
    assert SECRET not in text and kept in text, text


def test_failure_reason_is_redacted_for_every_front_end(
    app: Celery, pw_server: Any, r: Any
) -> None:
    with pytest.raises(ValueError), Claim(r, "with:block", records=True):
        raise ValueError(LEAKY)

    @exclusive("plain", redis=r)
    def plain() -> None:
        raise ValueError(LEAKY)

    @exclusive("coro", redis=r)
    async def coro() -> None:
        raise ValueError(LEAKY)

    @exclusive("aio", redis=pw_server.url)
    async def aio() -> None:
        raise ValueError(LEAKY)

    @app.task(shared=False, base=ClaimedTask, claim="task")
    def task() -> None:
        raise ValueError(LEAKY)

    app.finalize()
    for call in (plain, lambda: asyncio.run(coro()), lambda: asyncio.run(aio()), task):
        with pytest.raises(ValueError):
            call()
    for name in ("with:block", "plain", "coro", "aio", "task"):
        (run,) = records.history(r, name)
        assert run.outcome == "failed" and run.reason is not None
        assert run.reason.startswith("ValueError: login failed"), run.reason
    # Claim.release(reason=...) given by hand goes through the same filter.
    claim = Claim(r, "by:hand", records=True)
    assert claim.acquire()
    claim.release(outcome="failed", reason=LEAKY)
    assert SECRET not in everything(r)


# -- 4. no API hands out another holder's token ----------------------------------------


def test_no_api_hands_out_a_token_that_releases_the_holder(
    app: Celery, pw_server: Any, r: Any
) -> None:
    holder = Claim(r, "busy", ttl=30, records=True, task_id="t-1")
    assert holder.acquire()
    tokens: list[str | None] = []

    @exclusive("busy", redis=r, on_busy="raise")
    def raising() -> None: ...

    @exclusive("busy", redis=r)
    def skipping() -> None: ...

    with pytest.raises(ClaimHeld) as held:
        raising()
    tokens.append(held.value.token)
    skipped = skipping()
    assert isinstance(skipped, Skipped) and skipped.holder is not None
    tokens += [skipped.holder.token, skipped.as_dict()["holder"]["token"]]
    rival = Claim(r, "busy")
    assert not rival.acquire()
    assert rival.holder is not None
    tokens.append(rival.holder.token)
    found = read_holder(r, "busy")
    assert found is not None
    tokens.append(found.token)
    tokens += [run.token for run in records.history(r, "busy")]
    tokens += [info.holder.token for info in list_claims(r)]
    report = show_claim(r, "busy")
    tokens += [run["token"] for run in report.as_dict()["runs"]]
    tokens.append(json.loads(fenced(pw_server.url, "ls", "--json").stdout)[0]["holder"]["token"])

    @app.task(shared=False, base=ClaimedTask, claim="busy")
    def task() -> None: ...

    @app.task(shared=False, base=ClaimedTask, claim="busy", claim_on_busy="raise")
    def raising_task() -> None: ...

    app.finalize()
    result = task()
    assert result["status"] == "skipped"
    tokens.append(result["holder"]["token"])
    with pytest.raises(ClaimHeld) as from_task:
        raising_task()
    tokens.append(from_task.value.token)

    assert holder.token is not None
    for token in tokens:
        assert token != holder.token
        cannot_release(r, "busy", token)
    # The operator's path: a prefix, by an explicit release with a reason.
    shown = found.token
    assert holder.token.startswith(shown)
    assert force_release(r, "busy", token_prefix=shown, reason="gone") is not None
    assert read_holder(r, "busy") is None


# -- 5. the command does not get fenced's own settings ---------------------------------


def test_run_keeps_fenced_settings_from_the_command(pw_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "env"
    script = f"env > {out}"
    done = fenced(
        pw_server.url, "run", "env:job", "--", "sh", "-c", script, FENCED_SECRET_KEY=KEY, MINE="1"
    )
    assert done.returncode == 0, done.stderr
    seen = out.read_text()
    assert REDIS_PASSWORD not in seen and KEY not in seen
    assert "FENCED_REDIS_URL" not in seen and "MINE=1" in seen
    passed = fenced(
        pw_server.url,
        "run",
        "--pass-fenced-env",
        "env:job",
        "--",
        "sh",
        "-c",
        script,
        FENCED_SECRET_KEY=KEY,
    )
    assert passed.returncode == 0, passed.stderr
    seen = out.read_text()
    assert f"FENCED_REDIS_URL={pw_server.url}" in seen and f"FENCED_SECRET_KEY={KEY}" in seen


# -- 6. every URL fenced prints is redacted -------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:AlicePw@localhost/0",
        "redis://alice:AlicePw@127.0.0.1:{port}/0",
        "redis://127.0.0.1:{port}/0?password=AlicePw",
        "rediss://:AlicePw@127.0.0.1:{port}/0",
        "redis+sentinel://:AlicePw@127.0.0.1:{port}/mymaster",
        "unix://:AlicePw@/no/such/socket",
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ["ls"],
        ["show", "x"],
        ["run", "x", "--", "true"],
        ["release", "x", "--force", "--reason", "gone"],
        ["doctor"],
    ],
)
def test_printed_urls_are_redacted(url: str, command: list[str]) -> None:
    bad = url.format(port=free_port())
    res = subprocess.run(
        [*FENCED, *command, "--redis", bad],
        capture_output=True,
        text=True,
        env=env_for(bad),
        timeout=60,
    )
    assert res.returncode != 0
    assert "AlicePw" not in res.stdout + res.stderr, res.stdout + res.stderr


@pytest.mark.parametrize(
    "url",
    [
        "http://alice:AlicePw@localhost/0",
        "redis://127.0.0.1:1/0?password=AlicePw&x=1",
        "redis://alice:AlicePw@host:notaport/0",
        "redis+cluster://:AlicePw@",
    ],
)
def test_bad_urls_in_the_python_api_are_redacted(url: str) -> None:
    for make in (lambda: exclusive("x", redis=url), lambda: Claim(url, "x")):
        with pytest.raises(ConfigError) as info:
            make()
        assert "AlicePw" not in str(info.value) and "***" in str(info.value)


def test_doctor_app_does_not_print_the_brokers_or_lock_stores_password(
    pw_server: Any, r: Any, tmp_path: Path
) -> None:
    port = free_port()
    (tmp_path / "leaky_app.py").write_text(
        textwrap.dedent(
            f"""
            from celery import Celery
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            app = Celery("leaky", broker="redis://:BrokerPw@127.0.0.1:{port}/0",
                         backend="redis://:BackendPw@127.0.0.1:{port}/1")
            app.conf.fenced_redis_url = "redis://:LockPw@127.0.0.1:{port}/2"
            # Nothing listens there: one try, not redis-py's seconds of retries.
            app.conf.fenced_redis_options = {{"retry": Retry(NoBackoff(), 0)}}
            app.conf.fenced_secret_key = "{KEY}"
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCED_")}
    for args in (["--app", "leaky_app"], ["--app", "leaky_app", "--json"]):
        res = subprocess.run(
            [*FENCED, "doctor", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )
        out = res.stdout + res.stderr
        assert "127.0.0.1" in out, out  # it did talk about the stores
        for secret in ("BrokerPw", "BackendPw", "LockPw", KEY):
            assert secret not in out, out
    # And reachable, with the password in the URL: the report names the store redacted.
    env["FENCED_REDIS_URL"] = pw_server.url
    res = subprocess.run(
        [*FENCED, "doctor", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert REDIS_PASSWORD not in res.stdout + res.stderr


def test_redis_errors_with_a_password_are_redacted(pw_server: Any) -> None:
    wrong = pw_server.url.replace(REDIS_PASSWORD, "WrongPw-1")
    for command in (["ls"], ["run", "x", "--", "true"]):
        res = fenced(wrong, *command)
        assert res.returncode != 0
        assert "WrongPw-1" not in res.stdout + res.stderr and REDIS_PASSWORD not in res.stderr
    client = redis.Redis.from_url(wrong)
    with pytest.raises(Exception) as info, Claim(client, "x"):
        pass
    assert "WrongPw-1" not in str(info.value)

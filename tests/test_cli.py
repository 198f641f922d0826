"""The ``fenced`` command line, run as a real subprocess against a Redis this module owns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from _wait import wait_for
from fenced import Claim, claim_name, exclusive, hash_value
from fenced._inspect import ClaimReport, _show_apart, read_holder, show_claim
from fenced._lease import ClaimKeys
from fenced.testing import RedisServer, free_port

FENCED = [sys.executable, "-m", "fenced.cli"]


@pytest.fixture
def url(redis_server: RedisServer) -> str:
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Any]:
    """Decoded, on the server the commands talk to (the conftest ``r`` is on ``server``)."""
    client = redis_server.client(decode_responses=True)
    yield client
    client.close()


def env_for(url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FENCED_REDIS_URL"}
    # A Redis that is down fails a command at its first try, not after redis-py's
    # seconds of retries (test_retries_* check the default and the setting).
    env.setdefault("FENCED_REDIS_RETRIES", "0")
    if url:
        env["FENCED_REDIS_URL"] = url
    return env


def fenced(url: str | None, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*FENCED, *args], capture_output=True, text=True, env=env_for(url), timeout=timeout
    )


def spawn(url: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*FENCED, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env_for(url),
    )


def held(r: Any, name: str, **kw: Any) -> Claim:
    claim = Claim(r, name, ttl=kw.pop("ttl", 30), heartbeat=False, **kw)
    assert claim.acquire()
    return claim


# -- fenced run ---------------------------------------------------------------------------


def test_run_passes_the_exit_status_through_and_records_the_command(
    url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    ok = fenced(url, "run", "job:pass", "--", "sh", "-c", f"echo ran > {out}")
    assert ok.returncode == 0, ok.stderr
    assert out.read_text() == "ran\n"
    assert ok.stdout == ok.stderr == ""  # cron mails any output: a normal run prints none
    assert fenced(url, "run", "job:pass", "--", "sh", "-c", "exit 7").returncode == 7
    assert fenced(url, "run", "job:pass", "--", "sh", "-c", "kill -TERM $$").returncode == 143
    runs = json.loads(fenced(url, "show", "job:pass", "--json").stdout)["runs"]
    assert [(run["outcome"], run["reason"]) for run in runs] == [
        ("failed", "killed by SIGTERM"),
        ("failed", "exit status 7"),
        ("ok", None),
    ]
    # The program and a digest of the line: the arguments may hold passwords.
    assert runs[1]["extra"] == {"program": "sh", "command_digest": hash_value("sh -c 'exit 7'")}
    assert len({run["extra"]["command_digest"] for run in runs}) == 3
    assert runs[0]["fence"] > runs[1]["fence"] > runs[2]["fence"]


def test_busy_skip_exits_zero_with_one_line_naming_the_holder(
    url: str, r: Any, tmp_path: Path
) -> None:
    claim = held(r, "job:busy", task_id="t-42")
    marker = tmp_path / "ran"
    res = fenced(url, "run", "job:busy", "--", "touch", str(marker))
    assert res.returncode == 0
    assert not marker.exists()
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert "skipped 'job:busy'" in lines[0]
    assert f"pid {os.getpid()}" in lines[0] and "task t-42" in lines[0] and "s left" in lines[0]
    quiet = fenced(url, "run", "--quiet", "job:busy", "--", "touch", str(marker))
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    assert not marker.exists()
    assert r.get(ClaimKeys.of("job:busy").skips) == "2"  # skips are counted
    claim.release()


def test_busy_fail_and_wait_timeout_exit_75(url: str, r: Any, tmp_path: Path) -> None:
    claim = held(r, "job:fail")
    marker = tmp_path / "ran"
    res = fenced(url, "run", "--on-busy", "fail", "job:fail", "--", "touch", str(marker))
    assert res.returncode == 75
    assert "busy" in res.stderr and f"pid {os.getpid()}" in res.stderr
    res = fenced(url, "run", "--on-busy", "wait", "--wait-timeout", "0.3", "job:fail", "--", "true")
    assert res.returncode == 75
    assert "gave up waiting" in res.stderr
    assert not marker.exists()
    claim.release()


def test_wait_runs_once_the_holder_lets_go(url: str, r: Any, tmp_path: Path) -> None:
    held(r, "job:wait", ttl=1.0)  # never renewed: its lease ends within a second
    marker = tmp_path / "ran"
    res = fenced(
        url, "run", "--on-busy", "wait", "--wait-timeout", "30", "job:wait", "--", "touch",
        str(marker),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert marker.exists()


def test_wait_timeout_needs_on_busy_wait(url: str) -> None:
    res = fenced(url, "run", "--wait-timeout", "3", "job:x", "--", "true")
    assert res.returncode == 2
    assert "--on-busy wait" in res.stderr


def test_unreachable_redis_exits_69_and_never_starts_the_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    res = fenced(None, "run", "--redis", dead, "job:x", "--", "touch", str(marker))
    assert res.returncode == 69
    assert "cannot reach Redis" in res.stderr and "not started" in res.stderr
    assert dead in res.stderr
    assert not marker.exists()


def test_retries_are_bounded_unless_fenced_redis_retries_says(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fenced import cli

    dead = f"redis://127.0.0.1:{free_port()}/0"

    def policy(client: Any) -> dict[str, Any]:
        return client.connection_pool.connection_kwargs  # type: ignore[no-any-return]

    monkeypatch.delenv("FENCED_REDIS_RETRIES", raising=False)
    retry = policy(cli._client(dead))["retry"]
    # A refused connection is tried twice more; a timeout never (each attempt waited its
    # whole timeout: redis-py's 10 retries of one kept `fenced ls` two minutes).
    assert retry.get_retries() == 2
    assert redis.ConnectionError in retry._supported_errors
    assert redis.TimeoutError not in retry._supported_errors
    for given, retries in (("0", 0), (" 3 ", 3)):
        monkeypatch.setenv("FENCED_REDIS_RETRIES", given)
        options = policy(cli._client(dead))
        assert options["retry"].get_retries() == retries
        if retries:
            # Retried on the errors a dead or slow server gives (named for old redis-py).
            errors = options["retry_on_error"]
            assert redis.ConnectionError in errors and redis.TimeoutError in errors
    for bad in ("-1", "x", "1.5"):
        monkeypatch.setenv("FENCED_REDIS_RETRIES", bad)
        with pytest.raises(SystemExit) as info:
            cli._client(dead)
        assert info.value.code == 2
        assert "FENCED_REDIS_RETRIES" in capsys.readouterr().err


def test_a_port_that_answers_http_is_one_line_and_exit_69(http_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    port = http_url.rsplit(":", 1)[1].split("/")[0]
    for args in (
        ["run", "--redis", http_url, "job:x", "--", "touch", str(marker)],
        ["ls", "--redis", http_url],
        ["show", "--redis", http_url, "job:x"],
    ):
        res = fenced(None, *args)
        assert res.returncode == 69, (args, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr  # no traceback
        assert f"127.0.0.1:{port}" in lines[0]
        assert "not in the Redis protocol" in lines[0] and "host and port" in lines[0]
    assert not marker.exists()


def test_no_redis_url_is_a_usage_error_naming_both_sources() -> None:
    res = fenced(None, "run", "job:x", "--", "true")
    assert res.returncode == 2
    assert "--redis" in res.stderr and "FENCED_REDIS_URL" in res.stderr
    for cmd in (["ls"], ["show", "job:x"]):
        assert fenced(None, *cmd).returncode == 2


def test_command_not_found_exits_127_and_is_recorded(url: str) -> None:
    res = fenced(url, "run", "job:nf", "--", "no-such-command-here")
    assert res.returncode == 127
    run = json.loads(fenced(url, "show", "job:nf", "--json").stdout)["runs"][0]
    assert run["outcome"] == "failed" and "not found" in run["reason"]


def test_command_the_system_cannot_execute_exits_126_not_redis_unreachable(
    url: str, tmp_path: Path
) -> None:
    # No "#!" line: exec fails with ENOEXEC, an OSError that is neither "not found" nor
    # "permission denied". It is the command's fault, not Redis's.
    script = tmp_path / "no-shebang"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    res = fenced(url, "run", "job:noexec", "--", str(script))
    assert res.returncode == 126, res.stderr
    assert "cannot reach Redis" not in res.stderr
    run = json.loads(fenced(url, "show", "job:noexec", "--json").stdout)["runs"][0]
    assert run["outcome"] == "failed" and "not executable" in run["reason"]


TRAP_TERM = """
trap 'echo "$1" > {marker}; exit 0' TERM
trap 'echo usr1 >> {usr1}' USR1
touch {ready}
while :; do sleep 0.05; done
"""


def test_signals_sent_to_fenced_run_reach_the_command(url: str, tmp_path: Path) -> None:
    marker, usr1, ready = tmp_path / "term", tmp_path / "usr1", tmp_path / "ready"
    script = TRAP_TERM.format(marker=marker, usr1=usr1, ready=ready)
    proc = spawn(url, "run", "job:sig", "--", "sh", "-c", script, "sh", "got-term")
    wait_for("the ready file", ready.exists, 30, proc=proc)
    proc.send_signal(signal.SIGUSR1)
    wait_for("the usr1 file", usr1.exists, 30, proc=proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err  # the command trapped it and exited 0
    assert marker.read_text() == "got-term\n"
    assert usr1.read_text() == "usr1\n"


def test_claim_lost_while_running_terminates_the_command_and_exits_76(
    url: str, r: Any, tmp_path: Path
) -> None:
    marker, ready = tmp_path / "term", tmp_path / "ready"
    script = TRAP_TERM.format(marker=marker, usr1=tmp_path / "u", ready=ready)
    proc = spawn(url, "run", "--ttl", "1.5", "job:lost", "--", "sh", "-c", script, "sh", "t")
    wait_for("the ready file", ready.exists, 30, proc=proc)
    r.set(ClaimKeys.of("job:lost").lock, "someone-else", px=60_000)  # a stale-lock "fix"
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 76, err
    assert marker.read_text() == "t\n"
    assert "lost" in err
    assert r.get(ClaimKeys.of("job:lost").lock) == "someone-else"  # left alone
    run = json.loads(fenced(url, "show", "job:lost", "--json").stdout)["runs"][0]
    assert run["outcome"] == "lost"


def test_command_ignoring_sigterm_is_killed_after_the_grace(
    url: str, r: Any, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    script = f"trap '' TERM; touch {ready}; while :; do sleep 0.05; done"
    proc = spawn(
        url, "run", "--ttl", "1.5", "--grace", "0.5", "job:stubborn", "--", "sh", "-c", script
    )
    wait_for("the ready file", ready.exists, 30, proc=proc)
    r.delete(ClaimKeys.of("job:stubborn").lock)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 76, err
    run = json.loads(fenced(url, "show", "job:stubborn", "--json").stdout)["runs"][0]
    assert run["outcome"] == "lost" and "SIGKILL" in run["reason"]


def test_redis_gone_mid_run_stops_the_command(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    with RedisServer() as own:
        proc = spawn(
            own.url, "run", "--ttl", "1.5", "--grace", "1", "job:gone", "--", "sh", "-c",
            f"touch {ready}; sleep 60",
        )  # fmt: skip
        wait_for("the ready file", ready.exists, 30, proc=proc)
        own.kill()
        _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 76, err


# -- fenced ls ----------------------------------------------------------------------------


def test_ls_lists_held_claims_with_holder_age_fence_skips_and_last_outcome(
    url: str, r: Any
) -> None:
    assert "no claims held" in fenced(url, "ls").stdout
    assert fenced(url, "ls", "--json").stdout.strip() == "[]"
    first = held(r, "report:acme", records=True, task_id="t-1")
    first.release(outcome="failed", reason="boom")
    claim = held(r, "report:acme", records=True, task_id="t-2")
    for _ in range(3):
        assert not Claim(r, "report:acme", records=True).acquire()
    other = held(r, "report:beta", records=True)
    held(r, "elsewhere", namespace="other")

    res = fenced(url, "ls", "--json")
    assert res.returncode == 0, res.stderr
    infos = {i["name"]: i for i in json.loads(res.stdout)}
    assert set(infos) == {"report:acme", "report:beta"}
    acme = infos["report:acme"]
    assert acme["holder"]["pid"] == os.getpid() and acme["holder"]["task_id"] == "t-2"
    assert acme["fence"] == claim.fence
    assert acme["skips"] == 3
    assert acme["last_outcome"] == "failed"
    assert 0 <= acme["age"] < 30
    assert 0 < acme["expires_in"] <= 30
    assert infos["report:beta"]["last_outcome"] is None
    assert infos["report:beta"]["fence"] == other.fence

    text = fenced(url, "ls").stdout
    assert "report:acme" in text and "task t-2" in text and "failed" in text
    assert "2 held in namespace 'fenced'" in text
    ns = json.loads(fenced(url, "ls", "--namespace", "other", "--json").stdout)
    assert [i["name"] for i in ns] == ["elsewhere"]


def test_ls_finds_the_age_of_a_run_behind_many_skips(url: str, r: Any) -> None:
    held(r, "busy:job", records=True)
    for _ in range(40):  # more entries than the first read looks at
        Claim(r, "busy:job", records=True).acquire()
    (info,) = json.loads(fenced(url, "ls", "--json").stdout)
    assert info["skips"] == 40
    assert info["age"] is not None


def test_ls_and_show_count_no_skips_of_a_holder_released_by_hand_beside_the_next(
    url: str, r: Any
) -> None:
    held(r, "sync:stale", records=True)
    for _ in range(2):
        assert not Claim(r, "sync:stale", records=True).acquire()
    (info,) = json.loads(fenced(url, "ls", "--json").stdout)
    assert info["skips"] == 2
    # The title wraps where the terminal ends (its length varies with the host and pid).
    shown = " ".join(fenced(url, "show", "sync:stale").stdout.split())
    assert "2 consecutive skips" in shown
    cleared = fenced(url, "release", "sync:stale", "--force", "--reason", "hung")
    assert cleared.returncode == 0, cleared.stderr
    fresh = held(r, "sync:stale", records=True)
    (info,) = json.loads(fenced(url, "ls", "--json").stdout)
    assert info["skips"] == 0 and info["fence"] == fresh.fence
    assert json.loads(fenced(url, "show", "sync:stale", "--json").stdout)["skips"] == 0
    assert "consecutive skip" not in fenced(url, "show", "sync:stale").stdout
    assert not Claim(r, "sync:stale", records=True).acquire()
    (info,) = json.loads(fenced(url, "ls", "--json").stdout)
    assert info["skips"] == 1
    assert json.loads(fenced(url, "show", "sync:stale", "--json").stdout)["skips"] == 1
    shown = " ".join(fenced(url, "show", "sync:stale").stdout.split())
    assert "left; 1 consecutive skip " in shown


def test_ls_watch_redraws_until_interrupted(url: str, r: Any) -> None:
    held(r, "watched")
    proc = spawn(url, "ls", "--watch", "--json", "--interval", "0.2")
    assert proc.stdout is not None
    first = json.loads(proc.stdout.readline())
    second = json.loads(proc.stdout.readline())
    assert [i["name"] for i in first] == [i["name"] for i in second] == ["watched"]
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=30)
    assert proc.returncode == 0

    clients = r.info("clients")["connected_clients"]
    proc = spawn(url, "ls", "--watch", "--interval", "0.2")
    # Interrupted once it watches (it has connected), not while it still imports.
    wait_for("ls --watch to connect", lambda: r.info("clients")["connected_clients"] > clients)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "watched" in out


def at_columns(url: str, columns: int, *args: str) -> list[str]:
    env = {**env_for(url), "COLUMNS": str(columns)}
    res = subprocess.run([*FENCED, *args], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return [line.rstrip() for line in res.stdout.splitlines()]


def test_ls_and_show_read_well_at_80_columns(url: str, r: Any) -> None:
    task = "5f0c2a9e-8d47-4b1e-9c3a-7e6f1d2b4a58"
    name = "rebuild:tiles:europe-west-" + "x" * 30
    held(r, name, records=True, task_id=task)
    held(r, "report:acme", records=True, task_id="6a1d3b0f-2c58-4e7a-8b9d-0f1e2d3c4b5a")
    command = "echo " + "building the europe tiles " * 3 + "; exit 3"
    for _ in range(3):
        fenced(url, "run", "--record-command", "nightly:tiles", "--", "sh", "-c", command)

    lines = at_columns(url, 80, "ls")
    assert max(map(len, lines)) <= 80, lines
    # The title, then two lines per claim; the long name's head (80 columns with its
    # fence) wraps before its token, which keeps a line of its own.
    assert len(lines) == 1 + 2 * 2 + 1, lines
    assert any(line.startswith(name + "  fence ") for line in lines)  # a line of its own
    assert lines[2].startswith("token ") and "  token " in lines[4], lines
    assert any(f"task {task[:8]}…" in line for line in lines)
    assert all(task not in line for line in lines)  # the whole id: --json and --wide

    lines = at_columns(url, 80, "show", "nightly:tiles")
    assert max(map(len, lines)) <= 80, lines
    assert len(lines) <= 2 + 3 * 3  # title and a blank, then at most 3 lines per run
    assert sum("failed" in line for line in lines) == 3
    assert "building the europe tiles" in "".join(lines)  # the detail is readable

    wide = at_columns(url, 80, "ls", "--wide")
    assert any(task in line and name in line for line in wide)  # one row per claim
    wide = at_columns(url, 80, "show", "--wide", "nightly:tiles")
    assert sum(command[:40] in line for line in wide) == 3


def pending(r: Any) -> None:
    """A name its rate (one start an hour) holds back, and one with a burst of 3 calls
    pending (debounce 300 s), as a claim and a debounced task's calls write them."""
    from fenced.celery import _debounce

    with Claim(r, "sync:rated", ttl=30, heartbeat=False, rate="1/h"):
        pass
    for i in range(3):
        _debounce.join(r, ClaimKeys.of("digest:acme"), f"task-{i}", "[]", 600, 300.0)


def test_ls_and_show_say_when_a_rate_allows_the_next_start_and_a_burst_runs(
    url: str, r: Any
) -> None:
    pending(r)
    listed = {i["name"]: i for i in json.loads(fenced(url, "ls", "--json").stdout)}
    rated = listed["sync:rated"]
    assert rated["holder"] is None and rated["burst"] is None
    assert 3500 < rated["rate"]["wait"] <= 3600 and rated["rate"]["next_start"] > time.time()
    burst = listed["digest:acme"]["burst"]
    assert listed["digest:acme"]["rate"] is None
    assert (burst["task_id"], burst["calls"]) == ("task-0", 3)
    assert burst["first"] <= burst["last"] < burst["due"] and 200 < burst["runs_in"] <= 300

    for columns in (80, 200):
        text = " ".join(at_columns(url, columns, "ls"))
        assert "0 held in namespace 'fenced', 2 not held" in text
        assert "rate limited: next start in 59m" in text
        assert "burst pending: 3 calls, runs in 4m" in text
    text = " ".join(at_columns(url, 200, "show", "sync:rated"))
    assert "sync:rated: not held; rate limited until " in text and "next start in 59m" in text
    text = " ".join(at_columns(url, 200, "show", "digest:acme"))
    assert "burst pending: 3 calls, runs in 4m" in text and "(task task-0)" in text
    shown = json.loads(fenced(url, "show", "digest:acme", "--json").stdout)
    assert shown["burst"]["calls"] == 3 and shown["rate"] is None


def test_show_says_a_run_was_replaced_and_by_whom(url: str, r: Any) -> None:
    old = held(r, "sync:replaced", records=True, task_id="t-old")
    new = Claim(r, "sync:replaced", ttl=30, heartbeat=False, records=True, task_id="t-new")
    assert new.replace() and new.token is not None
    old.release()
    text = " ".join(" ".join(at_columns(url, 200, "show", "sync:replaced")).split())
    assert "lost" in text and f"replaced by {new.token[:8]} (" in text, text
    assert "task t-new)" in text


def test_show_says_what_a_hashed_value_was_without_its_secrets(url: str, r: Any) -> None:
    feed = "https://reader:s3cret@feeds.example.com/v2/incidents.xml?key=abc123"

    @exclusive("feed:{url}", redis=r, ttl=10)
    def fetch(url: str) -> None:
        pass

    fetch(feed)
    name = claim_name("feed:{url}", url=feed)
    (run,) = json.loads(fenced(url, "show", name, "--json").stdout)["runs"]
    assert run["extra"]["args"] == {"url": hash_value(feed)}
    readable = run["extra"]["arg_text"]["url"]
    assert readable.startswith("https://feeds.example.com/v2/incidents") and len(readable) <= 40
    text = "\n".join(at_columns(url, 80, "show", name))
    assert f"url={readable} ({hash_value(feed)[:11]}…)" in text
    for secret in ("s3cret", "reader", "abc123"):
        assert secret not in text and secret not in json.dumps(run)


# -- fenced show --------------------------------------------------------------------------


def test_show_lists_runs_newest_first(url: str) -> None:
    fenced(url, "run", "--record-command", "nightly", "--", "sh", "-c", "exit 3")
    fenced(url, "run", "--record-command", "nightly", "--", "true")
    res = fenced(url, "show", "nightly", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["holder"] is None
    assert [run["outcome"] for run in report["runs"]] == ["ok", "failed"]
    assert [run["extra"]["command"] for run in report["runs"]] == ["true", "sh -c 'exit 3'"]
    limited = json.loads(fenced(url, "show", "nightly", "--limit", "1", "--json").stdout)
    assert len(limited["runs"]) == 1
    text = fenced(url, "show", "nightly").stdout
    assert "nightly: not held" in text
    assert text.index(" ok ") < text.index("failed")
    assert "$ true" in text and "exit status 3" in text
    assert "no run recorded: " in fenced(url, "show", "never-ran").stdout


def test_show_says_when_only_skips_are_recorded(url: str) -> None:
    client = redis.Redis.from_url(url)
    with Claim(client, "unrecorded", ttl=5):  # records off: only the skips are kept
        for _ in range(2):
            assert not Claim(client, "unrecorded", ttl=5).acquire()
    text = " ".join(fenced(url, "show", "unrecorded").stdout.split())
    assert "no run recorded (only skips): this name's runs are not recorded" in text, text


def test_usage_mistakes_get_one_clean_line(url: str) -> None:
    res = fenced(url, "run", "--on-busy", "skipp", "x", "--", "true")
    assert res.returncode == 2
    text = flat(res.stderr)
    assert "'skipp' is not one of skip, wait, raise, replace; did you mean skip?" in text, text
    assert "Value error" not in text
    for cmd in (["run", "x", "--", "true"], ["ls"]):
        res = fenced(url, *cmd[:1], "--redis", url + "?socket_timout=3", *cmd[1:])
        assert res.returncode == 2, res.stderr
        assert "socket_timout=3" in res.stderr and "did you mean socket_timeout?" in res.stderr


def test_a_server_that_is_not_redis_gets_a_hint() -> None:
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]

    def close_each() -> None:  # as PostgreSQL does to a client that speaks RESP
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(1024)
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    try:
        res = fenced(None, "ls", "--redis", f"redis://127.0.0.1:{port}/0")
    finally:
        listener.close()
    assert res.returncode == 69, res.stderr
    assert "Not a Redis server? Check the host and port" in flat(res.stderr), res.stderr


def test_piped_output_never_cuts_a_value(url: str) -> None:
    name = "piped:" + "n" * 90
    label = "label-" + "l" * 60
    env = {k: v for k, v in env_for(url).items() if k != "COLUMNS"}  # as a pipe in cron

    def piped(*args: str) -> str:
        return subprocess.run([*FENCED, *args], capture_output=True, text=True, env=env).stdout

    holder = spawn(url, "run", "--ttl", "10", "--label", label, name, "--", "sleep", "30")
    try:
        wait_for("the run to hold", lambda: name in piped("ls"), proc=holder)
        listing = piped("ls")
        assert any(name in line for line in listing.splitlines()), listing
        assert "previous run" in listing
        shown = piped("show", name)
        assert any(name in line for line in shown.splitlines()), shown
    finally:
        holder.terminate()
        holder.wait(timeout=30)


class _Counting(redis.Connection):
    """A connection that counts what it sends: one send is one round trip."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def _shown(report: ClaimReport) -> dict[str, Any]:
    """A report as JSON, without the times left (the two reads are moments apart)."""
    shown = report.as_dict()
    for holder in [shown["holder"], *shown["slots"]]:
        if holder:
            holder["expires_in"] = holder["expires_in"] is not None
    shown["cooldown_left"] = shown["cooldown_left"] is not None
    return shown


def test_show_reads_a_claim_in_one_round_trip_and_as_it_reads_part_by_part(
    redis_server: RedisServer, r: Any
) -> None:
    r.flushall()
    counted = redis.Redis(
        connection_pool=redis.ConnectionPool(
            connection_class=_Counting,
            host="127.0.0.1",
            port=redis_server.port,
            decode_responses=True,
        )
    )
    assert counted.ping()
    plain = held(r, "plain", records=True, task_id="t-plain")
    with Claim(r, "cooled", ttl=30, cooldown=60, records=True):
        pass
    several = [held(r, "several", limit=3, records=True, task_id=f"t{i}") for i in range(2)]
    several[0].release()
    r.set(ClaimKeys("fenced", "odd").slots, "not a hash")  # WRONGTYPE: read as a plain claim
    r.set(ClaimKeys("fenced", "odd").runs, "not a stream")
    held(r, "odd", task_id="t-odd")
    for name in ("plain", "cooled", "several", "odd", "never-ran"):
        before = _Counting.sends
        report = show_claim(counted, name)
        assert _Counting.sends - before == 1, name
        assert _shown(report) == _shown(_show_apart(r, ClaimKeys("fenced", name), 20)), name
    shown, read = show_claim(counted, "plain").holder, read_holder(r, "plain")
    assert shown and read and (shown.token, shown.fence) == (read.token, read.fence)
    assert plain.fence is not None and show_claim(counted, "plain").runs[0].fence == plain.fence
    report = show_claim(counted, "several")
    assert report.limit == 3 and [i for i, _h in report.slots] == [1]
    assert 55 < (show_claim(counted, "cooled").cooldown_left or 0) <= 60
    assert show_claim(counted, "odd").runs[0].unreadable
    counted.close()


# -- fenced release -----------------------------------------------------------------------


def test_release_refuses_without_force(url: str, r: Any) -> None:
    claim = held(r, "stale")
    res = fenced(url, "release", "stale", "--reason", "x")
    assert res.returncode == 1
    assert "--force" in res.stderr and f"pid {os.getpid()}" in res.stderr
    # The command to clear that holder, and only it, should another take the name since.
    assert f"--token {str(claim.token)[:8]}" in res.stderr
    assert r.exists(ClaimKeys.of("stale").lock)
    res = fenced(url, "release", "stale", "--force")
    assert res.returncode == 2 and "--reason" in res.stderr
    assert r.exists(ClaimKeys.of("stale").lock)


def test_release_clears_a_stale_claim_and_records_who_and_why(url: str, r: Any) -> None:
    claim = held(r, "stale", records=True)
    prefix = claim.token.split(":", 1)[0][:8] if claim.token else ""
    wrong = fenced(url, "release", "stale", "--force", "--reason", "x", "--token", "ffff0000")
    assert wrong.returncode == 1 and "another token" in wrong.stdout
    res = fenced(
        url, "release", "stale", "--force", "--reason", "holder died at 02:00", "--token", prefix
    )
    assert res.returncode == 0, res.stderr
    assert "released 'stale'" in res.stdout and f"pid {os.getpid()}" in res.stdout
    assert not r.exists(ClaimKeys.of("stale").lock)
    run = json.loads(fenced(url, "show", "stale", "--json").stdout)["runs"][0]
    assert run["outcome"] == "released"
    assert run["reason"] == "holder died at 02:00"
    assert "@" in run["extra"]["by"]
    again = fenced(url, "release", "stale", "--force", "--reason", "again", "--json")
    assert again.returncode == 0
    assert json.loads(again.stdout)["released"] is False
    assert "nothing held" in fenced(url, "release", "stale", "--force", "--reason", "x").stdout
    assert claim.release() is False  # the old holder's release leaves things alone


def test_release_of_a_running_command_stops_it_and_both_are_recorded(
    url: str, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    proc = spawn(
        url, "run", "--ttl", "1.5", "job:rel", "--", "sh", "-c", f"touch {ready}; sleep 60"
    )
    wait_for("the ready file", ready.exists, 30, proc=proc)
    res = fenced(url, "release", "job:rel", "--force", "--reason", "hung", "--json")
    assert json.loads(res.stdout)["released"] is True
    proc.communicate(timeout=30)
    assert proc.returncode == 76
    runs = json.loads(fenced(url, "show", "job:rel", "--json").stdout)["runs"]
    assert [run["outcome"] for run in runs] == ["released", "lost"]
    assert runs[0]["reason"] == "hung"


def test_run_durations_take_units(url: str, r: Any, tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    proc = spawn(
        url, "run", "--ttl", "10m", "--grace", "1s", "--on-busy", "wait", "--wait-timeout",
        "1m", "job:units", "--", "sh", "-c", f"touch {ready}; sleep 60",
    )  # fmt: skip
    try:
        wait_for("the ready file", ready.exists, 30, proc=proc)
        left = r.pttl("fenced:{job:units}:lock")
        assert 590_000 < left <= 600_000, left  # ten minutes, not ten seconds
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_release_takes_the_token_ls_json_prints_and_a_refusal_names_the_holder(
    url: str, r: Any
) -> None:
    claim = held(r, "stale:tok", task_id="t-9")
    (info,) = json.loads(fenced(url, "ls", "--json").stdout)
    shown = info["holder"]["token"]
    assert claim.token and claim.token.startswith(shown) and shown != claim.token
    refused = fenced(
        url, "release", "stale:tok", "--force", "--reason", "x", "--token", "0000", "--json"
    )
    assert refused.returncode == 1
    answer = json.loads(refused.stdout)
    assert answer["released"] is False
    assert answer["holder"]["token"] == shown and answer["holder"]["task_id"] == "t-9"
    assert r.exists(ClaimKeys.of("stale:tok").lock)
    empty = fenced(url, "release", "stale:tok", "--force", "--reason", "x", "--token", "…")
    assert empty.returncode == 2 and "names no prefix" in empty.stderr
    assert r.exists(ClaimKeys.of("stale:tok").lock)  # not taken as "any holder"
    res = fenced(
        url, "release", "stale:tok", "--force", "--reason", "x", "--token", shown, "--json"
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["released"] is True
    assert not r.exists(ClaimKeys.of("stale:tok").lock)


def test_run_without_a_name_before_the_separator_is_a_usage_error(
    url: str, r: Any, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    for args in (["--", "touch", str(marker)], ["--ttl", "5", "--", "touch", str(marker)]):
        res = fenced(url, "run", *args)
        assert res.returncode == 2, res.stdout + res.stderr
        assert "a claim name is needed before '--'" in res.stderr
    assert not marker.exists()
    assert r.keys("*") == []  # no claim was taken under the command's name


def test_run_with_command_options_and_no_separator_hints_at_it(url: str) -> None:
    res = fenced(url, "run", "job:ls", "ls", "-la")
    assert res.returncode == 2
    assert "put '--' before the command" in res.stderr
    assert "fenced run NAME -- CMD" in res.stderr


def test_run_json_prints_one_line_of_what_happened(url: str, r: Any) -> None:
    res = fenced(url, "run", "--json", "job:json", "--", "sh", "-c", "exit 3")
    assert res.returncode == 3, res.stderr
    ran = json.loads(res.stdout)
    assert (ran["name"], ran["ran"], ran["outcome"], ran["exit"]) == (
        "job:json", True, "failed", 3,
    )  # fmt: skip
    assert ran["reason"] == "exit status 3" and ran["fence"] > 0 and ran["holder"] is None
    claim = held(r, "job:json", task_id="t-7")
    res = fenced(url, "run", "--json", "--quiet", "job:json", "--", "true")
    assert (res.returncode, res.stderr) == (0, "")
    skipped = json.loads(res.stdout)
    assert (skipped["ran"], skipped["outcome"], skipped["exit"]) == (False, "skipped", 0)
    assert skipped["holder"]["task_id"] == "t-7"
    assert claim.token and claim.token.startswith(skipped["holder"]["token"])
    res = fenced(url, "run", "--json", "--on-busy", "raise", "job:json", "--", "true")
    assert res.returncode == 75
    assert json.loads(res.stdout)["outcome"] == "busy"


def flat(text: str) -> str:
    """Error text with the frame and line breaks of a boxed message taken out."""
    return " ".join(text.replace("│", " ").split())


def test_version_and_namespace_follow_one_rule(url: str) -> None:
    from fenced import __version__

    for args in (["--version"], ["version"]):
        res = fenced(None, *args)
        assert (res.returncode, res.stdout.strip()) == (0, __version__), res.stderr
    top = fenced(None, "--help").stdout
    assert "--version" in top
    for sub in ("", "run", "ls", "show", "release", "doctor", "demo"):
        text = fenced(None, *sub.split(), "--help").stdout
        assert "Usage:" in text, sub
        assert "<bool>" not in text and "--namespace <str>" not in text, text
    for bad in ("", "a{b"):
        for cmd in (["ls"], ["show", "x"], ["run", "x", "--", "true"]):
            res = fenced(url, *cmd[:1], "--namespace", bad, *cmd[1:])
            assert res.returncode == 2, (cmd, bad, res.stdout)
            assert "non-empty prefix without braces" in flat(res.stderr), res.stderr


def test_run_ttl_hints_name_only_options_the_command_has(url: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for ttl, hint in (
        ("inf", "e.g. 90, 30s, 5m"),
        ("1e400", "e.g. 90, 30s, 5m"),
        ("0.01", "e.g. --ttl 30"),
        ("10 minutes", "e.g. 90, 30s, 5m"),
    ):
        res = fenced(url, "run", "--ttl", ttl, "job:ttl", "--", "touch", str(marker))
        assert res.returncode == 2, res.stdout + res.stderr
        text = flat(res.stderr)
        assert "--ttl" in text and hint in text, text
        for python_only in ("refresh_every", "idle_ttl", "records=", "ttl="):
            assert python_only not in text, text
    assert not marker.exists()
    res = fenced(url, "run", "--ttl", "1e9", "job:ttl", "--", "touch", str(marker))
    assert res.returncode == 0, res.stderr  # a long lease is a choice, not a mistake
    assert marker.exists()


def test_run_takes_the_claim_options_as_the_struct_declares_them(url: str, tmp_path: Path) -> None:
    """Each claim flag of `fenced run` is a ClaimOptions field: its help is the field's
    help, and a bad value is refused by the struct's own check, spelled as a flag."""
    from fenced._options import HELP
    from fenced._run import RUN_CLAIM_OPTIONS

    text = " ".join(fenced(None, "run", "--help").stdout.split())
    for name in RUN_CLAIM_OPTIONS:
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
        first_words = " ".join(HELP[name].split()[1:5])  # beyond its first word and names
        assert first_words in text, (flag, first_words)
    marker = tmp_path / "ran"
    res = fenced(url, "run", "--ttl", "2", "--refresh-every", "1.5", "j:r", "--", "true")
    assert res.returncode == 2 and "--refresh-every" in flat(res.stderr), res.stderr
    assert "refresh_every" not in res.stderr
    res = fenced(url, "run", "--max-records", "0", "j:r", "--", "true")
    assert res.returncode == 2 and "--max-records" in flat(res.stderr), res.stderr
    res = fenced(
        url,
        "run",
        "--json",
        "--refresh-every",
        "0.5s",
        "--max-records",
        "5",
        "j:r",
        "--",
        "touch",
        str(marker),
    )
    assert res.returncode == 0 and marker.exists(), res.stderr
    assert json.loads(res.stdout)["outcome"] == "ok"

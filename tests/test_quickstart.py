"""The README's quick start, run as written: its five commands against a redis-server
this test owns (in place of the one on port 6379), and the doctor finding nothing."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from _wait import wait_for
from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
SECTION = "## Use it in your project"


def commands() -> list[str]:
    """The command lines of the quick start's shell block that starts a Redis."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("\n", 1)[1] for b in section.split("```sh\n")[1:]]
    (block,) = [b.split("```", 1)[0] for b in blocks if "redis-server" in b]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with RedisServer() as server:
        yield server.url.rsplit("/", 1)[0]  # redis://127.0.0.1:PORT


def env(base: str) -> dict[str, str]:
    return dict(
        os.environ,
        CELERY_BROKER_URL=f"{base}/0",
        FENCED_REDIS_URL=f"{base}/1",
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        COLUMNS="120",
    )


def argv(line: str, base: str) -> list[str]:
    """A line as this test runs it: its own Redis, this interpreter."""
    words = shlex.split(line.replace("redis://localhost:6379", base))
    if words[0] == "fenced":
        return [sys.executable, "-m", "fenced.cli", *words[1:]]
    if words[0] in ("celery", "python"):
        return [sys.executable, *(["-m", "celery"] if words[0] == "celery" else []), *words[1:]]
    raise AssertionError(f"a command this test does not know: {line}")


def run(line: str, base: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv(line, base), capture_output=True, text=True, env=env(base), cwd=ROOT, timeout=120
    )


def test_the_five_commands(base: str, tmp_path: Path) -> None:
    lines = commands()
    assert [line.split()[0] for line in lines] == [
        "redis-server",
        "celery",
        "python",
        "fenced",
        "fenced",
    ]
    assert "6379" in lines[0]  # the server this test owns stands in for it
    log = tmp_path / "worker.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv(lines[1], base),
            cwd=ROOT,
            env=env(base),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def ready() -> bool:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        return " ready." in log.read_text(errors="replace")

    try:
        wait_for("the quick start's worker to be ready", ready, 90)
        sent = run(lines[2], base)
        assert sent.returncode == 0, sent.stderr
        assert "'status': 'skipped'" in sent.stdout and "already running" in sent.stdout, sent
        show = run(lines[3], base)
        assert show.returncode == 0, show.stderr
        assert "report:acme" in show.stdout and "skipped" in show.stdout, show.stdout
        ls = run(lines[4], base)
        assert ls.returncode == 0, ls.stderr
        assert "report:acme" in ls.stdout, ls.stdout
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_the_doctor_finds_nothing(base: str) -> None:
    res = run("fenced doctor --json --app examples.quickstart.app", base)
    report = json.loads(res.stdout)
    found = [f for f in report["findings"] if f["severity"] != "info"]
    assert res.returncode == 0 and not found, found
    codes = {f["code"] for f in report["findings"]}
    assert "celery.claimed-tasks" in codes  # it did look at the task

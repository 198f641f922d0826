"""The code blocks of README.md and docs/*.md, executed: they cannot drift from the code.

Every ``python`` block runs as pasted, with nothing but the environment a reader sets
(``FENCED_REDIS_URL``, ``CELERY_BROKER_URL``) pointing at a redis-server this module
starts; a block marked ``<!-- fragment: see examples/... -->`` names the example that
runs it instead. A migration block (``# before`` / ``# after``) also runs each half
apart, after the lines above them. ``fenced ...`` lines of the shell blocks run as the
command line (the documented ``redis://localhost:6379`` is that server); every other
line is listed in ``NOT_RUN`` with the reason. The error tree and the source layout are
checked against the package; JSON samples parse.
"""

from __future__ import annotations

import builtins
import contextlib
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

import fenced
from fenced import Claim
from fenced.celery import ClaimedTask
from fenced.celery._options import lock_redis
from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: A block that does not run on its own says which file under examples/ runs it.
FRAGMENT = re.compile(r"^<!-- fragment: see (\S+) -->$")

# Shell lines that do not run here, each with why: a line (its words, comments left out)
# that is a key, or starts with one.
NOT_RUN = {
    "make demo": "sets up a virtualenv first; tests/test_demo.py runs `fenced demo`",
    "make test": "the whole suite; it runs this test among the others",
    "pip install fenced[celery,cli]": (
        "installs; `make dist` installs the wheel, and each extra alone (scripts/check_extras.py)"
    ),
    "pip install /path/to/fenced[celery,cli]": (
        "installs from a checkout: tests/test_quickstart.py runs the checkout, and `make dist` "
        "each extra of its wheel alone"
    ),
    "pip install $(ls /path/to/fenced/dist/fenced-*.whl)[celery,cli]": (
        "installs a wheel: `make dist` builds it and installs each extra alone"
    ),
    "pip install fenced[web]": "installs; `make dist` installs the wheel",
    "fenced web": "serves until stopped: tests/test_web.py runs the dashboard over HTTP",
    "celery -A proj beat -S fenced.celery.beat:Scheduler": (
        "runs until stopped: tests/test_celery_beat_faults.py runs three beats and a worker"
    ),
    "holder=$(curl -s http://127.0.0.1:8377/api/claims/backup:db": (
        "needs a running `fenced web`: tests/test_security_web_release.py reads the holder "
        "and releases it over HTTP"
    ),
    "curl -s -X POST http://127.0.0.1:8377/api/claims/backup:db/release": (
        "needs a running `fenced web --allow-release` and its token file: tests/test_web.py "
        "releases through the API"
    ),
    "*/5 * * * * fenced run --redis redis://locks:6379/1 --quiet backup:db": (
        "a crontab line around the reader's own backup script; `fenced run` runs in the "
        "README's block and tests/test_cli.py"
    ),
    "*/5 * * * * fenced run --redis redis://locks:6379/1 --quiet --metrics-file": (
        "a crontab line writing node_exporter's directory: tests/test_metrics.py runs "
        "`fenced run --metrics-file`"
    ),
    "0 2 * * * fenced run --redis redis://locks:6379/1 --cooldown 1h report:nightly": (
        "a crontab line around the reader's own report script: tests/test_cooldown.py fires "
        "two such `fenced run --cooldown` lines together"
    ),
    "rm -rf /run/fenced-metrics": "empties a directory of the host's: part of a worker's start",
    "PROMETHEUS_MULTIPROC_DIR=/run/fenced-metrics celery -A proj worker": (
        "a worker, serving until stopped: tests/test_metrics.py starts prefork workers with "
        "a multiprocess directory"
    ),
    "fenced release report:acme --force --reason worker host lost --token 1a2b3c4d": (
        "1a2b3c4d stands for the token prefix `fenced ls --json` printed: tests/test_cli.py "
        "releases by token prefix"
    ),
}


def not_run(line: str) -> bool:
    return any(line == key or line.startswith(key + " ") for key in NOT_RUN)


# A cron line: five schedule fields, then the command.
CRON = re.compile(r"^([0-9*/,-]+\s+){5}(?=\S)")


@dataclass(frozen=True)
class Block:
    section: str  # the ## heading the block is under
    heading: str  # the nearest heading
    lang: str  # the fence's info string ("" for none)
    text: str
    line: int  # the line of the block's first line of code
    path: Path = README
    fragment: str | None = None  # the example that runs it, for a marked fragment


def parse(text: str, path: Path = README) -> list[Block]:
    """Every fenced code block of a Markdown text, with the headings it sits under."""
    blocks: list[Block] = []
    section = heading = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):  # also one indented in a list item
            indent = line[: len(line) - len(line.lstrip())]
            lang, start, body = line.strip()[3:].strip(), i + 1, []
            marker = FRAGMENT.match(lines[i - 1].strip()) if i else None
            i += 1
            while not lines[i].lstrip().startswith("```"):
                body.append(lines[i].removeprefix(indent))
                i += 1
            text = "\n".join(body) + "\n"
            fragment = marker.group(1) if marker else None
            blocks.append(Block(section, heading, lang, text, start + 1, path, fragment))
        elif line.startswith("## "):
            section = heading = line[3:].strip()
        elif line.startswith("### "):
            heading = line[4:].strip()
        i += 1
    return blocks


BLOCKS = parse(README.read_text(encoding="utf-8"))
DOC_BLOCKS = [b for p in DOCS[1:] for b in parse(p.read_text(encoding="utf-8"), p)]


def halves(block: Block) -> list[str]:
    """A migration block's ``# before`` and ``# after`` parts, each after the lines above
    them (the set-up both share); none for another block."""
    lines = block.text.splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if line.strip() in ("# before", "# after")]
    if not cut:
        return []
    assert [lines[i].strip() for i in cut] == ["# before", "# after"], block
    before, after = cut
    setup = "".join(lines[:before])
    # Blank lines keep each half's line numbers those of the page.
    gap = "\n" * (after - before)
    return [setup + "".join(lines[before:after]), setup + gap + "".join(lines[after:])]


def execute(block: Block, code: str | None = None) -> None:
    """Run a block (or part of it) as a reader would, with nothing defined beforehand;
    then each claimed task it defines, with and without its claim held."""
    ns: dict[str, Any] = {"__name__": "__main__"}
    source = "\n" * (block.line - 1) + (block.text if code is None else code)
    exec(compile(source, str(block.path), "exec"), ns)
    for value in list(ns.values()):
        if isinstance(value, ClaimedTask):
            check_claimed_task(value)


# -- shell ----------------------------------------------------------------------


def commands(block: Block, cron: bool = True) -> list[str]:
    """The command lines of a shell block (``\\`` continuations joined); with ``cron``, a
    cron line's command part."""
    out = []
    for raw in block.text.replace("\\\n", " ").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        out.append(CRON.sub("", line) if cron else line)
    return out


def run_fenced(argv: list[str], url: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        FENCED_REDIS_URL=url,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(workdir)]),
        COLUMNS="120",
    )
    return subprocess.run(
        [sys.executable, "-m", "fenced.cli", *argv[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=workdir,
    )


def run_lines(lines: list[str], url: str, base: str, workdir: Path) -> None:
    """Run each ``fenced`` line (``redis://localhost:6379`` is the test's server); any
    other line, or one that cannot run here, must be in NOT_RUN."""
    for line in lines:
        argv = shlex.split(line, comments=True)
        if argv[0] != "fenced" or not_run(" ".join(argv)):
            assert not_run(" ".join(argv)), f"{line!r}: run it here or say in NOT_RUN why not"
            continue
        argv = [word.replace("redis://localhost:6379", base) for word in argv]
        res = run_fenced(argv, url, workdir)
        assert res.returncode == 0, (line, res.stdout, res.stderr)


# -- fixtures -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _shared_tasks_stay_here() -> Iterator[None]:
    """The blocks' tasks are Celery's shared tasks (``@app.task`` shares by default):
    every app made later in this process would get them, the doctor's test apps
    included. Each test takes back the ones its blocks added."""
    import celery._state

    finalizers: set[Any] = getattr(celery._state, "_on_app_finalizers")  # noqa: B009
    before = set(finalizers)
    yield
    finalizers.intersection_update(before)


@pytest.fixture
def base(redis_server: RedisServer) -> str:
    """The test's server, emptied: ``redis://127.0.0.1:PORT``."""
    redis_server.client().flushall()
    return redis_server.url.rsplit("/", 1)[0]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the blocks' relative paths land, with the reader's project in it: ``proj``,
    the quick start's app copied in as the README says."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    app = (ROOT / "examples" / "quickstart" / "app.py").read_text(encoding="utf-8")
    (tmp_path / "proj" / "celery.py").write_text(app, encoding="utf-8")
    return tmp_path


# -- the tests ------------------------------------------------------------------


def test_parse_finds_every_block() -> None:
    langs = {b.lang for b in BLOCKS}
    assert langs <= {"python", "sh", ""}, langs  # a new kind of block needs a runner here
    assert sum(b.lang == "python" for b in BLOCKS) >= 5
    assert sum(b.lang == "python" for b in DOC_BLOCKS) >= 20
    # console: a session's output; json: the API's answers; none: diagrams and layouts
    assert {b.lang for b in DOC_BLOCKS} <= {"python", "sh", "console", "json", ""}
    assert all(b.text.strip() for b in BLOCKS + DOC_BLOCKS)


@pytest.fixture
def pasted(base: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The environment a reader's blocks read: the claims' Redis, Celery's broker."""
    monkeypatch.setenv("FENCED_REDIS_URL", f"{base}/1")
    monkeypatch.setenv("CELERY_BROKER_URL", f"{base}/0")
    return f"{base}/1"


@pytest.mark.parametrize(
    "block",
    [b for b in BLOCKS if b.lang == "python" and not b.fragment],
    ids=lambda b: f"L{b.line}",
)
def test_readme_python_block_runs_as_pasted(block: Block, pasted: str, workdir: Path) -> None:
    """A README block, with nothing but what it defines itself."""
    execute(block)


def test_fragments_point_to_examples_a_test_runs() -> None:
    """A marked block names a file under examples/ that exists and a test runs."""
    fragments = [b for b in BLOCKS + DOC_BLOCKS if b.fragment]
    assert fragments
    tests = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("test_*.py"))
    for block in fragments:
        assert block.fragment is not None
        path = ROOT / block.fragment
        assert block.fragment.startswith("examples/") and path.is_file(), block
        module = block.fragment.removesuffix(".py").replace("/", ".")
        assert block.fragment in tests or module in tests, (block, "no test runs it")
        code = path.read_text(encoding="utf-8")
        first = next(line for line in block.text.splitlines() if line.strip())
        assert first.strip() in code, (block, "the fragment is not in the file it names")


@pytest.mark.parametrize(
    "block",
    [b for b in BLOCKS if b.lang == "sh" and "redis-server" not in b.text],
    ids=lambda b: f"L{b.line}",
)
def test_readme_fenced_lines(block: Block, pasted: str, base: str, workdir: Path) -> None:
    """The fenced command lines of the README (the quick start's: test_quickstart.py)."""
    run_lines(commands(block), pasted, base, workdir)


@pytest.mark.parametrize(
    "block",
    [b for b in DOC_BLOCKS if b.lang == "sh"],
    ids=lambda b: f"{b.path.name}:L{b.line}",
)
def test_docs_shell_lines(block: Block, pasted: str, base: str, workdir: Path) -> None:
    """Each line of a docs shell block runs, or NOT_RUN says why not. The claims the
    lines name are held meanwhile, as when a reader would type them."""
    r = redis.Redis.from_url(pasted)
    held = [Claim(r, name, ttl=60) for name in ("rebuild:acme:roads", "report:acme")]
    assert all(claim.acquire() for claim in held)
    try:
        run_lines(commands(block, cron=False), pasted, base, workdir)
    finally:
        for claim in held:
            with contextlib.suppress(fenced.FencedError):  # a line may have released it
                claim.release()


@pytest.mark.parametrize(
    "block", [b for b in DOC_BLOCKS if b.lang == "json"], ids=lambda b: f"{b.path.name}:L{b.line}"
)
def test_docs_json_samples_parse(block: Block) -> None:
    """A JSON sample of the API is JSON."""
    json.loads(block.text)


@pytest.mark.parametrize(
    "block",
    [b for b in DOC_BLOCKS if b.lang == "python" and not b.fragment],
    ids=lambda b: f"{b.path.name}:L{b.line}",
)
def test_docs_python_block_runs_as_pasted(block: Block, pasted: str, workdir: Path) -> None:
    """Every python block of docs/, on its own (a migration's before and after also apart)."""
    execute(block)
    for half in halves(block):
        execute(block, half)


def check_claimed_task(task: ClaimedTask) -> None:
    """A task a block defines runs under its claim, and is skipped while it is held."""
    params = list(inspect.signature(task.run).parameters)
    args = tuple(f"x{n}" for n in range(len(params)))
    assert not fenced.is_skipped(task.apply(args=args).get())
    if task.app.conf.get("fenced_enabled") is False:
        return  # claims switched off for a test suite: nothing to be skipped by
    with Claim(lock_redis(task.app), task.claim_name_for(args, {}), ttl=30):
        if task._options().on_busy == "retry":  # a debounced task waits: never skipped
            with pytest.raises(fenced.ClaimHeld):
                task.apply(args=args).get()
            return
        skipped = task.apply(args=args).get()
    assert skipped["status"] == "skipped", skipped


def test_a_claims_client_made_by_a_function(pasted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/locks.py, docs/redis.md's fragment: the claims of an app that names it go
    through the client it makes."""
    monkeypatch.syspath_prepend(str(ROOT))
    app = Celery("proj", broker="memory://", set_as_current=False)
    app.conf.fenced_redis_client = "examples.locks:make"

    @app.task(base=ClaimedTask, bind=True, claim="report:{tenant}", claim_ttl=30)
    def build_report(self: Any, tenant: str) -> str:
        return f"report for {tenant}"

    check_claimed_task(build_report)
    clients = redis.Redis.from_url(pasted).client_list()
    assert "claims" in {c["name"] for c in clients}, clients


def test_error_tree() -> None:
    """The error tree drawn in the README is the package's."""
    (block,) = [b for b in DOC_BLOCKS if b.section == "Errors"]
    parents: list[type[BaseException]] = []
    for raw in block.text.splitlines():
        depth = 0 if raw[:1].isalpha() else (len(raw) - len(raw.lstrip(" │├└─")) + 1) // 5
        words = raw.lstrip(" │├└─").split()
        cls = getattr(fenced, words[0])
        del parents[depth:]
        if parents:
            assert cls.__bases__[0] is parents[-1], (cls, parents[-1])
        if len(words) > 1 and words[1].startswith("("):  # also a builtin: ConfigError
            assert issubclass(cls, getattr(builtins, words[1].strip("()"))), cls
        parents.append(cls)
    assert len(parents) >= 2


def test_layout_names_real_paths() -> None:
    """Every path the layout block names exists."""
    (block,) = [b for b in DOC_BLOCKS if b.section == "Layout"]
    checked = 0
    for raw in block.text.splitlines():
        first = raw.split()[0] if raw.strip() and not raw.startswith("    ") else ""
        if not first or not re.match(r"^[\w/.]+$", first):
            continue
        base = ROOT / "src" / "fenced" if raw.startswith("  ") else ROOT
        assert (base / first).exists(), first
        checked += 1
    assert checked >= 20, checked

"""The code blocks of README.md and docs/*.md, executed: they cannot drift from the code.

Every ``python`` block of the README runs as pasted, with nothing but the environment a
reader sets (``FENCED_REDIS_URL``, ``CELERY_BROKER_URL``) pointing at a redis-server this
module starts; a block marked ``<!-- fragment: see examples/... -->`` names the example
that runs it instead. The blocks of docs/ run with the hosts they name replaced by that
server, and with small real stand-ins for the names some still leave to the reader
(``build_steps``, ``app``, ``conn``, ...); a block with ``# before`` / ``# after`` runs as
two. ``fenced ...`` lines of the README's shell blocks run as the command line; the error
tree and the source layout are checked against the package.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import inspect
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
import redis.asyncio as aredis
import sqlalchemy as sa
from celery import Celery

import fenced
from fenced import Claim
from fenced.celery import ClaimedTask
from fenced.testing import RedisServer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: A block that does not run on its own says which file under examples/ runs it.
FRAGMENT = re.compile(r"^<!-- fragment: see (\S+) -->$")

# Shell lines that do not run here, each with why.
NOT_RUN = {
    "make demo": "sets up a virtualenv first; tests/test_demo.py runs `fenced demo`",
    "make test": "the whole suite; it runs this test among the others",
    "pip install fenced[celery,cli]": "installs; `make dist` installs the wheel",
    "pip install fenced[web]": "installs; `make dist` installs the wheel",
}

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
        if line.startswith("```"):
            lang, start, body = line[3:].strip(), i + 1, []
            marker = FRAGMENT.match(lines[i - 1]) if i else None
            i += 1
            while not lines[i].startswith("```"):
                body.append(lines[i])
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


def substitute(text: str, urls: dict[str, str]) -> str:
    for documented, real in urls.items():
        text = text.replace(documented, real)
    return text


def halves(block: Block) -> list[tuple[str, int]]:
    """A migration block's ``# before`` and ``# after`` parts, else the whole block."""
    lines = block.text.splitlines(keepends=True)
    cut = [i for i, line in enumerate(lines) if line.strip() in ("# before", "# after")]
    if not cut:
        return [(block.text, block.line)]
    assert [lines[i].strip() for i in cut] == ["# before", "# after"], block
    before, after = cut
    return [
        ("".join(lines[before:after]), block.line + before),
        ("".join(lines[after:]), block.line + after),
    ]


# -- the names the README leaves to the reader --------------------------------------


class Done:
    """What a stand-in returns: awaitable (``await rebuild(...)``), and fine unawaited."""

    def __await__(self) -> Iterator[None]:
        return iter(())


@dataclass
class Reader:
    """Stand-ins for the reader's own code; they note what the README's code gave them."""

    url: str
    workdir: Path
    calls: list[tuple[str, Any]]

    def names(self) -> dict[str, Any]:
        calls = self.calls

        class Step:
            def __init__(self, n: int) -> None:
                self.n = n

            def run(self, fence: int) -> None:
                assert isinstance(fence, int), fence
                calls.append(("step", fence))

        def build_steps(*args: Any) -> list[Step]:
            return [Step(n) for n in range(3)]

        def rebuild(*args: Any, fence: int | None = None) -> Done:
            calls.append(("rebuild", fence))
            return Done()

        def build_report(fence: int | None = None) -> bytes:
            calls.append(("build_report", fence))
            return b"report"

        def publish(report: bytes, fence: int) -> None:
            assert isinstance(fence, int), fence
            calls.append(("publish", fence))

        engine = sa.create_engine(f"sqlite:///{self.workdir / 'entries.db'}")
        sa.Table(
            "entries",
            meta := sa.MetaData(),
            sa.Column("feed_id", sa.Integer, nullable=False),
            sa.Column("guid", sa.Text, nullable=False),
            sa.Column("title", sa.Text),
            sa.Column("fence", sa.BigInteger, nullable=False),
            sa.UniqueConstraint("feed_id", "guid"),
        )
        meta.create_all(engine)
        app = Celery("readme", broker="memory://", set_as_current=False)
        app.conf.task_always_eager = True
        app.conf.fenced_redis_url = self.url  # the set-up the tour shows
        return {
            "__name__": "readme",
            "r": redis.Redis.from_url(self.url),
            "app": app,
            "build_steps": build_steps,
            "rebuild": rebuild,
            "build_report": build_report,
            "publish": publish,
            "plan": build_steps(),
            "tile_bytes": b"\x89PNG tile",
            "conn": engine.connect(),
            "rows": [{"feed_id": 1, "guid": "a", "title": "A"}, {"feed_id": 1, "guid": "b"}],
        }


def execute(code: str, line: int, ns: dict[str, Any]) -> None:
    """Run README code in ``ns``; top-level ``await`` runs on an event loop of its own."""
    compiled = compile(
        "\n" * (line - 1) + code, str(README), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    )
    if not compiled.co_flags & inspect.CO_COROUTINE:
        exec(compiled, ns)
        return

    async def main() -> None:
        await eval(compiled, ns)
        for value in list(ns.values()):
            if isinstance(value, aredis.Redis):
                await value.aclose()

    asyncio.run(main())


# -- shell ----------------------------------------------------------------------


def commands(block: Block) -> list[str]:
    """The command lines of a shell block (a cron line's command part)."""
    out = []
    for raw in block.text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        out.append(CRON.sub("", line))
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


# -- fixtures -------------------------------------------------------------------


@pytest.fixture
def urls(redis_server: RedisServer) -> dict[str, str]:
    """The README's hosts, mapped to the test's server."""
    redis_server.client().flushall()
    base = redis_server.url.rsplit("/", 1)[0]  # redis://127.0.0.1:PORT
    return {"redis://locks:6379": base, "redis://localhost:6379": base}


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the README's relative paths land, with the reader's files in it."""
    monkeypatch.chdir(tmp_path)
    backup = tmp_path / "backup.sh"
    backup.write_text('#!/bin/sh\necho "$@" >> backups.log\n')
    backup.chmod(0o755)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "__init__.py").write_text("")
    (tmp_path / "proj" / "celery.py").write_text(
        "from celery import Celery\n"
        "app = Celery('proj', broker='memory://')\n"
        "app.conf.task_acks_late = True\n"
        "app.conf.task_reject_on_worker_lost = True\n"
        "app.conf.worker_prefetch_multiplier = 1\n"
    )
    return tmp_path


def reader(urls: dict[str, str], workdir: Path) -> Reader:
    return Reader(urls["redis://locks:6379"] + "/1", workdir, [])


# -- the tests ------------------------------------------------------------------


def test_parse_finds_every_block() -> None:
    langs = {b.lang for b in BLOCKS}
    assert langs <= {"python", "sh", ""}, langs  # a new kind of block needs a runner here
    assert sum(b.lang == "python" for b in BLOCKS) >= 5
    assert sum(b.lang == "python" for b in DOC_BLOCKS) >= 20
    assert all(b.text.strip() for b in BLOCKS + DOC_BLOCKS)


@pytest.fixture
def pasted(urls: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    """The environment a reader's blocks read: the claims' Redis, Celery's broker."""
    base = urls["redis://locks:6379"]
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
    ns: dict[str, Any] = {"__name__": "readme"}
    execute(block.text, block.line, ns)
    for value in list(ns.values()):
        if isinstance(value, ClaimedTask):
            check_claimed_task(value)


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
def test_readme_fenced_lines(block: Block, urls: dict[str, str], workdir: Path) -> None:
    """The fenced command lines of the README (the quick start's: test_quickstart.py)."""
    me = reader(urls, workdir)
    for line in commands(block):
        line = line.replace("redis://localhost:6379", urls["redis://locks:6379"])
        argv = shlex.split(line, comments=True)
        if argv[0] != "fenced":
            assert " ".join(argv) in NOT_RUN, line
            continue
        if argv[1] == "web":
            continue  # serves until stopped: tests/test_web.py
        res = run_fenced(argv, me.url, workdir)
        assert res.returncode == 0, (line, res.stdout, res.stderr)


@pytest.mark.parametrize(
    "block",
    [b for b in DOC_BLOCKS if b.lang == "python" and not b.fragment],
    ids=lambda b: f"{b.path.name}:L{b.line}",
)
def test_docs_python_block(block: Block, urls: dict[str, str], workdir: Path, pasted: str) -> None:
    """Every python block of docs/, on its own (a migration's before and after apart)."""
    for code, line in halves(block):
        me = reader(urls, workdir)
        ns = me.names()
        execute(substitute(code, urls), line, ns)
        for value in list(ns.values()):
            if isinstance(value, ClaimedTask):
                check_claimed_task(value)


def check_claimed_task(task: ClaimedTask) -> None:
    """A task a block defines runs under its claim, and is skipped while it is held."""
    params = list(inspect.signature(task.run).parameters)
    args = tuple(f"x{n}" for n in range(len(params)))
    assert task.apply(args=args).get() is None
    server = redis.Redis.from_url(task.app.conf.fenced_redis_url)
    with Claim(server, task.claim_name_for(args, {}), ttl=30):
        skipped = task.apply(args=args).get()
    assert skipped["status"] == "skipped", skipped


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

"""Every subcommand's ``--help`` reads as docs/cli.md writes the command: metavars, not
Python types; every parameter explained; defaults and ranges in words. The command tree
is walked, so a subcommand added later is checked too."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from fenced.cli import app

assert app is not None, "the cli extra (typer) is not installed"
APP: typer.Typer = app
ROOT = typer.main.get_command(APP)


def walk(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    yield path, command
    for name, sub in sorted(getattr(command, "commands", {}).items()):
        yield from walk(sub, (*path, name))


COMMANDS = list(walk(ROOT))


def help_text(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(APP, [*path, "--help"], env={"COLUMNS": "100"}, prog_name="fenced")
    assert result.exit_code == 0, result.output
    return result.output


def test_the_walk_finds_every_subcommand() -> None:
    found = {" ".join(path) for path, _cmd in COMMANDS}
    expected = {"run", "ls", "show", "release", "unqueue", "doctor", "beat", "web", "demo"}
    assert {"", *expected, "version"} <= found


@pytest.mark.parametrize(
    ("path", "command"), COMMANDS, ids=[" ".join(("fenced", *path)) for path, _c in COMMANDS]
)
def test_help_reads_as_the_docs_write_it(path: tuple[str, ...], command: Any) -> None:
    text = help_text(path)
    usage = text.split("\n\n", 1)[0]
    assert usage.startswith(f"Usage: {' '.join(('fenced', *path))} "), usage
    # No Python type names, no doubled brackets, no typer braces around a required argument.
    assert not re.search(r"<\w+[\[>]", text), text
    assert "[[" not in text and "{" not in usage, usage
    # Defaults and ranges in words: no "None: ...", no "x>=0.1".
    assert "None:" not in text, text
    assert not re.search(r"\bx\s*[<>]=?|[<>]=?\s*x\b", text), text
    assert "[default: None]" not in text
    for param in command.params:
        assert (param.help or "").strip(), f"{' '.join(path)}: {param.name} has no help"
        if param.param_type_name == "argument" or not param.is_flag:
            # Named as the docs name it (NAME, URL, DURATION), never as its type.
            assert param.metavar, f"{' '.join(path)}: {param.name} has no metavar"
            assert param.metavar in text
        for opt in getattr(param, "opts", []) if param.param_type_name == "option" else []:
            assert opt in text, opt


def test_arguments_read_as_in_the_docs() -> None:
    assert "Usage: fenced run [OPTIONS] NAME -- COMMAND...\n" in help_text(("run",))
    assert "Usage: fenced unqueue [OPTIONS] [NAME]...\n" in help_text(("unqueue",))
    for command in ("show", "release", "beat"):
        assert f"Usage: fenced {command} [OPTIONS] NAME\n" in help_text((command,))
    text = help_text(("run",))
    assert re.search(r"\n  NAME +Claim name", text) and re.search(
        r"\n  -- COMMAND\.\.\. +The", text
    )


def test_defaults_are_words() -> None:
    flat = " ".join(help_text(("run",)).split())
    assert "--ttl DURATION" in flat and "[default: 30s]" in flat
    assert "[default: 10s]" in flat  # --grace
    assert "default: no limit." in flat  # --rate: None is the unsaid default
    assert "--namespace NS" in flat
    flat = " ".join(help_text(("web",)).split())
    assert "[default: 8377; 0 to 65535]" in flat and "[default: 2; at least 0.2]" in flat
    flat = " ".join(help_text(("ls",)).split())
    assert "[default: 1; at least 0.1]" in flat


def test_the_command_list_shows_each_summary_whole() -> None:
    flat = " ".join(help_text(()).split())
    for path, command in COMMANDS:
        if path:
            summary = " ".join(command.help.strip().split("\n\n")[0].split())
            assert f"{path[-1]} {summary}" in flat, summary


def test_release_help_names_where_the_token_is_shown() -> None:
    flat = " ".join(help_text(("release",)).split())
    assert "--token PREFIX (as fenced ls shows it)" in flat
    assert "(the token fenced ls shows)" in flat

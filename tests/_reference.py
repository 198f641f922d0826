"""What docs/reference.md lists, derived from the code: the claim options, the Celery
task options and app settings, the environment variables fenced reads, the command
line's flags; and how the reference writes a default."""

from __future__ import annotations

import ast
import enum
import re
from pathlib import Path
from typing import Any

import typer.main

from fenced._options import DEFAULT, NAMES
from fenced.celery._options import DEFAULTS, KNOWN_SETTINGS, SETTINGS
from fenced.cli import app

SRC = Path(__file__).resolve().parent.parent / "src" / "fenced"


def fmt(value: Any) -> str:
    """A default as the reference writes it (in backticks)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "None"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, (int, float)):
        return f"{value:g}"
    if isinstance(value, str):
        return repr(value).replace("'", '"')
    return repr(value)


def claim_options() -> dict[str, str]:
    return {name: fmt(getattr(DEFAULT, name)) for name in NAMES}


def task_options() -> dict[str, str]:
    return {name: fmt(value) for name, value in DEFAULTS.items()}


def task_settings() -> dict[str, str]:
    return dict(SETTINGS)


def other_settings() -> set[str]:
    return set(KNOWN_SETTINGS) - set(SETTINGS.values())


def environment() -> set[str]:
    """Every ``FENCED_*`` string in the package that is not the name of a constant."""
    found, constants = set(), set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"FENCED_[A-Z0-9_]+", node.value):
                    found.add(node.value)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                constants.add(node.id)
    return found - constants


def cli_default(param: Any) -> str:
    envvar = getattr(param, "envvar", None)
    if envvar:
        return f"${envvar}"
    if getattr(param, "is_flag", False):
        return "off"
    if param.default in (None, ""):
        return "none"
    return fmt(param.default).strip('"')


def cli_flags() -> dict[str, dict[str, str]]:
    """Each command (``fenced`` for the group's own) -> its flags -> default."""
    assert app is not None, "the cli extra (typer) is not installed"
    group = typer.main.get_command(app)
    out = {"fenced": {p.opts[0]: cli_default(p) for p in group.params}}
    for name, cmd in group.commands.items():  # type: ignore[attr-defined]
        out[f"fenced {name}"] = {
            max(p.opts, key=len): cli_default(p)
            for p in cmd.params
            if p.param_type_name == "option"
        }
    return out

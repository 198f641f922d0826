"""docs/reference.md against the code, both ways: every option, setting, environment
variable and flag has a row with its default, and no row names one that is gone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import _reference as code

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "reference.md"


def tables() -> dict[str, list[list[str]]]:
    """Each heading (## or ###) -> the rows of its table, cells stripped."""
    out: dict[str, list[list[str]]] = {}
    heading = ""
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("| ") and not re.match(r"^\|[-| ]+\|$", line):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            out.setdefault(heading, []).append(cells)
    return {h: rows[1:] for h, rows in out.items()}  # without the header row


def first_code(cell: str) -> str:
    """The first `...` of a cell: a name or a default."""
    m = re.search(r"`([^`]*)`", cell)
    assert m, cell
    return m.group(1)


TABLES = tables()


def column(heading: str, n: int) -> dict[str, str]:
    return {first_code(row[0]): row[n] for row in TABLES[heading]}


def test_claim_options() -> None:
    rows = column("Claim options", 1)
    assert set(rows) == set(code.claim_options())
    assert {k: first_code(v) for k, v in rows.items()} == code.claim_options()


def test_celery_task_options_and_their_settings() -> None:
    defaults, settings = column("Celery task options", 1), column("Celery task options", 2)
    assert set(defaults) == set(code.task_options())
    assert {k: first_code(v) for k, v in defaults.items()} == code.task_options()
    assert {k: first_code(v) for k, v in settings.items()} == code.task_settings()


def test_celery_app_settings() -> None:
    assert set(column("Celery app settings", 1)) == code.other_settings()


def test_environment_variables() -> None:
    assert set(column("Environment variables", 1)) == code.environment()


@pytest.mark.parametrize("command", sorted(code.cli_flags()))
def test_command_line_flags(command: str) -> None:
    flags = code.cli_flags()[command]
    if not flags:
        assert f"`{command}`" not in TABLES
        return
    rows = column(f"`{command}`", 1)
    assert {k: first_code(v) for k, v in rows.items()} == flags


def test_every_table_is_checked() -> None:
    checked = {"Claim options", "Celery task options", "Celery app settings"}
    checked |= {"Environment variables"} | {f"`{c}`" for c in code.cli_flags()}
    assert set(TABLES) <= checked, set(TABLES) - checked

"""What a check returns (Finding), the report of a run, and how it is shown."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, ParamSpec

from .._printable import printable

__all__ = ["Finding", "Report", "Severity", "format_text", "render"]

Severity = Literal["error", "warning", "info"]
_ORDER = {"error": 0, "warning": 1, "info": 2}
_P = ParamSpec("_P")


def listed(check: Callable[_P, Iterator[Finding]]) -> Callable[_P, list[Finding]]:
    """A check written as a generator of findings, returning them as a list."""

    @functools.wraps(check)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> list[Finding]:
        return list(check(*args, **kwargs))

    return run


@dataclass(frozen=True)
class Finding:
    """One problem (or note): what is wrong, why it matters for claims, and the fix."""

    severity: Severity
    code: str
    what: str
    why: str
    fix: str
    subject: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


@dataclass
class Report:
    """Every finding of one doctor run; non-zero exit code when any is an error."""

    findings: list[Finding] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Errors first; the order within a severity is the order of the checks.
        self.findings = sorted(self.findings, key=lambda f: _ORDER[f.severity])

    @property
    def errors(self) -> list[Finding]:
        """Findings that make claims unsafe."""
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        """Findings that weaken claims or waste work."""
        return [f for f in self.findings if f.severity == "warning"]

    @property
    def exit_code(self) -> int:
        """1 when any finding is an error, else 0."""
        return 1 if self.errors else 0

    def codes(self, severity: Severity | None = None) -> set[str]:
        """The codes found, optionally of one severity."""
        return {f.code for f in self.findings if severity is None or f.severity == severity}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form with a count per severity."""
        counts = {s: sum(f.severity == s for f in self.findings) for s in _ORDER}
        return {
            "exit_code": self.exit_code,
            "counts": counts,
            "findings": [f.as_dict() for f in self.findings],
        }

    def as_json(self, indent: int | None = 2) -> str:
        """The report as JSON text."""
        return json.dumps(self.as_dict(), indent=indent, default=str)


def format_text(report: Report) -> str:
    """The report as plain text, errors first."""
    if not report.findings:
        return "fenced doctor: no findings.\n"
    lines: list[str] = []
    for f in report.findings:
        # Findings quote claim names and templates read from Redis: escaped.
        lines.append(f"{f.severity.upper():8} {f.code}: {printable(f.what)}")
        lines.append(f"         why: {printable(f.why)}")
        lines.append(f"         fix: {printable(f.fix)}")
        lines.append("")
    lines.append(_tally(report))
    return "\n".join(lines) + "\n"


def _tally(report: Report) -> str:
    counts = report.as_dict()["counts"]
    return f"{counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} note(s)"


_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def render(report: Report, console: Any = None) -> None:
    """Print the report: with rich when it is installed, as plain text otherwise."""
    try:
        from rich.console import Console
        from rich.panel import Panel
        from rich.text import Text
    except ImportError:
        print(format_text(report), end="")
        return
    console = console or Console()
    if not report.findings:
        console.print("[green]fenced doctor: no findings.[/green]")
        return
    for f in report.findings:
        body = Text()
        body.append(printable(f.what) + "\n", style="bold")
        body.append("why  ", style="dim")
        body.append(printable(f.why) + "\n")
        body.append("fix  ", style="dim")
        body.append(printable(f.fix), style="green")
        title = Text(f"{f.severity} · {f.code}", style=_STYLE[f.severity])
        console.print(Panel(body, title=title, title_align="left", border_style=_STYLE[f.severity]))
    console.print(_tally(report))

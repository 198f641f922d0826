"""Rich tables for ``fenced ls`` and ``fenced show`` (needs the ``cli`` extra)."""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from ._inspect import ClaimInfo, ClaimReport
from ._lease import Holder

__all__ = ["claims_table", "duration", "holder_text", "report_table", "when"]

STYLES = {
    "ok": "green",
    "failed": "red",
    "lost": "bold red",
    "aborted": "yellow",
    "skipped": "yellow",
    "released": "magenta",
    "running": "cyan",
    "unfinished": "red",
}


def duration(seconds: float | None) -> str:
    """Short human duration: 4.2s, 3m05s, 2h07m, 1d03h; '?' when unknown."""
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def when(at: float | None) -> str:
    """Local month, day and time of an epoch timestamp (``--json`` has the full value)."""
    if at is None:
        return "?"
    return time.strftime("%m-%d %H:%M:%S", time.localtime(at))


def holder_text(holder: Holder) -> str:
    """host pid N [task T], without the time left."""
    who = f"{holder.host} pid {holder.pid if holder.pid is not None else '?'}"
    if holder.task_id:
        who += f" task {holder.task_id}"
    return who


def _outcome(outcome: str | None) -> Text:
    if outcome is None:
        return Text("-", style="dim")
    return Text(outcome, style=STYLES.get(outcome, ""))


def claims_table(infos: list[ClaimInfo], title: str) -> Table:
    """The ``ls`` table: one row per held claim."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("name", style="bold", overflow="fold")
    table.add_column("holder", overflow="fold")
    for col in ("age", "left", "fence", "skips"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("last")
    for info in infos:
        table.add_row(
            info.name,
            holder_text(info.holder),
            duration(info.age),
            duration(info.expires_in) if info.expires_in is not None else "no ttl",
            str(info.fence) if info.fence is not None else "?",
            Text(str(info.skips), style="yellow" if info.skips else ""),
            _outcome(info.last_outcome),
        )
    return table


def _detail(run: Any) -> str:
    parts = []
    if run.reason:
        parts.append(str(run.reason))
    if run.holder and run.outcome in ("skipped", "released"):
        parts.append(f"{'held by' if run.outcome == 'skipped' else 'was held by'} {run.holder}")
    extra = dict(run.extra)
    if extra.get("by"):
        parts.append(f"by {extra.pop('by')}")
    if extra.get("command"):
        parts.append(f"$ {extra.pop('command')}")
    parts += [f"{k}={v}" for k, v in extra.items()]
    return "; ".join(parts)


def report_table(report: ClaimReport) -> Table:
    """The ``show`` table: a claim's runs, newest first."""
    if report.holder is not None:
        h = report.holder
        left = duration(h.expires_in) if h.expires_in is not None else "no ttl"
        title = f"{report.name}: held by {holder_text(h)}, fence {h.fence}, {left} left"
    else:
        title = f"{report.name}: not held"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("started", no_wrap=True)
    table.add_column("outcome", no_wrap=True)
    table.add_column("took", justify="right", no_wrap=True)
    table.add_column("fence", justify="right", no_wrap=True)
    table.add_column("worker", overflow="fold")
    with_tasks = any(run.task_id for run in report.runs)
    if with_tasks:
        table.add_column("task")
    table.add_column("detail", overflow="fold")
    for run in report.runs:
        row: list[Any] = [
            when(run.started if run.started is not None else run.finished),
            _outcome(run.outcome),
            duration(run.duration) if run.duration is not None else "",
            str(run.fence) if run.fence is not None else "",
            run.worker or "",
        ]
        if with_tasks:
            row.append(run.task_id or "")
        row.append(_detail(run))
        table.add_row(*row)
    return table

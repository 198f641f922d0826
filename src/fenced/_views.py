"""Rich tables for ``fenced ls`` and ``fenced show`` (needs the ``cli`` extra).

Everything shown that comes from Redis (names, holders, run records) is data someone
else may have written: it goes through :func:`fenced._printable.printable`, and into
rich as ``Text`` or through a console without markup, never as markup.
"""

from __future__ import annotations

import time
from typing import Any

from rich import box
from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from ._inspect import Burst, ClaimInfo, ClaimReport, Flow
from ._lease import Holder
from ._printable import printable
from .records import RunRecord

__all__ = [
    "WIDE",
    "claims_list",
    "claims_table",
    "duration",
    "flow_text",
    "holder_text",
    "report_list",
    "report_table",
    "token_text",
    "when",
]

#: Terminals narrower than this get one stacked block per record instead of a table
#: (a table of 8 columns leaves a few characters to its widest one at 80 columns).
WIDE = 120
#: Characters of a task id the stacked views show (``--json`` and ``--wide``: all).
SHORT_ID = 8

STYLES = {
    "ok": "green",
    "failed": "red",
    "lost": "bold red",
    "aborted": "yellow",
    "skipped": "yellow",
    "released": "magenta",
    "retried": "blue",
    "running": "cyan",
    "unfinished": "red",
    "unreadable": "bold red",
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


def _short(text: str, keep: int = SHORT_ID) -> str:
    return text if len(text) <= keep + 1 else text[:keep] + "…"


def holder_text(holder: Holder, *, short: bool = False) -> str:
    """host pid N [task T], without the time left; ``short``: the task id's head."""
    if holder.unreadable:
        return _unreadable(holder.unreadable)
    who = f"{printable(holder.host)} pid {holder.pid if holder.pid is not None else '?'}"
    if holder.task_id:
        who += f" task {printable(_short(holder.task_id) if short else holder.task_id)}"
    return who


def _unreadable(problem: str | None) -> str:
    return f"(unreadable: {printable(problem)})" if problem else ""


def _left(expires_in: float | None) -> str:
    return duration(expires_in) if expires_in is not None else "no ttl"


def _lease(holder: Holder, *, short: bool = False) -> str:
    """``host pid 1, fence 7, 12.0s left``."""
    fence = holder.fence if holder.fence is not None else "?"
    return f"{holder_text(holder, short=short)}, fence {fence}, {_left(holder.expires_in)} left"


def _window(left: float | None) -> str:
    return f"ran recently: window ends in {duration(left)}" if left is not None else ""


def _queued(task_id: str | None, left: float | None, *, short: bool = False) -> str:
    """The enqueue marker: ``queued: task 1f2e... (marked 59m more)``."""
    if task_id is None:
        return ""
    shown = _short(task_id) if short else task_id
    more = f" (marked {duration(left)} more)" if left is not None else " (no expiry)"
    return printable(f"queued: task {shown}{more}")


def _rate(flow: Flow, *, until: bool = False) -> str:
    """``rate limited: next start in 4.2s`` (``until``: ``rate limited until <time>, ...``)."""
    if flow.next_start is None:
        return ""
    wait = f"next start in {duration(flow.rate_wait)}"
    if until:
        return f"rate limited until {when(flow.next_start)}, {wait}"
    return f"rate limited: {wait}"


def _burst(burst: Burst | None, *, short: bool = False) -> str:
    """``burst pending: 3 calls, runs in 1.2s (task 1f2e...)`` for a debounce burst."""
    if burst is None:
        return ""
    calls = "calls ?" if burst.calls is None else f"{burst.calls} call" + "s" * (burst.calls != 1)
    if burst.runs_in is None:
        runs = "due ?"
    elif burst.runs_in > 0:
        runs = f"runs in {duration(burst.runs_in)}"
    else:  # its message (or the run holding the name) is late
        runs = "due now"
    task = _short(burst.task_id) if short else burst.task_id
    return printable(f"burst pending: {calls}, {runs} (task {task})")


def flow_text(flow: Flow, *, short: bool = False, until: bool = False) -> str:
    """What holds a name's next start back: its rate and a pending debounce burst."""
    return _notes(_rate(flow, until=until), _burst(flow.burst, short=short))


def _notes(*texts: str) -> str:
    return "; ".join(text for text in texts if text)


def _skips(count: int) -> str:
    """``3 consecutive skips`` (nothing for none)."""
    return f"{count} consecutive skip{'' if count == 1 else 's'}" if count else ""


def _held(limit: int, slots: list[tuple[int, Holder]], short: bool = False) -> str:
    """``2/3 held: host pid 1, host pid 2`` for a name held by several at once."""
    who = ", ".join(holder_text(h, short=short) for _i, h in slots)
    return f"{len(slots)}/{limit} held" + (f": {who}" if who else "")


def _who(info: ClaimInfo, *, short: bool = False) -> str:
    """The holder of a listed claim, and its cooldown window when it has one."""
    if info.limit > 1:
        who = _held(info.limit, info.slots, short)
    elif info.holder is not None:
        who = holder_text(info.holder, short=short)
        if info.unreadable and info.unreadable != info.holder.unreadable:
            who += f" {_unreadable(info.unreadable)}"
    else:
        who = _unreadable(info.unreadable) or "-"
    notes = _notes(
        _window(info.cooldown_left),
        _queued(info.queued, info.queued_left, short=short),
        _beat(info.beat),
        flow_text(info.flow, short=short),
    )
    return notes if who == "-" and notes else _notes(who, notes)


def token_text(holder: Holder) -> str:
    """The holder's token as ``fenced release --token`` takes it back ("" for a holder
    whose token cannot be given back as printed: unreadable, or not letters and digits,
    the rule of the release's own hint)."""
    if holder.unreadable or not holder.token.isalnum():
        return ""
    return holder.token


def _tokens(info: ClaimInfo) -> list[str]:
    """The token of each holder of a listed claim, in the order ``_who`` names them."""
    holders = [h for _i, h in info.slots] if info.limit > 1 else [info.holder]
    return [t for t in (token_text(h) for h in holders if h is not None) if t]


def _beat(beat: str | None) -> str:
    """A beat's leader claim: ``beat leader (fenced beat NAME)``."""
    return f"beat leader (fenced beat {printable(beat)})" if beat is not None else ""


def _outcome(outcome: str | None) -> Text:
    if outcome is None:
        return Text("-", style="dim")
    return Text(printable(outcome), style=STYLES.get(outcome, ""))


def _table(title: str) -> Table:
    return Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)


def claims_table(infos: list[ClaimInfo], title: str) -> Table:
    """The ``ls`` table: one row per held claim."""
    table = _table(title)
    table.add_column("name", style="bold", overflow="fold")
    table.add_column("holder", overflow="fold")
    table.add_column("token", no_wrap=True)  # what fenced release --token takes
    for col in ("age", "left", "fence", "skips"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("previous run")
    for info in infos:
        table.add_row(
            Text(printable(info.name)),
            Text(_who(info)),
            Text("\n".join(_tokens(info)) or "-"),
            duration(info.age) if info.holder else "-",
            _left(info.expires_in) if info.holder else "-",
            str(info.fence) if info.fence is not None else "?",
            Text(str(info.skips), style="yellow" if info.skips else ""),
            _outcome(info.last_outcome),
        )
    return table


def _args(args: Any, readable: Any) -> str:
    """A run's template values; a hashed one as its readable form and the digest's head."""
    if not isinstance(args, dict):
        return f"args={args}"
    texts = readable if isinstance(readable, dict) else {}
    shown = []
    for key, value in args.items():
        text = texts.get(key)
        shown.append(f"{key}={text} ({_short(str(value), 11)})" if text else f"{key}={value}")
    return ", ".join(shown)


def _detail(run: RunRecord) -> str:
    parts = [_unreadable(run.unreadable)] if run.unreadable else []
    if run.reason:
        parts.append(str(run.reason))
    if run.holder and run.outcome in ("skipped", "released"):
        parts.append(f"{'held by' if run.outcome == 'skipped' else 'was held by'} {run.holder}")
    extra = dict(run.extra)
    if extra.get("by"):
        parts.append(f"by {extra.pop('by')}")
    if extra.get("command"):
        parts.append(f"$ {extra.pop('command')}")
    readable = extra.pop("arg_text", None)
    if "args" in extra:
        parts.append(_args(extra.pop("args"), readable))
    parts += [f"{k}={v}" for k, v in extra.items()]
    return printable("; ".join(parts))


def _line(*cells: str | Text) -> Text:
    """One line of a stacked view: cells two spaces apart, cut at the terminal's edge."""
    line = Text(no_wrap=True, overflow="ellipsis")
    for cell in cells:
        if cell:
            if line:
                line.append("  ")
            line.append(cell)
    return line


def claims_list(infos: list[ClaimInfo], title: str) -> Group:
    """The ``ls`` view for a narrow terminal: each claim's name and fence, then the rest."""
    blocks: list[Any] = [Text(title)]
    for info in infos:
        head = Text(printable(info.name), style="bold", overflow="fold")
        head.append(f"  fence {info.fence if info.fence is not None else '?'}", style="dim")
        tokens = _tokens(info)
        if tokens:  # what fenced release --token takes
            head.append(f"  token{'s' * (len(tokens) > 1)} {', '.join(tokens)}", style="dim")
        blocks.append(head)
        blocks.append(
            Padding(
                _line(
                    Text("previous run ").append_text(_outcome(info.last_outcome)),
                    Text(f"skips {info.skips}", style="yellow" if info.skips else ""),
                    f"age {duration(info.age)}" if info.holder else "",
                    f"left {_left(info.expires_in)}" if info.holder else "",
                    Text(_who(info, short=True)),
                ),
                (0, 0, 0, 2),
            )
        )
    return Group(*blocks)


def _title(report: ClaimReport, *, short: bool = False) -> str:
    name = printable(report.name)
    window = _notes(
        _window(report.cooldown_left),
        _queued(report.queued, report.queued_left, short=short),
        flow_text(report.flow, short=short, until=True),
    )
    if report.limit > 1:
        held = [f"{len(report.slots)}/{report.limit} held"]
        held += [f"slot {i}: {_lease(h, short=short)}" for i, h in report.slots]
    elif report.holder is None:
        held = ["not held"]
    else:
        held = [f"held by {_lease(report.holder, short=short)}"]
    return f"{name}: " + _notes(*held, _skips(report.skips), window)


def _run_cells(run: RunRecord) -> tuple[str, Text, str]:
    """When a run started (or ended), its outcome and how long it took."""
    at = run.started if run.started is not None else run.finished
    return (
        when(at),
        _outcome(run.outcome),
        duration(run.duration) if run.duration is not None else "",
    )


def report_list(report: ClaimReport) -> Group:
    """The ``show`` view for a narrow terminal: a line per run, its details below it."""
    blocks: list[Any] = [Text(_title(report, short=True), overflow="fold"), Text("")]
    for run in report.runs:
        blocks.append(
            _line(
                *_run_cells(run),
                f"fence {run.fence}" if run.fence is not None else "",
                printable(run.worker or ""),
                f"task {printable(_short(run.task_id))}" if run.task_id else "",
            )
        )
        detail = _detail(run)
        if detail:
            blocks.append(Padding(Text(detail, overflow="fold"), (0, 0, 0, 4)))
    return Group(*blocks)


def report_table(report: ClaimReport) -> Table:
    """The ``show`` table: a claim's runs, newest first."""
    table = _table(_title(report))
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
            *_run_cells(run),
            str(run.fence) if run.fence is not None else "",
            Text(printable(run.worker or "")),
        ]
        if with_tasks:
            row.append(Text(printable(run.task_id or "")))
        row.append(Text(_detail(run)))
        table.add_row(*row)
    return table

"""Traces of the Quint model (spec/fenced.qnt) in the Informal Trace Format, as Python.

``make model`` writes them to ``spec/traces/`` (``quint run --mbt --out-itf``); each
state carries the step that led to it (``mbt::actionTaken``) and what that step chose
(``mbt::nondetPicks``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SPEC = Path(__file__).resolve().parent.parent / "spec"
TRACES = SPEC / "traces"
# spec/show.py reads ITF for `make model` with the standard library only: the same
# reading here, not a copy.
sys.path.insert(0, str(SPEC))
from show import picks, plain  # noqa: E402
from show import states as load  # noqa: E402

__all__ = ["TRACES", "action", "live_lease", "load", "picks", "plain", "trace_files"]


def trace_files() -> list[Path]:
    """The traces ``make model`` wrote, in a stable order (none when it has not run)."""
    if not TRACES.is_dir():
        return []
    return sorted(TRACES.glob("*.itf.json"), key=lambda p: (len(p.name), p.name))


def action(state: dict[str, Any]) -> str:
    """The step that led to this state."""
    return str(state.get("mbt::actionTaken", ""))


def live_lease(state: dict[str, Any]) -> int:
    """The model token whose lease lives on the master in this state, else 0."""
    master = state["master"]
    return int(master["lease"]) if master["lease"] and state["now"] < master["expires"] else 0

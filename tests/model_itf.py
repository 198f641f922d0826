"""Traces of the Quint model (spec/fenced.qnt) in the Informal Trace Format, as Python.

``make model`` writes them to ``spec/traces/`` (``quint run --mbt --out-itf``); each
state carries the step that led to it (``mbt::actionTaken``) and what that step chose
(``mbt::nondetPicks``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TRACES = Path(__file__).resolve().parent.parent / "spec" / "traces"


def plain(value: Any) -> Any:
    """An ITF value as plain Python: ints, lists, dicts; a set as a sorted list."""
    if isinstance(value, dict):
        if "#bigint" in value:
            return int(value["#bigint"])
        if "#map" in value:
            return {plain(k): plain(v) for k, v in value["#map"]}
        if "#set" in value:
            return sorted(plain(v) for v in value["#set"])
        if "#tup" in value:
            return [plain(v) for v in value["#tup"]]
        return {k: plain(v) for k, v in value.items() if k != "#meta"}
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


def load(path: Path) -> list[dict[str, Any]]:
    """The states of one trace, first to last."""
    with path.open() as f:
        return [plain(state) for state in json.load(f)["states"]]


def trace_files() -> list[Path]:
    """The traces ``make model`` wrote, in a stable order (none when it has not run)."""
    if not TRACES.is_dir():
        return []
    return sorted(TRACES.glob("*.itf.json"), key=lambda p: (len(p.name), p.name))


def action(state: dict[str, Any]) -> str:
    """The step that led to this state."""
    return str(state.get("mbt::actionTaken", ""))


def picks(state: dict[str, Any]) -> dict[str, Any]:
    """What the step that led to this state chose (process, acknowledgement, ...)."""
    chosen = state.get("mbt::nondetPicks", {})
    return {k: v["value"] for k, v in chosen.items() if v.get("tag") == "Some"}


def live_lease(state: dict[str, Any]) -> int:
    """The model token whose lease lives on the master in this state, else 0."""
    master = state["master"]
    return int(master["lease"]) if master["lease"] and state["now"] < master["expires"] else 0

"""Event logs: one JSON object per line, one file per process, stamped with both clocks.

``t`` is ``time.monotonic()``, which on Linux is one clock for every process of the
machine, so events of different processes can be ordered; ``wall`` is ``time.time()``
at the same instant, for people. A line is written with one ``write`` on a file opened
for appending, so a process killed mid-run leaves whole lines only.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["EventLog", "read_events"]

Event = dict[str, Any]


class EventLog:
    """Append events to one file; every event carries ``fixed`` (worker, lane, pid...)."""

    def __init__(self, path: str | os.PathLike[str], **fixed: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.fixed = fixed

    def emit(self, ev: str, t: float | None = None, **fields: Any) -> float:
        """Log one event at ``t`` (default: now); return its monotonic time."""
        now = time.monotonic()
        when = now if t is None else t
        record = {"t": when, "wall": time.time() - (now - when), "ev": ev, **self.fixed, **fields}
        os.write(self._fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())
        return when

    def close(self) -> None:
        """Close the file."""
        os.close(self._fd)


def read_events(directory: str | os.PathLike[str], pattern: str = "*.jsonl") -> list[Event]:
    """Every event of every log in ``directory``, in time order."""
    events: list[Event] = []
    for path in sorted(Path(directory).glob(pattern)):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue  # a line cut by a full disk: nothing to learn from it
    events.sort(key=lambda e: float(e["t"]))
    return events

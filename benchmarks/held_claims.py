"""10,000 claims held by one process: the heartbeat on one redis-server and on a Cluster.

Starts a redis-server and a Redis Cluster of three masters (no replicas by default, so
each setup's server CPU is the CPU of the servers that serve the claims, nothing else),
both on free TCP ports, and reaches each through a URL (``redis://…`` and
``redis+cluster://…``, through ``fenced._client.connect``). In turns, one setup at a
time, it holds the claims (ttl 6 s, renewed every 2 s), lets their renewals settle into
their steady rounds, and measures over whole renewal intervals:

* the pipelined round trips of the heartbeat, and its rounds (one round dispatches the
  due claims to one lane per server: per node on a cluster);
* the refreshes per claim (``EVALSHA`` calls in ``INFO commandstats``, every master);
* the CPU of this process, and of the servers (``INFO cpu``, summed over the masters);
* the lanes that sent renewals, and whether any claim was lost (none may be).

Run: ``python benchmarks/held_claims.py`` (about two minutes), ``--quick`` (one
phase per setup, about forty seconds), ``--json`` for machine-readable output.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    Rates,
    evalsha_calls,
    machine_info,
    machine_line,
    paired_ratio,
    server_cpu,
    start_server,
    table,
)

from fenced import Claim
from fenced._client import connect
from fenced._heartbeat import BATCH, Heartbeat, heartbeat
from fenced.testing import RedisCluster, RedisServer

SETUPS = ("single", "cluster")
#: The figures measured per renewal interval, and how the report names them.
FIGURES = {
    "round_trips": "pipelined round trips",
    "rounds": "heartbeat rounds",
    "round_trips_per_round": "round trips per round",
    "refreshes_per_claim": "refreshes per claim",
    "renewal_period_s": "seconds between refreshes",
    "process_cpu_ms": "process CPU ms",
    "server_cpu_ms": "server CPU ms (all masters)",
}


class BenchError(RuntimeError):
    """The heartbeat did not do what it is measured doing."""


class Setup:
    """One way of reaching Redis: its client, and a probe client per master."""

    def __init__(self, name: str, url: str, probes: list[Any]) -> None:
        self.name = name
        self.url = url
        self.client = connect(url)
        self.probes = probes

    def server_cpu(self) -> float:
        return sum(server_cpu(p) for p in self.probes)

    def evalsha(self) -> int:
        return sum(evalsha_calls(p) for p in self.probes)


def _lane_trips(hb: Heartbeat) -> dict[Any, int]:
    """Round trips sent so far by each open lane.

    Per lane, because ``Heartbeat.round_trips`` sums over the lanes open now: a lane
    closed after its last use (the other setup's) would take its count with it.
    """
    return {lane: lane.round_trips for lane in list(hb._lanes.values())}


def _after_next_round(hb: Heartbeat, every: float) -> None:
    """Return a while after the next round starts: windows span whole rounds only."""
    seen, give_up = hb.rounds, time.monotonic() + 3 * every
    while hb.rounds == seen:
        if time.monotonic() > give_up:
            raise BenchError(f"no heartbeat round in {3 * every:g} s")
        time.sleep(0.005)
    time.sleep(every * 0.3)


def hold(
    setup: Setup, n: int, ttl: float, every: float, intervals: int, settle: int
) -> dict[str, Any]:
    """Hold ``n`` claims through ``setup`` and measure the heartbeat per interval."""
    hb = heartbeat()
    claims = [
        Claim(setup.client, f"bench:held:{i}", ttl=ttl, refresh_every=every, records=False)
        for i in range(n)
    ]
    t0 = time.perf_counter()
    for c in claims:
        if not c.acquire():
            raise BenchError(f"{setup.name}: claim {c.name} could not be acquired")
    acquire_s = time.perf_counter() - t0
    # Acquired over a second or more, their renewals start in several groups; the
    # groups merge within a few intervals (the heartbeat's COALESCE).
    time.sleep(settle * every)

    _after_next_round(hb, every)
    rounds0, lanes0 = hb.rounds, _lane_trips(hb)
    evalsha0, srv0 = setup.evalsha(), setup.server_cpu()
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep((intervals - 0.5) * every)
    _after_next_round(hb, every)
    wall = time.monotonic() - wall0
    cpu = time.process_time() - cpu0
    srv, evalsha = setup.server_cpu() - srv0, setup.evalsha() - evalsha0
    rounds, lanes1 = hb.rounds - rounds0, _lane_trips(hb)

    lost = sum(1 for c in claims if c.lost or not c.held)
    per_lane = sorted(
        (t - lanes0.get(lane, 0) for lane, t in lanes1.items() if t > lanes0.get(lane, 0)),
        reverse=True,
    )
    trips = sum(per_lane)
    t0 = time.perf_counter()
    for c in claims:
        c.release()
    release_s = time.perf_counter() - t0
    del claims
    gc.collect()
    per = wall / every
    return {
        "setup": setup.name,
        "intervals": round(per, 2),
        "round_trips": trips / per,
        "rounds": rounds / per,
        "round_trips_per_round": trips / rounds if rounds else 0.0,
        "refreshes_per_claim": evalsha / n / per,
        # A claim's next refresh is due one interval after its last was sent, so the
        # period is the interval plus the time a round takes to reach it.
        "renewal_period_s": n * wall / evalsha if evalsha else 0.0,
        "process_cpu_ms": cpu / per * 1000,
        "server_cpu_ms": srv / per * 1000,
        "lanes_used": len(per_lane),
        "round_trips_per_lane": [t / per for t in per_lane],
        "lost": lost,
        "acquire_per_s": n / acquire_s,
        "release_per_s": n / release_s,
    }


def summarize(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Median per setup of each figure, and the paired ratios cluster/single."""
    rates = {
        (s, f): Rates(f"{s}:{f}", [p[f] for p in phases if p["setup"] == s])
        for s in SETUPS
        for f in FIGURES
    }
    out: dict[str, Any] = {"figures": {}, "lost": sum(p["lost"] for p in phases)}
    for f in FIGURES:
        single, cluster = rates[("single", f)], rates[("cluster", f)]
        # Phases alternate, so phase i of the cluster and phase i of the single server
        # ran moments apart: the ratio of each pair, then their median.
        ratio, low, high = paired_ratio(cluster, single)
        out["figures"][f] = {
            "single": single.median,
            "single_range": [single.low, single.high],
            "cluster": cluster.median,
            "cluster_range": [cluster.low, cluster.high],
            "ratio_cluster_to_single": ratio,
            "ratio_range": [low, high],
        }
    for s in SETUPS:
        mine = [p for p in phases if p["setup"] == s]
        out[s] = {
            "lanes_used": max(p["lanes_used"] for p in mine),
            "acquire_per_s": statistics.median(p["acquire_per_s"] for p in mine),
            "release_per_s": statistics.median(p["release_per_s"] for p in mine),
        }
    return out


def check(result: dict[str, Any]) -> list[str]:
    """What the heartbeat must do; a list of what it did not."""
    problems = []
    n, masters = result["settings"]["claims"], result["settings"]["masters"]
    per_node = -(-n // masters // BATCH)  # pipelines of BATCH refreshes, per node
    for p in result["phases"]:
        where = f"{p['setup']} phase"
        if p["lost"]:
            problems.append(f"{where}: {p['lost']} claim(s) lost")
        lanes = 1 if p["setup"] == "single" else masters
        if p["lanes_used"] != lanes:
            problems.append(f"{where}: renewals went through {p['lanes_used']} lanes, not {lanes}")
        # Each claim once per interval, in pipelines of BATCH: a few round trips per
        # server and round, never one per claim.
        most = (-(-n // BATCH) if lanes == 1 else lanes * (per_node + 1)) * p["rounds"] + 1
        if p["round_trips"] > most:
            problems.append(
                f"{where}: {p['round_trips']:.1f} round trips per interval (at most {most:.0f})"
            )
        # At least one refresh per half ttl (a claim then outlives one lost round), and
        # at most two per interval (the heartbeat's COALESCE).
        ttl, every = result["settings"]["ttl_s"], result["settings"]["refresh_every_s"]
        if not ttl / 2 > p["renewal_period_s"] >= every / 2:
            problems.append(f"{where}: a refresh every {p['renewal_period_s']:.2f} s")
    return problems


def render(result: dict[str, Any]) -> str:
    """The human-readable report."""
    info, st, summary = result["info"], result["settings"], result["summary"]
    topology = f"{st['masters']} masters" + (
        f", {st['replicas']} replica(s) each" if st["replicas"] else ", no replicas"
    )
    lines = [
        machine_line("held_claims", info),
        f"{st['claims']:,} claims held by one process, ttl {st['ttl_s']:g} s, renewed every "
        f"{st['refresh_every_s']:g} s; single redis-server vs Redis Cluster ({topology}); "
        f"{st['phases']} alternating phases per setup, each over {st['intervals']} intervals "
        f"after {st['settle']} to settle; medians per interval (min-max over phases)",
        "",
    ]

    def fmt(v: float, f: str) -> str:
        return f"{v:.0f}" if f.endswith("_ms") else f"{v:.2f}"

    rows = []
    for f, label in FIGURES.items():
        fig = summary["figures"][f]
        rows.append(
            [
                label,
                fmt(fig["single"], f),
                "-".join(fmt(v, f) for v in fig["single_range"]),
                fmt(fig["cluster"], f),
                "-".join(fmt(v, f) for v in fig["cluster_range"]),
                f"{fig['ratio_cluster_to_single']:.2f}x",
                "-".join(f"{v:.2f}" for v in fig["ratio_range"]),
            ]
        )
    lines.append(
        table(
            ["per renewal interval", "single", "(range)", "cluster", "(range)", "ratio", "(range)"],
            rows,
            right={1, 2, 3, 4, 5, 6},
        )
    )
    lines.append(
        "ratio: cluster/single, the median of the ratios of phases run one after the other"
    )
    lines.append("")
    for s in SETUPS:
        trips = [p["round_trips_per_lane"] for p in result["phases"] if p["setup"] == s]
        per_lane = ", ".join("/".join(f"{t:.1f}" for t in lanes) for lanes in trips)
        lines.append(
            f"{s}: lanes that renewed {summary[s]['lanes_used']}, round trips per lane and "
            f"interval {per_lane}; acquire {summary[s]['acquire_per_s']:,.0f}/s, "
            f"release {summary[s]['release_per_s']:,.0f}/s"
        )
    lines.append(f"claims lost: {summary['lost']}")
    problems = result["problems"]
    lines += ["", "checks: " + ("all met" if not problems else "FAILED")]
    lines += [f"  {p}" for p in problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the report; 1 when a check failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one phase per setup, about half a minute")
    ap.add_argument("--claims", type=int, default=10_000, help="claims held at once")
    ap.add_argument("--phases", type=int, help="measured phases per setup (alternating)")
    ap.add_argument("--intervals", type=int, help="renewal intervals measured per phase")
    ap.add_argument("--masters", type=int, default=3, help="cluster masters")
    ap.add_argument("--replicas", type=int, default=0, help="replicas per cluster master")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = ap.parse_args(argv)
    if args.claims < 1 or args.masters < 1 or args.replicas < 0:
        ap.error("--claims and --masters must be at least 1, --replicas at least 0")

    ttl, every = 6.0, 2.0
    phases = args.phases or (1 if args.quick else 3)
    intervals = args.intervals or (2 if args.quick else 4)
    settle = 2 if args.quick else 3

    import logging

    logging.disable(logging.WARNING)

    def say(msg: str) -> None:
        if not args.json:
            print(f"  {msg}", file=sys.stderr, flush=True)

    server: RedisServer | None = None
    cluster: RedisCluster | None = None
    probes: list[Any] = []
    try:
        server = start_server()
        cluster = RedisCluster(masters=args.masters, replicas=args.replicas, binary=server.binary)
        cluster.start()
        info = machine_info(server)
        probes = [server.client()] + [m.client() for m in cluster.masters()]
        setups = {
            "single": Setup("single", server.url, probes[:1]),
            "cluster": Setup("cluster", cluster.startup_url, probes[1:]),
        }
        say(f"redis-server on {server.url}; cluster {cluster.startup_url}")
        measured: list[dict[str, Any]] = []
        for i in range(phases):
            # Alternate, and swap which goes first each time: a drift in the machine's
            # load then weighs on both setups alike.
            order: tuple[str, ...] = SETUPS if i % 2 == 0 else SETUPS[::-1]
            for name in order:
                say(f"phase {i + 1}/{phases}: {args.claims:,} claims on {name}")
                measured.append(hold(setups[name], args.claims, ttl, every, intervals, settle))
        info["loadavg_end"] = list(os.getloadavg())
        result: dict[str, Any] = {
            "info": info,
            "settings": {
                "claims": args.claims,
                "ttl_s": ttl,
                "refresh_every_s": every,
                "phases": phases,
                "intervals": intervals,
                "settle": settle,
                "masters": args.masters,
                "replicas": args.replicas,
                "batch": BATCH,
            },
            "phases": measured,
            "summary": summarize(measured),
        }
        result["problems"] = check(result)
    finally:
        for p in probes:
            p.close()
        if cluster is not None:
            cluster.stop()
        if server is not None:
            server.stop()
    print(json.dumps(result, indent=2) if args.json else render(result))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())

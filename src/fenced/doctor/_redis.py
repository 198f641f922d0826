"""Checks of the lock Redis: eviction, persistence, role, cluster, clock skew and version."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from .._nodes import is_cluster, primaries
from .._scripts import as_text
from ._finding import Finding, listed

__all__ = ["MIN_REDIS", "check_redis", "version_findings"]

#: Oldest Redis the claim scripts run on: TIME before a write (and XADD for pointers).
MIN_REDIS = (5, 0)


def _version(text: str) -> tuple[int, ...]:
    """The leading digits of each part ("7.2.4-rc1" is (7, 2, 4); no digits count 0)."""
    return tuple(int("0" + re.sub(r"\D.*", "", part)) for part in text.split("."))


@listed
def version_findings(version: str) -> Iterator[Finding]:
    """The finding for a Redis server version, if it is too old for the claim scripts."""
    if _version(version) < MIN_REDIS:
        yield Finding(
            "error",
            "redis.version",
            f"Redis {version} is older than 5.0",
            "The claim scripts read TIME before writing, to mint the fence and to time "
            "each run record, which older servers refuse without script effects "
            "replication: acquire and release fail on this server (and Redis pointers "
            "log with XADD: streams arrived in 5.0).",
            "Upgrade the lock Redis to 6.2 or later (5.0 at the very least).",
        )


def _config(client: Any, name: str) -> str | None:
    """One CONFIG GET value, or None where CONFIG is disabled (managed Redis, ACLs)."""
    try:
        raw = client.config_get(name)
    except Exception:
        return None
    values = {as_text(k): as_text(v) for k, v in (raw or {}).items()}
    return values.get(name)


def _policy(info: Mapping[str, Any], client: Any) -> str | None:
    """maxmemory-policy from INFO, else from CONFIG GET; None when neither says."""
    policy = info.get("maxmemory_policy")
    return as_text(policy) if policy is not None else _config(client, "maxmemory-policy")


def _policy_findings(info: Mapping[str, Any], client: Any) -> Iterator[Finding]:
    policy = _policy(info, client)
    if policy is None:
        yield Finding(
            "warning",
            "redis.maxmemory-policy-unknown",
            "Could not read maxmemory-policy (neither INFO memory nor CONFIG GET answered)",
            "Any policy other than noeviction can delete claim keys under memory "
            "pressure, and the doctor cannot tell which one this server uses.",
            "Check it on the server: `redis-cli CONFIG GET maxmemory-policy` must say "
            "noeviction (managed Redis: the parameter group's maxmemory-policy).",
        )
    elif policy != "noeviction":
        if policy.startswith("volatile"):
            scope = (
                "volatile-* policies evict only keys that carry a TTL, and every claim "
                "carries one: under memory pressure, locks are the first keys to go"
            )
        else:
            scope = "allkeys-* policies evict any key, locks included, under memory pressure"
        yield Finding(
            "error",
            "redis.maxmemory-policy",
            f"maxmemory-policy is {policy}, not noeviction",
            f"An evicted lock is a claim that silently ends while its holder works: "
            f"the next worker acquires it and two runs write the same output. {scope}.",
            "`CONFIG SET maxmemory-policy noeviction` now, and `maxmemory-policy "
            "noeviction` in redis.conf (or `CONFIG REWRITE`) so it survives a restart; "
            "or give claims their own Redis, separate from any cache.",
        )
    maxmemory = int(info.get("maxmemory", 0) or 0)
    if policy == "noeviction" and maxmemory > 0:
        yield Finding(
            "info",
            "redis.maxmemory",
            f"maxmemory is {maxmemory} bytes with noeviction",
            "When this server is full it refuses writes (OOM) rather than evicting: "
            "acquiring a claim then raises and the work does not start (fail closed).",
            "Nothing to change; keep memory headroom, or raise `maxmemory`.",
        )


def _persistence_finding(info: Mapping[str, Any], client: Any) -> Finding:
    save = _config(client, "save")
    aof = _config(client, "appendonly")
    if aof is None and "aof_enabled" in info:
        aof = "yes" if int(info["aof_enabled"]) else "no"
    parts = [
        "save " + (repr(save) if save is not None else "unknown (CONFIG unavailable)"),
        "appendonly " + (aof if aof is not None else "unknown"),
    ]
    persistent = (save not in (None, "")) or aof == "yes"
    state = "persists to disk" if persistent else "keeps nothing across a restart"
    return Finding(
        "info",
        "redis.persistence",
        f"Persistence: {', '.join(parts)}; this server {state}",
        "Claims are advisory and short-lived: after a restart that loses them, a second "
        "run can start while the first still works, until the first one's next refresh "
        "finds its lease gone and stops; fenced writes reject it meanwhile. Fence tokens "
        "stay monotonic regardless: the acquire script never mints one below Redis TIME "
        "in microseconds, so only a server clock stepped backwards could repeat one.",
        "Nothing required. To keep claims across restarts: `CONFIG SET appendonly yes` "
        "and `appendonly yes` in redis.conf.",
    )


def _replication_findings(info: Mapping[str, Any]) -> Iterator[Finding]:
    role = as_text(info.get("role", "master"))
    if role in ("slave", "replica"):
        host = info.get("master_host", "?")
        port = info.get("master_port", "?")
        yield Finding(
            "error",
            "redis.replica",
            f"This server is a replica of {host}:{port}",
            "Claims must be taken on the master: a read-only replica refuses the "
            "acquire script, and a writable one keeps a lease that no other worker "
            "sees and the next sync from the master erases.",
            f"Point the lock store at the master: redis://{host}:{port}/<db> "
            "(Celery setting `fenced_redis_url`, or FENCED_REDIS_URL).",
        )
    elif (replicas := int(info.get("connected_slaves", 0) or 0)) > 0:
        yield Finding(
            "info",
            "redis.replication",
            f"This master has {replicas} connected replica(s)",
            "Replication is asynchronous: a failover right after an acquire can promote "
            "a replica that never saw the lease, and a second worker then acquires the "
            "same claim. The fence still protects writes: the new master mints fences "
            "no lower than its TIME, so the stale holder's publish is rejected.",
            "Write through fenced pointers/upserts so a second holder is harmless; to "
            "narrow the window, send `WAIT 1 100` after acquiring (redis-py: "
            "client.wait(1, 100)).",
        )


def _cluster_finding(info: Mapping[str, Any]) -> Iterator[Finding]:
    if int(info.get("cluster_enabled", 0) or 0) or as_text(info.get("redis_mode")) == "cluster":
        yield Finding(
            "info",
            "redis.cluster",
            "This server runs in cluster mode",
            "Every key of one claim shares the hash tag {name}, so each claim script "
            "touches a single slot; claims on different names spread over the shards. "
            "Each shard replicates asynchronously, as a single master does.",
            "Nothing to change; connect with a cluster client "
            "(redis.cluster.RedisCluster.from_url(...)).",
        )


def _skew_finding(client: Any, clock: Callable[[], float], max_skew: float) -> Iterator[Finding]:
    before = clock()
    seconds, micros = client.time()
    after = clock()
    server = int(seconds) + int(micros) / 1e6
    skew = server - (before + after) / 2
    # The reply could have been read anywhere within the round trip.
    uncertainty = (after - before) / 2
    if abs(skew) - uncertainty <= max_skew:
        return
    ahead = "ahead of" if skew > 0 else "behind"
    yield Finding(
        "warning",
        "redis.clock-skew",
        f"Redis TIME is {abs(skew):.3f} s {ahead} this host's clock (more than {max_skew:g} s)",
        "Leases themselves do not depend on it (Redis counts TTLs on its own clock, "
        "fenced's deadlines run on this host's monotonic clock), but run records mix "
        "both clocks, so ages and durations shown are off by the skew; a clock this "
        "far off is not synchronised, and its rate can drift beyond the claim's drift "
        "margin (1 % of the TTL); a Redis clock stepped backwards before a restart "
        "without persistence weakens the fence floor (Redis TIME in microseconds).",
        "Synchronise both clocks with NTP (chrony or systemd-timesyncd); check with "
        "`chronyc tracking` or `timedatectl status`.",
    )


@listed
def check_redis(
    client: Any, *, max_skew: float = 0.5, clock: Callable[[], float] = time.time
) -> Iterator[Finding]:
    """Check the lock Redis: eviction, persistence, role, cluster, clock skew, version.

    A cluster client has every primary checked, and the nodes compared: a claim gets
    the settings of the node that serves its slot.
    """
    if is_cluster(client):
        return _check_cluster(client, max_skew, clock)
    return _check_server(client, max_skew, clock)


def _unreachable(exc: BaseException, where: str = "the lock Redis") -> Finding:
    return Finding(
        "error",
        "redis.unreachable",
        f"Cannot query {where}: {exc}",
        "Claims fail closed: while the lock store is unreachable no claimed work starts.",
        "Check the URL (`--redis`, `fenced_redis_url` or FENCED_REDIS_URL) and that "
        "the server is running: `redis-cli -u URL ping`.",
    )


def _check_server(client: Any, max_skew: float, clock: Callable[[], float]) -> Iterator[Finding]:
    try:
        info: Mapping[str, Any] = client.info()
    except Exception as exc:
        yield _unreachable(exc)
        return
    yield from version_findings(as_text(info.get("redis_version", "0")))
    yield from _policy_findings(info, client)
    evicted = int(info.get("evicted_keys", 0) or 0)
    if evicted > 0:
        yield Finding(
            "warning",
            "redis.evicted-keys",
            f"{evicted} keys were evicted since the server started (or stats were reset)",
            "Evictions mean this server ran out of memory under an evicting policy; "
            "any lock among the evicted keys ended while its holder still worked.",
            "Set `maxmemory-policy noeviction` (or give claims their own Redis), then "
            "`CONFIG RESETSTAT` so new evictions stand out.",
        )
    yield _persistence_finding(info, client)
    yield from _replication_findings(info)
    yield from _cluster_finding(info)
    try:
        yield from _skew_finding(client, clock, max_skew)
    except Exception as exc:  # TIME denied by an ACL: report, do not abort the other checks
        yield Finding(
            "info",
            "redis.clock-unknown",
            f"Could not read Redis TIME ({exc})",
            "Clock skew between this host and Redis could not be measured.",
            "Allow the TIME command for this user, or compare clocks by hand.",
        )


def _check_cluster(client: Any, max_skew: float, clock: Callable[[], float]) -> Iterator[Finding]:
    try:
        nodes = primaries(client)
    except Exception as exc:
        yield _unreachable(exc, "the lock Redis Cluster")
        return
    per_node: dict[str, list[Finding]] = {}
    settings: dict[str, dict[str, str]] = {}
    for name, node in nodes:
        # One note for the whole cluster, below, instead of one per node.
        checked = list(_check_server(node, max_skew, clock))
        per_node[name] = [f for f in checked if f.code != "redis.cluster"]
        if "redis.unreachable" not in {f.code for f in checked}:
            settings[name] = _settings(node)
    names = sorted(per_node)
    yield from _merged(per_node)
    yield Finding(
        "info",
        "redis.cluster",
        f"A Redis Cluster of {len(names)} primaries ({', '.join(names)}); each was checked",
        "Every key of one claim shares the hash tag {name}, so each claim script "
        "touches a single slot, on the primary that serves it; claims on different "
        "names spread over the primaries. Each replicates asynchronously, as a single "
        "master does.",
        "Nothing to change.",
    )
    yield from _differences(settings)


def _merged(per_node: Mapping[str, list[Finding]]) -> list[Finding]:
    """One finding for what several nodes share, naming them (or 'every primary')."""
    groups: dict[Finding, list[str]] = {}
    for name, findings in per_node.items():
        for finding in findings:
            groups.setdefault(finding, []).append(name)
    merged = []
    for finding, names in groups.items():
        where = (
            f"every primary ({len(names)})"
            if len(names) == len(per_node) and len(names) > 1
            else ", ".join(names)
        )
        merged.append(replace(finding, what=f"{finding.what} [{where}]", subject=", ".join(names)))
    return merged


def _settings(client: Any) -> dict[str, str]:
    """The settings a claim depends on, as one node reports them ('?' where unreadable)."""
    try:
        info = client.info()
    except Exception:
        info = {}
    found = {
        "maxmemory-policy": _policy(info, client),
        "save": _config(client, "save"),
        "appendonly": _config(client, "appendonly"),
    }
    return {k: "?" if v is None else v for k, v in found.items()}


def _differences(settings: Mapping[str, Mapping[str, str]]) -> Iterator[Finding]:
    """A warning when the primaries differ in eviction policy or persistence."""
    differing = []
    for setting in ("maxmemory-policy", "save", "appendonly"):
        values = {name: s[setting] for name, s in sorted(settings.items())}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"{name} {value!r}" for name, value in values.items())
            differing.append(f"{setting}: {shown}")
    if differing:
        yield Finding(
            "warning",
            "redis.cluster-nodes-differ",
            "The cluster's primaries are configured differently: " + "; ".join(differing),
            "A claim lives on the one primary that serves its slot and gets that node's "
            "settings: claims on some names can be evicted under memory pressure, or lost "
            "at a restart, while claims on other names are kept. A node configured apart "
            "was usually set up by hand or restarted from an old redis.conf, and a "
            "failover can promote a replica configured differently again.",
            "Give every node, primaries and replicas, the same settings: `CONFIG SET "
            "maxmemory-policy noeviction` (and the same `save` and `appendonly`) on each, "
            "and the same lines in each node's redis.conf (or `CONFIG REWRITE`).",
        )

"""Operating claims on a Redis Cluster: list, show, release and the doctor, on every primary.

A cluster client routes key commands to their slot's primary, but SCAN, TIME, INFO and
CONFIG answer for one node only; these tests put claims on every primary of a real
3-master cluster and check that nothing is missed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from fenced import Claim
from fenced._inspect import force_release, list_claims, show_claim
from fenced._lease import short_token
from fenced.doctor import check_redis, load_records
from fenced.testing import RedisCluster, SentinelGroup


@pytest.fixture
def client(ha_cluster: RedisCluster) -> Iterator[Any]:
    """A cluster client, decoding replies."""
    c = ha_cluster.client(decode_responses=True)
    yield c
    c.close()


def names_on_every_master(cluster: RedisCluster, client: Any, per_master: int = 2) -> list[str]:
    """Claim names whose keys are served by each master in turn, ``per_master`` each."""
    wanted = {m.port: per_master for m in cluster.masters()}
    found: list[str] = []
    for i in range(2000):
        name = f"rebuild:tenant-{i}"
        port = cluster.master_for_key(Claim(client, name, heartbeat=False).key).port
        if wanted.get(port, 0) > 0:
            wanted[port] -= 1
            found.append(name)
        if not any(wanted.values()):
            return found
    raise AssertionError(f"names missing for some masters: {wanted}")


def hold(client: Any, name: str) -> Claim:
    claim = Claim(client, name, ttl=60, heartbeat=False, records=True)
    assert claim.acquire()
    return claim


def test_ls_lists_the_claims_of_every_primary(ha_cluster: RedisCluster, client: Any) -> None:
    names = names_on_every_master(ha_cluster, client)
    # A finished run before the current one: ls shows how the previous run ended.
    first = hold(client, names[0])
    assert first.release("failed")
    claims = {name: hold(client, name) for name in names}
    infos = list_claims(client)
    assert [i.name for i in infos] == sorted(names)
    for info in infos:
        claim = claims[info.name]
        assert info.holder is not None
        assert info.holder.token == short_token(claim.token) and info.fence == claim.fence
        # Measured on the clock of the claim's own node: a fresh claim is seconds old.
        assert info.age is not None and 0 <= info.age < 30
        assert info.expires_in is not None and 50 < info.expires_in <= 60
    assert next(i for i in infos if i.name == names[0]).last_outcome == "failed"
    assert list_claims(client, namespace="other") == []


def test_show_and_release_a_claim_on_each_primary(ha_cluster: RedisCluster, client: Any) -> None:
    names = names_on_every_master(ha_cluster, client, per_master=1)
    claims = [hold(client, name) for name in names]
    for claim in claims:
        report = show_claim(client, claim.name)
        assert report.holder is not None and report.holder.token == short_token(claim.token)
        assert [run.outcome for run in report.runs] == ["running"]
        cleared = force_release(client, claim.name, reason="holder gone", by="ops@test")
        assert cleared is not None and cleared.token == short_token(claim.token)
        after = show_claim(client, claim.name)
        assert after.holder is None
        assert after.runs[0].outcome == "released" and after.runs[0].reason == "holder gone"
    assert list_claims(client) == []


def test_the_doctor_reads_run_records_from_every_primary(
    ha_cluster: RedisCluster, client: Any
) -> None:
    names = names_on_every_master(ha_cluster, client, per_master=1)
    for name in names:
        assert hold(client, name).release("ok")
    assert {r["name"] for r in load_records(client)} == set(names)


def test_the_doctor_checks_every_primary(ha_cluster: RedisCluster, client: Any) -> None:
    primaries = [f"127.0.0.1:{m.port}" for m in ha_cluster.masters()]
    found = check_redis(client)
    assert not [f for f in found if f.severity != "info"], found
    (cluster,) = [f for f in found if f.code == "redis.cluster"]
    assert all(p in cluster.what for p in primaries)
    # A note every primary shares is given once, naming them all.
    (persistence,) = [f for f in found if f.code == "redis.persistence"]
    assert persistence.subject == ", ".join(primaries)


def test_the_doctor_finds_a_primary_configured_apart(ha_cluster: RedisCluster) -> None:
    client = ha_cluster.client(decode_responses=True)
    odd = ha_cluster.masters()[1]
    node = odd.client(decode_responses=True)
    try:
        node.config_set("maxmemory-policy", "allkeys-lru")
        node.config_set("appendonly", "yes")
        found = check_redis(client)
        (policy,) = [f for f in found if f.code == "redis.maxmemory-policy"]
        assert policy.severity == "error" and policy.subject == f"127.0.0.1:{odd.port}"
        (differ,) = [f for f in found if f.code == "redis.cluster-nodes-differ"]
        assert differ.severity == "warning"
        assert f"127.0.0.1:{odd.port} 'allkeys-lru'" in differ.what
        assert "appendonly" in differ.what and "save" not in differ.what
        node.config_set("maxmemory-policy", "noeviction")
        node.config_set("appendonly", "no")
        assert "redis.cluster-nodes-differ" not in {f.code for f in check_redis(client)}
    finally:
        node.config_set("maxmemory-policy", "noeviction")
        node.config_set("appendonly", "no")
        node.close()
        client.close()


def test_ls_and_show_through_a_sentinel_managed_client(sentinel_group: SentinelGroup) -> None:
    client = sentinel_group.master_client(decode_responses=True)
    try:
        claim = hold(client, "backup:db")
        (info,) = list_claims(client)
        assert info.holder is not None
        assert info.name == "backup:db" and info.holder.token == short_token(claim.token)
        assert show_claim(client, "backup:db").runs[0].outcome == "running"
        assert claim.release("ok")
        assert list_claims(client) == []
    finally:
        client.close()


# -- the fenced command, as a subprocess, on the cluster ----------------------------------

FENCED = [sys.executable, "-m", "fenced.cli"]


def fenced(url: str, command: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``fenced COMMAND --redis URL ARGS...`` (the URL before any ``--``)."""
    env = {k: v for k, v in os.environ.items() if k != "FENCED_REDIS_URL"}
    return subprocess.run(
        [*FENCED, command, "--redis", url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_cli_ls_show_and_release_on_a_cluster(ha_cluster: RedisCluster, client: Any) -> None:
    names = names_on_every_master(ha_cluster, client)
    claims = {name: hold(client, name) for name in names}
    url = ha_cluster.startup_url
    ls = fenced(url, "ls", "--json")
    assert ls.returncode == 0, ls.stderr
    listed = {c["name"]: c for c in json.loads(ls.stdout)}
    assert set(listed) == set(names)
    assert all(listed[n]["fence"] == claims[n].fence for n in names)
    table = fenced(url, "ls")
    assert table.returncode == 0 and f"{len(names)} held" in table.stdout, table.stderr
    gone = names[-1]
    shown = fenced(url, "show", gone, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["holder"]["fence"] == claims[gone].fence
    refused = fenced(url, "release", gone)
    assert refused.returncode == 1 and "held by" in refused.stderr
    released = fenced(url, "release", gone, "--force", "--reason", "host died", "--json")
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout)["released"] is True
    after = json.loads(fenced(url, "ls", "--json").stdout)
    assert {c["name"] for c in after} == set(names) - {gone}


def test_cli_lists_and_clears_the_enqueue_markers_of_every_primary(
    ha_cluster: RedisCluster, client: Any
) -> None:
    from fenced._lease import ClaimKeys
    from fenced.celery import _enqueue

    names = [f"feed:{n}" for n in names_on_every_master(ha_cluster, client)]
    for i, name in enumerate(names):
        assert _enqueue.mark(client, ClaimKeys.of(name), f"task-{i}", 60_000, None) is None
    url = ha_cluster.startup_url
    listed = {c["name"]: c for c in json.loads(fenced(url, "ls", "--json").stdout)}
    assert {n: listed[n]["queued"]["task_id"] for n in names} == {
        n: f"task-{i}" for i, n in enumerate(names)
    }
    cleared = fenced(url, "unqueue", "--all", "--json")
    assert cleared.returncode == 0, cleared.stderr
    assert {(c["name"], c["task_id"]) for c in json.loads(cleared.stdout)} >= {
        (n, f"task-{i}") for i, n in enumerate(names)
    }
    after = {c["name"] for c in json.loads(fenced(url, "ls", "--json").stdout)}
    assert not after & set(names)


def test_cli_run_records_a_run_on_a_cluster(ha_cluster: RedisCluster) -> None:
    url = ha_cluster.startup_url
    done = fenced(url, "run", "backup:db", "--ttl", "5", "--", sys.executable, "-c", "pass")
    assert done.returncode == 0, done.stderr
    shown = json.loads(fenced(url, "show", "backup:db", "--json").stdout)
    assert shown["holder"] is None
    assert [r["outcome"] for r in shown["runs"]] == ["ok"]


def test_cli_doctor_on_a_cluster_checks_every_primary(ha_cluster: RedisCluster) -> None:
    checked = fenced(ha_cluster.startup_url, "doctor", "--json")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    report = json.loads(checked.stdout)
    (cluster,) = [f for f in report["findings"] if f["code"] == "redis.cluster"]
    assert all(f"127.0.0.1:{m.port}" in cluster["what"] for m in ha_cluster.masters())


def test_cli_ls_through_sentinels(sentinel_group: SentinelGroup) -> None:
    client = sentinel_group.master_client(decode_responses=True)
    try:
        claim = hold(client, "backup:db")
        ls = fenced(sentinel_group.url, "ls", "--json")
        assert ls.returncode == 0, ls.stderr
        (listed,) = json.loads(ls.stdout)
        assert listed["name"] == "backup:db" and listed["fence"] == claim.fence
        assert claim.release("ok")
    finally:
        client.close()

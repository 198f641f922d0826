"""fenced.metrics: Prometheus counts of real claims, in a registry, a prefork worker and a file.

Claims are taken on a real redis-server; the Celery case runs a real prefork worker in
prometheus_client's multiprocess mode and scrapes its ``/metrics`` over HTTP; ``fenced
run --metrics-file`` runs the real command line.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import fenced.metrics
from _wait import wait_for
from celery_harness import WAIT, Services, Worker, notes
from fenced import Claim, ConfigError, Skipped, exclusive
from fenced.celery._metrics import settings
from fenced.events import ClaimEvent
from fenced.metrics import ClaimMetrics, Textfile
from fenced.testing import CeleryWorker, RedisServer, free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def r(redis_server: RedisServer) -> Iterator[Any]:
    client = redis_server.client()
    yield client
    client.close()


def value(reg: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value, 0 when the series does not exist (yet)."""
    return reg.get_sample_value(name, labels) or 0.0


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# -- in a registry ------------------------------------------------------------------------


def test_claim_acquire_skip_release_and_loss_are_counted_by_label(
    registry: CollectorRegistry, r: Any
) -> None:
    name = unique("metrics")
    with Claim(r, name, ttl=5):
        assert value(registry, "fenced_claims_held", label=name) == 1
        assert not Claim(r, name, ttl=5).acquire()
    assert value(registry, "fenced_claims_acquired_total", label=name) == 1
    assert value(registry, "fenced_claims_skipped_total", label=name, reason="already_running") == 1
    assert value(registry, "fenced_claims_released_total", label=name, outcome="ok") == 1
    assert value(registry, "fenced_claims_held", label=name) == 0

    stolen = Claim(r, name, ttl=5, heartbeat=False)
    assert stolen.acquire()
    r.set(stolen.key, "thief", px=5000)
    assert stolen.refresh() is False and stolen.lost
    stolen.release()
    assert value(registry, "fenced_claims_lost_total", label=name, cause="taken") == 1
    assert value(registry, "fenced_claims_acquired_total", label=name) == 2
    # A loss, then the release of the lost claim: it left the gauge once, and its time
    # is in the histogram once.
    assert value(registry, "fenced_claims_held", label=name) == 0
    assert value(registry, "fenced_run_duration_seconds_count", label=name) == 2
    # Never labelled by anything but the label.
    for metric in registry.collect():
        for sample in metric.samples:
            assert set(sample.labels) <= {"label", "reason", "cause", "outcome", "le"}


def test_exclusive_counts_under_its_template_with_outcomes_and_reasons(
    registry: CollectorRegistry, r: Any
) -> None:
    template = unique("report") + ":{tenant}"
    started, finish = threading.Event(), threading.Event()

    @exclusive(template, redis=r, ttl=5)
    def report(tenant: str, fail: bool = False) -> str:
        started.set()
        finish.wait(5)
        if fail:
            raise ValueError("broken input")
        return tenant

    worker = threading.Thread(target=report, args=("acme",))
    worker.start()
    assert started.wait(5)
    assert isinstance(report("acme"), Skipped)
    finish.set()
    worker.join(5)
    with pytest.raises(ValueError):
        report("globex", fail=True)
    assert report("initech") == "initech"

    assert value(registry, "fenced_claims_acquired_total", label=template) == 3
    assert (
        value(registry, "fenced_claims_skipped_total", label=template, reason="already_running")
        == 1
    )
    assert value(registry, "fenced_claims_released_total", label=template, outcome="ok") == 2
    assert value(registry, "fenced_claims_released_total", label=template, outcome="failed") == 1
    assert value(registry, "fenced_run_duration_seconds_count", label=template) == 3
    assert value(registry, "fenced_claims_held", label=template) == 0

    @exclusive(template + ":cool", redis=r, ttl=5, cooldown=30)
    def cooled(tenant: str) -> str:
        return tenant

    assert cooled("a") == "a"
    assert not cooled("a")
    assert (
        value(
            registry,
            "fenced_claims_skipped_total",
            label=template + ":cool",
            reason="ran_recently",
        )
        == 1
    )


def test_renewals_are_timed_in_milliseconds_buckets(registry: CollectorRegistry, r: Any) -> None:
    name = unique("renewed")
    with Claim(r, name, ttl=0.6):
        wait_for(
            "a renewal",
            lambda: value(registry, "fenced_renewal_seconds_count", label=name) >= 1,
            timeout=5,
        )
    count = value(registry, "fenced_renewal_seconds_count", label=name)
    # A renewal on this machine's loopback: well under a tenth of a second.
    assert value(registry, "fenced_renewal_seconds_bucket", label=name, le="0.1") == count
    assert value(registry, "fenced_renewal_failures_total", label=name) == 0


def test_install_is_once_per_process_and_uninstall_stops_counting(r: Any) -> None:
    reg = CollectorRegistry()
    first = fenced.metrics.install(reg)
    try:
        assert fenced.metrics.install(reg) is first
        with pytest.raises(ConfigError, match="uninstall"):
            fenced.metrics.install(CollectorRegistry())
        name = unique("once")
        with Claim(r, name, ttl=5):
            pass
        # One subscriber, so one count.
        assert value(reg, "fenced_claims_acquired_total", label=name) == 1
    finally:
        fenced.metrics.uninstall()
    assert fenced.metrics.installed() is None
    assert reg.get_sample_value("fenced_claims_acquired_total", {"label": name}) is None
    with Claim(r, name, ttl=5):
        pass
    # Installed again, in the same registry: the metrics are registered anew.
    again = fenced.metrics.install(reg, namespace="jobs")
    try:
        with Claim(r, name, ttl=5):
            pass
        assert value(reg, "jobs_claims_acquired_total", label=name) == 1
        assert again.namespace == "jobs"
    finally:
        fenced.metrics.uninstall()
    fenced.metrics.uninstall()  # a no-op


def test_bad_namespace_is_refused_naming_the_rule() -> None:
    with pytest.raises(ConfigError, match="letters, digits and underscores"):
        ClaimMetrics(CollectorRegistry(), namespace="my-app")


def test_reasons_and_causes_outside_the_vocabulary_are_other_and_labels_are_capped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reg = CollectorRegistry()
    metrics = ClaimMetrics(reg)
    metrics(ClaimEvent("skipped", "n", "l", "claim", reason="already running; rerun requested"))
    metrics(ClaimEvent("skipped", "n", "l", "claim", reason="ran recently (12s left)"))
    metrics(ClaimEvent("skipped", "n", "l", "claim", reason="tenant 4711 is special"))
    expired = "no refresh was confirmed before the local deadline"
    metrics(ClaimEvent("lost", "n", "l", "claim", reason=expired))
    unconfirmed = "Redis could not be reached to confirm the lease at release (timeout)"
    metrics(ClaimEvent("lost", "n", "l", "claim", reason=unconfirmed))
    metrics(ClaimEvent("lost", "n", "l", "claim", reason="a cosmic ray"))
    metrics(ClaimEvent("released", "n", "l", "claim", outcome="exploded"))
    skipped = "fenced_claims_skipped_total"
    assert value(reg, skipped, label="l", reason="rerun_requested") == 1
    assert value(reg, skipped, label="l", reason="ran_recently") == 1
    assert value(reg, skipped, label="l", reason="other") == 1
    assert value(reg, "fenced_claims_lost_total", label="l", cause="expired") == 1
    assert value(reg, "fenced_claims_lost_total", label="l", cause="unconfirmed") == 1
    assert value(reg, "fenced_claims_lost_total", label="l", cause="other") == 1
    assert value(reg, "fenced_claims_released_total", label="l", outcome="other") == 1

    monkeypatch.setattr(fenced.metrics, "MAX_LABELS", 3)
    capped = ClaimMetrics(CollectorRegistry())
    for i in range(5):
        capped(ClaimEvent("acquired", f"n{i}", f"label-{i}", "claim", fence=i))
    assert value(capped.registry, "fenced_claims_acquired_total", label="label-2") == 1
    assert value(capped.registry, "fenced_claims_acquired_total", label="other") == 2


def test_threads_counting_at_once_lose_no_counts() -> None:
    # Values are updated without a lock: threads switched as often as the interpreter
    # allows still add up to every event.
    reg = CollectorRegistry()
    metrics = ClaimMetrics(reg)
    per_thread, threads = 3000, 4

    def work(t: int) -> None:
        for i in range(per_thread):
            metrics(ClaimEvent("acquired", f"n{t}", "l", "claim", fence=i))
            metrics(ClaimEvent("renewed", f"n{t}", "l", "claim", fence=i, duration=0.002))
            outcome = "ok" if i % 3 else "failed"
            metrics(
                ClaimEvent("released", f"n{t}", "l", "claim", fence=i, outcome=outcome, duration=2)
            )

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        sys.setswitchinterval(switch)
    total = per_thread * threads
    assert value(reg, "fenced_claims_acquired_total", label="l") == total
    released = "fenced_claims_released_total"
    assert value(reg, released, label="l", outcome="ok") == total * 2 // 3
    assert value(reg, released, label="l", outcome="failed") == total // 3
    assert value(reg, "fenced_claims_held", label="l") == 0
    assert value(reg, "fenced_run_duration_seconds_count", label="l") == total
    assert value(reg, "fenced_run_duration_seconds_bucket", label="l", le="1.0") == 0
    assert value(reg, "fenced_run_duration_seconds_sum", label="l") == 2 * total
    assert value(reg, "fenced_renewal_seconds_bucket", label="l", le="0.0025") == total
    # Nothing else was counted: no series of a counter that never moved.
    names = {s.name for family in reg.collect() for s in family.samples}
    assert not names & {"fenced_claims_lost_total", "fenced_claims_skipped_total"}


_LEASES = [("a", None), ("a", 1), ("b", None)]
_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["acquired", "lost", "released", "skipped", "renewed", "unavailable"]),
        st.integers(0, len(_LEASES) - 1),
        st.integers(1, 3),  # the fence
        st.sampled_from(["ok", "failed", "lost", "retried", "strange"]),
        st.sampled_from([None, 0.0, 0.3, 7.0, 1e6]),
    ),
    max_size=60,
)


def _samples(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in reg.collect()
        for s in family.samples
        if not s.name.endswith("_created") and s.value
    }


@examples(max_examples=150, deadline=None)
@given(_EVENTS, st.integers(1, 8))
def test_own_numbers_and_prometheus_clients_metrics_written_in_batches_agree(
    steps: list[tuple[str, int, int, str, float | None]], batch: int
) -> None:
    # Events are counted a batch at a time: into this process's own numbers, and into
    # counts written to prometheus_client's own metrics (multiprocess mode's files) after
    # each batch. For any sequence of events, both give the same samples as the events
    # one by one would (the held gauge pairs a loss with its release).
    batched = ClaimMetrics(CollectorRegistry(), in_files=False)
    each = ClaimMetrics(CollectorRegistry(), in_files=True)
    # The reference: each event counted at once, as it comes (never in a batch).
    reference = ClaimMetrics(CollectorRegistry(), in_files=False)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fenced.metrics, "BATCH", batch)
        for kind, lease, fence, outcome, duration in steps:
            name, slot = _LEASES[lease]
            event = ClaimEvent(
                kind,
                name,
                f"label-{name}",
                "claim",
                fence=fence,
                outcome=outcome if kind == "released" else None,
                reason="expired" if kind == "lost" else None,
                duration=duration,
                slot=slot,
            )
            batched.subscriber(event)
            each.subscriber(event)
            reference._count(event)
    each.flush()
    try:
        # (sums added in another order differ in the last bits)
        expected = pytest.approx(_samples(reference.registry), rel=1e-12)
        assert _samples(batched.registry) == expected
        assert _samples(each.registry) == expected
    finally:
        each.unregister()


# -- a prefork worker, multiprocess mode ------------------------------------------------------


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample a worker serves, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metrics_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, int]:
    """A worker started now counts in multiprocess mode and serves its metrics: the
    directory of the files, and the port."""
    folder = tmp_path / "prom"
    folder.mkdir()
    port = free_port()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
    monkeypatch.setenv("FENCED_METRICS", "1")
    monkeypatch.setenv("FENCED_METRICS_PORT", str(port))
    return folder, port


def test_prefork_worker_serves_the_sum_of_its_children_over_http(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, port = metrics_served(tmp_path, monkeypatch)
    services = Services.on(redis_server)
    client = services.client()
    obs = services.obs()

    def send(*args: Any) -> Any:
        return client.send_task("t.sleeper", args, queue=services.queue)

    with Worker(services, name="metrics", concurrency=2) as worker:
        keys = [unique("k") for _ in range(3)]
        done = [send(k, 0.05) for k in keys]
        busy = unique("busy")
        holder = send(busy, 2.0)
        wait_for("the holder to start", lambda: notes(obs, f"sleeper:{busy}"), WAIT)
        skipped = send(busy, 0.0).get(timeout=WAIT)
        assert skipped["status"] == "skipped"
        assert all(res.get(timeout=WAIT) == "slept" for res in done)
        assert holder.get(timeout=WAIT) == "slept"

        label = (("label", "sleep:{key}"),)
        ok = ("fenced_claims_released_total", (*label, ("outcome", "ok")))

        def all_released() -> Samples | None:
            samples = scrape(port)
            return samples if samples.get(ok) == 4 else None

        samples = wait_for("the worker's metrics", all_released, WAIT, every=0.2)
        assert samples[("fenced_claims_acquired_total", label)] == 4
        reason = ("reason", "already_running")
        assert samples[("fenced_claims_skipped_total", (label[0], reason))] == 1
        assert samples[("fenced_claims_held", label)] == 0
        assert samples[("fenced_run_duration_seconds_count", label)] == 4
        # The counts came from the pool's children, each in a file of its own.
        children = {p.name for p in folder.iterdir() if p.name.startswith("counter_")}
        assert children and f"counter_{worker.pid}.db" not in children
        assert f"claim metrics served on port {port}" in worker.log()
        assert list(folder.glob("gauge_livesum_*.db"))
        # A warm shutdown: each pool child, exiting, leaves the claims_held sum.
        assert worker.worker is not None
        worker.worker.stop()
        assert not list(folder.glob("gauge_livesum_*.db"))


def test_a_pool_child_killed_holding_a_claim_leaves_claims_held(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGKILL (the OOM killer, a hard time limit): the child's own exit hook never runs;
    # the main process, freeing the dead child's claim, takes it out of claims_held. The
    # message comes back (acks_late, reject_on_worker_lost) and its new run holds the
    # claim again: one held, not two.
    folder, port = metrics_served(tmp_path, monkeypatch)
    services = Services.on(redis_server)
    client = services.client()
    obs = services.obs()
    held = ("fenced_claims_held", (("label", "sleep:{key}"),))
    with Worker(services, name="metrics-kill", concurrency=2):
        busy = unique("busy")
        client.send_task("t.sleeper", (busy, 60.0), queue=services.queue)
        (start,) = wait_for("the run to start", lambda: notes(obs, f"sleeper:{busy}"), WAIT)
        wait_for("claims_held to count it", lambda: scrape(port).get(held) == 1, WAIT, every=0.2)
        os.kill(start["pid"], signal.SIGKILL)
        again = wait_for(
            "the redelivered run to start",
            lambda: notes(obs, f"sleeper:{busy}")[1:],
            WAIT,
        )
        assert again[0]["pid"] != start["pid"]
        dead = folder / f"gauge_livesum_{start['pid']}.db"
        wait_for(
            "claims_held to count the new run alone",
            lambda: not dead.exists() and scrape(port).get(held) == 1,
            WAIT,
            every=0.2,
        )


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_run_revoked_with_terminate_leaves_claims_held(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: str
) -> None:
    # revoke(terminate=True): the child is ended by the main process, so its own exit
    # hook may never run; the main process, freeing the claim, takes it out of the sum.
    folder, port = metrics_served(tmp_path, monkeypatch)
    services = Services.on(redis_server)
    client = services.client()
    obs = services.obs()
    held = ("fenced_claims_held", (("label", "sleep:{key}"),))
    with Worker(services, name=f"metrics-revoke-{sig.lower()}", concurrency=2):
        busy = unique("busy")
        result = client.send_task("t.sleeper", (busy, 60.0), queue=services.queue)
        (start,) = wait_for("the run to start", lambda: notes(obs, f"sleeper:{busy}"), WAIT)
        wait_for("claims_held to count it", lambda: scrape(port).get(held) == 1, WAIT, every=0.2)
        client.control.revoke(result.id, terminate=True, signal=sig)
        dead = folder / f"gauge_livesum_{start['pid']}.db"
        wait_for(
            "claims_held to drop the revoked run",
            lambda: not dead.exists() and scrape(port).get(held, 0) == 0,
            WAIT,
            every=0.2,
        )
        assert notes(obs, f"sleeper:{busy}") == [start]  # revoked: it does not run again


def test_threads_pool_worker_serves_its_own_numbers_without_a_directory(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.setenv("FENCED_METRICS", "1")
    monkeypatch.setenv("FENCED_METRICS_PORT", str(port))
    services = Services.on(redis_server)
    client = services.client()
    with Worker(services, name="metrics-threads", pool="threads", concurrency=2):
        keys = [unique("t") for _ in range(2)]
        results = [client.send_task("t.sleeper", (k, 0.0), queue=services.queue) for k in keys]
        assert [res.get(timeout=WAIT) for res in results] == ["slept", "slept"]
        label = (("label", "sleep:{key}"),)
        ok = ("fenced_claims_released_total", (*label, ("outcome", "ok")))
        wait_for("the worker's metrics", lambda: scrape(port).get(ok) == 2, WAIT)
        assert scrape(port)[("fenced_claims_acquired_total", label)] == 2


def test_prefork_worker_without_a_multiprocess_directory_refuses_to_start(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    services = Services.on(redis_server)
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]),
        FENCED_TEST_BROKER_URL=services.broker_url,
        FENCED_REDIS_URL=services.lock_url,
        FENCED_TEST_OBS_URL=services.obs_url,
        FENCED_METRICS="1",
    )
    worker = CeleryWorker(
        "tests.celery_app", name="nodir", log=tmp_path / "w.log", cwd=ROOT, env=env
    ).start()
    assert worker.proc is not None
    try:
        code = worker.proc.wait(60)
    finally:
        worker.kill()
    assert code != 0
    assert "set PROMETHEUS_MULTIPROC_DIR to an empty directory" in worker.tail()


def test_worker_settings_are_checked_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FENCED_METRICS", raising=False)
    monkeypatch.delenv("FENCED_METRICS_PORT", raising=False)
    app = Celery("metrics-settings", set_as_current=False)
    assert settings(app) == (False, None)
    app.conf.fenced_metrics = True
    app.conf.fenced_metrics_port = 9808
    assert settings(app) == (True, 9808)
    app.conf.fenced_metrics_port = 70000
    with pytest.raises(ConfigError, match=r"TCP port number \(1-65535\)"):
        settings(app)
    app.conf.fenced_metrics = "yes"
    with pytest.raises(ConfigError, match="must be True or False"):
        settings(app)
    other = Celery("metrics-env", set_as_current=False)
    monkeypatch.setenv("FENCED_METRICS_PORT", "9808")
    with pytest.raises(ConfigError, match="set fenced_metrics = True"):
        settings(other)
    monkeypatch.setenv("FENCED_METRICS", "1")
    assert settings(other) == (True, 9808)
    monkeypatch.setenv("FENCED_METRICS", "maybe")
    with pytest.raises(ConfigError, match="is not a switch"):
        settings(other)


# -- fenced run --metrics-file ------------------------------------------------------------


def fenced_run(url: str, *args: str, **more: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(more)
    return subprocess.run(
        [sys.executable, "-m", "fenced.cli", "run", "--redis", url, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def parsed(path: Path) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(path.read_text())
        for s in family.samples
    }


def test_fenced_run_writes_the_runs_metrics_for_the_textfile_collector(
    redis_server: RedisServer, r: Any, tmp_path: Path
) -> None:
    name = unique("backup")
    out = tmp_path / "backup.prom"
    res = fenced_run(redis_server.url, "--metrics-file", str(out), name, "--", "true")
    assert res.returncode == 0, res.stderr
    values = parsed(out)
    label = (("label", name),)
    assert values[("fenced_claims_acquired_total", label)] == 1
    assert values[("fenced_claims_released_total", (*label, ("outcome", "ok")))] == 1
    assert values[("fenced_run_duration_seconds_count", label)] == 1
    assert values[("fenced_claims_held", label)] == 0
    assert list(tmp_path.iterdir()) == [out]  # no temporary file left

    # A worker's multiprocess directory in the environment: the run's file is its own.
    pool = tmp_path / "pool"
    pool.mkdir()
    res = fenced_run(
        redis_server.url,
        "--metrics-file",
        str(out),
        name,
        "--",
        "false",
        PROMETHEUS_MULTIPROC_DIR=str(pool),
    )
    assert res.returncode == 1
    assert parsed(out)[("fenced_claims_released_total", (*label, ("outcome", "failed")))] == 1
    assert not list(pool.iterdir())

    holder = Claim(r, name, ttl=30, heartbeat=False)
    assert holder.acquire()
    try:
        res = fenced_run(redis_server.url, "-q", "--metrics-file", str(out), name, "--", "true")
    finally:
        holder.release()
    assert res.returncode == 0, res.stderr
    values = parsed(out)
    assert values[("fenced_claims_skipped_total", (*label, ("reason", "already_running")))] == 1
    assert ("fenced_claims_acquired_total", label) not in values


def test_fenced_run_with_redis_unreachable_writes_the_file_too(tmp_path: Path) -> None:
    out = tmp_path / "down.prom"
    down = f"redis://127.0.0.1:{free_port()}/0"
    res = fenced_run(down, "--metrics-file", str(out), "job", "--", "true")
    assert res.returncode == 69, res.stderr
    assert parsed(out)[("fenced_redis_unavailable_total", (("label", "job"),))] == 1


def test_fenced_run_metrics_file_in_a_missing_directory_is_a_usage_error(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere" / "x.prom"
    started = time.monotonic()
    res = fenced_run(redis_server.url, "--metrics-file", str(missing), "n", "--", "true")
    assert res.returncode == 2
    assert "does not exist" in res.stderr and "textfile" in res.stderr
    assert time.monotonic() - started < 30


def test_textfile_counts_only_inside_its_block(r: Any, tmp_path: Path) -> None:
    name = unique("tf")
    out = tmp_path / "tf.prom"
    with Textfile(out), Claim(r, name, ttl=5):
        pass
    with Claim(r, name, ttl=5):
        pass
    assert parsed(out)[("fenced_claims_acquired_total", (("label", name),))] == 1


# -- multiprocess mode: written behind, in batches ----------------------------------------

_FORKED = r"""
import os, sys, time
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from fenced.events import ClaimEvent
from fenced.metrics import FLUSH_SECONDS, ClaimMetrics

metrics = ClaimMetrics(CollectorRegistry())
assert metrics._store.__class__.__name__ == "_Shared", "not in multiprocess mode"

def acquired(name):
    metrics.subscriber(ClaimEvent("acquired", name, "forked", "claim", fence=1))

def total():
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    return registry.get_sample_value("fenced_claims_acquired_total", {"label": "forked"}) or 0

for name in ("a", "b", "c"):  # they wait for this process's counting thread
    acquired(name)
written_before_fork = total()
pid = os.fork()
if pid == 0:  # the child counts its own two; the parent's waiting two are not its
    acquired("d")
    acquired("e")
    time.sleep(FLUSH_SECONDS * 2.5)  # its thread writes them, with no flush() called
    os._exit(0)
os.waitpid(pid, 0)
after_child = total()
metrics.flush()
print(written_before_fork, after_child, total())
"""


def test_a_forked_child_writes_its_own_counts_never_its_parents_waiting_ones(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "prom"
    folder.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder))
    res = subprocess.run(
        [sys.executable, "-c", _FORKED], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stderr
    before, after_child, after_parent = (float(x) for x in res.stdout.split())
    assert before == 0  # the three wait for the counting thread
    # The child's thread wrote its two within its flush interval; the parent's three that
    # waited at the fork were written once, by the parent.
    assert after_child in (2, 5)  # the parent's own thread may have written its three
    assert after_parent == 5


_FORK_WHILE_WRITING = r"""
import os, threading, time
from prometheus_client import CollectorRegistry
from fenced.events import ClaimEvent
from fenced.metrics import ClaimMetrics

metrics = ClaimMetrics(CollectorRegistry())
event = ClaimEvent("acquired", "n", "forked", "claim", fence=1)
metrics.subscriber(event)
writing = threading.Event()

def write_slowly():  # as a flushing thread in the middle of a write
    with metrics._drain_lock:
        writing.set()
        time.sleep(0.5)

threading.Thread(target=write_slowly).start()
writing.wait()
started = time.monotonic()
pid = os.fork()
if pid == 0:
    metrics.subscriber(event)
    metrics.flush()  # would wait forever on a lock held at the fork
    os._exit(0)
waited = time.monotonic() - started
_, status = os.waitpid(pid, 0)
print(round(waited, 2), status)
"""


def test_a_fork_waits_for_a_write_in_progress_and_the_child_writes(tmp_path: Path) -> None:
    folder = tmp_path / "prom"
    folder.mkdir()
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder))
    res = subprocess.run(
        [sys.executable, "-c", _FORK_WHILE_WRITING],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    waited, status = res.stdout.split()
    assert float(waited) >= 0.3  # the fork came after the write
    assert status == "0"


def _python(script: str, folder: Path | None = None) -> str:
    """Run a script in a fresh interpreter (multiprocess mode in ``folder``): its stdout."""
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    if folder is not None:
        folder.mkdir()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    res = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


_TWO_FORKS = r"""
import os, threading, time
from prometheus_client import CollectorRegistry
from fenced.metrics import ClaimMetrics

metrics = ClaimMetrics(CollectorRegistry(), in_files=False)
counting = threading.Event()

def count_slowly():  # as a scrape in the middle of counting
    with metrics._drain_lock:
        counting.set()
        time.sleep(0.5)

threading.Thread(target=count_slowly).start()
counting.wait()

def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)

forks = [threading.Thread(target=fork) for _ in range(2)]  # both wait for the same lock
for t in forks:
    t.start()
for t in forks:
    t.join()
print(metrics._drain_lock.acquire(timeout=5))
"""


def test_two_threads_forking_at_once_leave_no_lock_held() -> None:
    assert _python(_TWO_FORKS).split() == ["True"]


def test_a_claims_thread_never_counts_its_events() -> None:
    # Counting runs in the metrics' own thread, where no exception raised into a claim's
    # thread (ClaimInterrupted, Ctrl-C) can cut it in half, nor can counting slow a run.
    metrics = ClaimMetrics(CollectorRegistry(), in_files=False)
    counted_in: set[int] = set()
    drain = metrics._drain

    def watched() -> None:
        counted_in.add(threading.get_ident())
        drain()

    metrics._drain = watched  # type: ignore[method-assign]
    try:
        for fence in range(3 * fenced.metrics.BATCH):
            metrics.subscriber(ClaimEvent("acquired", "n", "label", "claim", fence=fence))
            metrics.subscriber(ClaimEvent("released", "n", "label", "claim", fence=fence))
        wait_for("the batches to be counted", lambda: not metrics._pending, 10)
        assert counted_in and threading.get_ident() not in counted_in
        samples = _samples(metrics.registry)
        assert samples[("fenced_claims_acquired_total", (("label", "label"),))] == 3 * 512
    finally:
        metrics.unregister()


_EXITS = r"""
from prometheus_client import CollectorRegistry
from fenced.events import ClaimEvent
from fenced.metrics import ClaimMetrics

metrics = ClaimMetrics(CollectorRegistry())
metrics.subscriber(ClaimEvent("acquired", "n", "exits", "claim", fence=1))
metrics.subscriber(ClaimEvent("released", "n", "exits", "claim", fence=1, outcome="ok"))
"""  # and the interpreter exits at once, before the counting thread's first second

_READ = r"""
import os
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
registry = CollectorRegistry()
MultiProcessCollector(registry, path=os.environ["PROMETHEUS_MULTIPROC_DIR"])
labels = {"label": "exits", "outcome": "ok"}
print(registry.get_sample_value("fenced_claims_released_total", labels))
"""


def test_a_process_that_exits_writes_what_it_counted_last(tmp_path: Path) -> None:
    folder = tmp_path / "prom"
    _python(_EXITS, folder)
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder))
    out = subprocess.run(
        [sys.executable, "-c", _READ], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.stdout.split() == ["1.0"], out.stderr


_FORK_WHILE_OTHERS_WRITE = r"""
import os, signal, threading, time
from prometheus_client import CollectorRegistry, Counter
from fenced.events import ClaimEvent
from fenced.metrics import ClaimMetrics, _files_lock

metrics = ClaimMetrics(CollectorRegistry())
lock = _files_lock()
assert lock is not None, "prometheus_client's lock was not found"
writing = threading.Event()

def write_slowly():  # the application's own metric, in the middle of a write
    with lock:
        writing.set()
        time.sleep(0.5)

threading.Thread(target=write_slowly).start()
writing.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(10)
    metrics.subscriber(ClaimEvent("acquired", "n", "forked", "claim", fence=1))
    metrics.flush()  # would wait forever on prometheus_client's lock held at the fork
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(status)
"""


def test_a_fork_waits_for_prometheus_clients_own_writes(tmp_path: Path) -> None:
    assert _python(_FORK_WHILE_OTHERS_WRITE, tmp_path / "prom").split() == ["0"]


def test_an_event_after_unregister_is_counted_as_it_comes() -> None:
    metrics = ClaimMetrics(CollectorRegistry(), in_files=False)
    take = metrics.subscriber  # as emit() holds it while unsubscribing happens
    take(ClaimEvent("acquired", "n", "late", "claim", fence=1))
    metrics.unregister()
    take(ClaimEvent("released", "n", "late", "claim", fence=1, outcome="ok"))
    assert not metrics._pending
    assert metrics._cells["late"].held == 0.0


_FAILING = r"""
import logging, os, shutil, time
from prometheus_client import CollectorRegistry
from fenced.events import ClaimEvent
from fenced.metrics import ClaimMetrics

lines = []
class Count(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("fenced").addHandler(Count())
metrics = ClaimMetrics(CollectorRegistry())
shutil.rmtree(os.environ["PROMETHEUS_MULTIPROC_DIR"])  # every write fails from now on
until = time.monotonic() + 3.5
while time.monotonic() < until:
    metrics.subscriber(ClaimEvent("acquired", "n", "failing", "claim", fence=1))
    time.sleep(0.1)
print(len(lines))
"""


def test_counting_that_keeps_failing_is_logged_once_a_minute(tmp_path: Path) -> None:
    assert _python(_FAILING, tmp_path / "prom").split() == ["1"]

"""Prometheus metrics of claims, fed by the lifecycle events (``pip install 'fenced[metrics]'``).

::

    import fenced.metrics
    from prometheus_client import start_http_server

    fenced.metrics.install()     # every claim of this process, in prometheus_client's REGISTRY
    start_http_server(9808)

:class:`ClaimMetrics` is one :mod:`fenced.events` subscriber that keeps counters,
histograms and a gauge in a registry; :func:`install` subscribes one for the process
(once), :func:`uninstall` takes it away again. Every metric is labelled by the event's
``label`` (the claim template, the label chosen, or a fixed name): never by the full
name, so one series per template, not one per tenant. The ``reason``, ``cause`` and
``outcome`` labels take fenced's fixed words (:data:`SKIP_REASONS`, :data:`LOSS_CAUSES`,
:data:`OUTCOMES`); anything else is counted as ``"other"``.

Celery's prefork pool runs tasks in child processes: prometheus_client's multiprocess
mode (``PROMETHEUS_MULTIPROC_DIR``) adds up their values, and the Celery settings
``fenced_metrics`` and ``fenced_metrics_port`` set it up (:mod:`fenced.celery._metrics`).
``fenced run --metrics-file`` writes a run's metrics for node_exporter's textfile
collector (:class:`Textfile`).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

try:
    from prometheus_client import (
        REGISTRY,
        CollectorRegistry,
        Counter,
        Gauge,
        Histogram,
        start_http_server,
        write_to_textfile,
    )
    from prometheus_client import multiprocess as _multiprocess
    from prometheus_client import values as _values
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.utils import floatToGoString
except ImportError as exc:  # pragma: no cover - the extra is installed for the tests
    raise ImportError(
        f"fenced.metrics needs prometheus_client: pip install 'fenced[metrics]' ({exc})"
    ) from exc

from . import events
from ._errors import ConfigError
from .events import ClaimEvent

__all__ = [
    "LOSS_CAUSES",
    "OUTCOMES",
    "SKIP_REASONS",
    "ClaimMetrics",
    "Textfile",
    "install",
    "installed",
    "mark_process_dead",
    "multiprocess_dir",
    "registry_for_scrape",
    "serve",
    "uninstall",
]

log = logging.getLogger("fenced")

#: A skip's reason (fenced's words, or the label value itself) -> the ``reason`` label.
SKIP_REASONS = {
    "already running": "already_running",
    "already running; rerun requested": "rerun_requested",
    "ran recently": "ran_recently",
}
#: How a loss was found (fenced's words, or their start) -> the ``cause`` label.
LOSS_CAUSES = {
    "expired": "expired",
    "no refresh was confirmed before the local deadline": "expired",
    "taken": "taken",
    "the lease is gone or held under another token": "taken",
    "refused": "refused",
    "released elsewhere": "released_elsewhere",
    "vanished": "vanished",
    "the lease was gone before release": "vanished",
    "unconfirmed": "unconfirmed",
    "redis could not be reached to confirm the lease at release": "unconfirmed",
}
#: How released work ended: the ``outcome`` label (anything else: ``"other"``).
OUTCOMES = frozenset({"ok", "failed", "lost", "retried"})
OTHER = "other"

#: Distinct ``label`` values kept; more are counted under ``"other"`` (a label built
#: from call arguments would otherwise make a series per call).
MAX_LABELS = 1000

#: Seconds a claim was held: from a cron job's second to a day-long rebuild.
RUN_BUCKETS = (0.1, 0.5, 1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
#: Seconds of a renewal round trip: a healthy Redis answers in a millisecond or less.
RENEWAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)

_NAMESPACE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")


def _word(text: str | None, words: dict[str, str]) -> str:
    """``text`` as one of ``words``' values: matched whole, by its start, or else "other"."""
    if not text:
        return OTHER
    key = text.strip().lower()
    word = words.get(key)
    if word is not None:
        return word
    if key in words.values():
        return key
    for start, word in words.items():
        if key.startswith(start):
            return word
    return OTHER


def skip_reason(text: str | None) -> str:
    """The ``reason`` label of a skip."""
    return _word(text, SKIP_REASONS)


def loss_cause(text: str | None) -> str:
    """The ``cause`` label of a loss."""
    return _word(text, LOSS_CAUSES)


#: Every metric: kind, help text, label names (after ``label``), histogram buckets.
METRICS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "claims_acquired": ("counter", "Claims acquired.", (), ()),
    "claims_skipped": (
        "counter",
        "Claims not acquired because another holder had them (or the name ran recently).",
        ("reason",),
        (),
    ),
    "claims_lost": ("counter", "Claims lost while held.", ("cause",), ()),
    "claims_released": ("counter", "Claims released, by how the work ended.", ("outcome",), ()),
    "renewal_failures": (
        "counter",
        "Renewals that failed (Redis errors or timeouts; the claim may still be held).",
        (),
        (),
    ),
    "redis_unavailable": (
        "counter",
        "Acquires that found Redis unreachable (the work did not start).",
        (),
        (),
    ),
    "run_duration_seconds": (
        "histogram",
        "How long a claim was held, until it was released or lost.",
        (),
        RUN_BUCKETS,
    ),
    "renewal_seconds": (
        "histogram",
        "Round trip of a renewal that succeeded.",
        (),
        RENEWAL_BUCKETS,
    ),
    "claims_held": ("gauge", "Claims held now.", (), ()),
}


class _Tally:
    """The values kept in this process, as plain numbers under one lock; a registry reads
    them as a collector. Cheaper per event than prometheus_client's own metrics."""

    def __init__(self, namespace: str) -> None:
        self.prefix = f"{namespace}_" if namespace else ""
        self.lock = threading.Lock()
        self.counts: dict[tuple[str, tuple[str, ...]], float] = {}
        # (metric, label) -> [count per bucket (not cumulative), sum]
        self.spreads: dict[tuple[str, str], list[float]] = {}
        self.held: dict[str, float] = {}

    def count(self, metric: str, labels: tuple[str, ...]) -> None:
        key = (metric, labels)
        with self.lock:
            self.counts[key] = self.counts.get(key, 0.0) + 1.0

    def observe(self, metric: str, label: str, value: float) -> None:
        key = (metric, label)
        buckets = METRICS[metric][3]
        at = bisect_left(buckets, value)
        with self.lock:
            spread = self.spreads.get(key)
            if spread is None:
                spread = self.spreads[key] = [0.0] * (len(buckets) + 2)
            spread[at] += 1.0
            spread[-1] += value

    def move(self, label: str, by: float) -> None:
        with self.lock:
            self.held[label] = self.held.get(label, 0.0) + by

    # The two events of every run, each under one lock.

    def acquired(self, label: str, fresh: bool) -> None:
        key = ("claims_acquired", (label,))
        with self.lock:
            counts = self.counts
            counts[key] = counts.get(key, 0.0) + 1.0
            if fresh:
                self.held[label] = self.held.get(label, 0.0) + 1.0

    def ended(
        self, metric: str, labels: tuple[str, str], was_held: bool, duration: float | None
    ) -> None:
        key, label = (metric, labels), labels[0]
        at = -1 if duration is None or not was_held else bisect_left(RUN_BUCKETS, duration)
        with self.lock:
            counts = self.counts
            counts[key] = counts.get(key, 0.0) + 1.0
            if was_held:
                self.held[label] = self.held.get(label, 0.0) - 1.0
            if at >= 0:
                spread = self.spreads.get(("run_duration_seconds", label))
                if spread is None:
                    spread = [0.0] * (len(RUN_BUCKETS) + 2)
                    self.spreads["run_duration_seconds", label] = spread
                spread[at] += 1.0
                spread[-1] += duration or 0.0

    def _families(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for metric, (kind, text, more, _buckets) in METRICS.items():
            name, labels = self.prefix + metric, ["label", *more]
            if kind == "counter":
                out[metric] = CounterMetricFamily(name, text, labels=labels)
            elif kind == "histogram":
                out[metric] = HistogramMetricFamily(name, text, labels=labels)
            else:
                out[metric] = GaugeMetricFamily(name, text, labels=labels)
        return out

    def describe(self) -> Iterator[Any]:
        """The families, without values (so a registry refuses a second set of them)."""
        return iter(self._families().values())

    def collect(self) -> Iterator[Any]:
        """The families with the values of now."""
        with self.lock:
            counts = dict(self.counts)
            spreads = {key: list(spread) for key, spread in self.spreads.items()}
            held = dict(self.held)
        families = self._families()
        for (metric, labels), value in counts.items():
            families[metric].add_metric(list(labels), value)
        for (metric, label), spread in spreads.items():
            bounds = METRICS[metric][3]
            cumulative, total = [], 0.0
            for bound, n in zip((*bounds, float("inf")), spread[:-1]):
                total += n
                cumulative.append((floatToGoString(bound), total))  # type: ignore[no-untyped-call]
            families[metric].add_metric([label], cumulative, spread[-1])
        for label, value in held.items():
            families["claims_held"].add_metric([label], value)
        return iter(families.values())


class _Shared:
    """prometheus_client's own metrics: in multiprocess mode each process writes its values
    to a file of its own in ``PROMETHEUS_MULTIPROC_DIR``, and a scrape adds them up."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self.metrics: dict[str, Any] = {}
        for metric, (kind, text, more, buckets) in METRICS.items():
            labels = ("label", *more)
            if kind == "counter":
                made: Any = Counter(metric, text, labels, namespace=namespace, registry=registry)
            elif kind == "histogram":
                made = Histogram(
                    metric, text, labels, namespace=namespace, registry=registry, buckets=buckets
                )
            else:
                # livesum: a prefork child that exits takes its claims out of the sum.
                made = Gauge(
                    metric,
                    text,
                    labels,
                    namespace=namespace,
                    registry=registry,
                    multiprocess_mode="livesum",
                )
            self.metrics[metric] = made
        self.children: dict[tuple[str, tuple[str, ...]], Any] = {}

    def _child(self, metric: str, labels: tuple[str, ...]) -> Any:
        key = (metric, labels)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = self.metrics[metric].labels(*labels)
        return child

    def count(self, metric: str, labels: tuple[str, ...]) -> None:
        self._child(metric, labels).inc()

    def observe(self, metric: str, label: str, value: float) -> None:
        self._child(metric, (label,)).observe(value)

    def move(self, label: str, by: float) -> None:
        self._child("claims_held", (label,)).inc(by)

    def acquired(self, label: str, fresh: bool) -> None:
        self.count("claims_acquired", (label,))
        if fresh:
            self.move(label, 1.0)

    def ended(
        self, metric: str, labels: tuple[str, str], was_held: bool, duration: float | None
    ) -> None:
        self.count(metric, labels)
        if was_held:
            self.move(labels[0], -1.0)
            if duration is not None:
                self.observe("run_duration_seconds", labels[0], duration)

    def collectors(self) -> list[Any]:
        return list(self.metrics.values())


def _in_files() -> bool:
    """prometheus_client keeps values in files (multiprocess mode, chosen when imported)."""
    return bool(getattr(_values.ValueClass, "_multiprocess", False))


class ClaimMetrics:
    """The claim metrics in one registry, kept up to date by the events it is called with.

    Call it with a :class:`~fenced.events.ClaimEvent` (it is a subscriber). Thread-safe:
    renewal events come from the heartbeat thread. In prometheus_client's multiprocess
    mode the values are prometheus_client's own metrics (in files); otherwise plain
    numbers a collector hands to the registry when it is read, which costs less per event.
    ``in_files`` chooses (True: prometheus_client's metrics) instead of the environment.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = "fenced",
        *,
        in_files: bool | None = None,
    ) -> None:
        if not isinstance(namespace, str) or (namespace and not _NAMESPACE.match(namespace)):
            raise ConfigError(
                f"metrics namespace {namespace!r} is not a Prometheus name prefix: use letters, "
                "digits and underscores, not starting with a digit (e.g. 'fenced')"
            )
        self.registry = REGISTRY if registry is None else registry
        self.namespace = namespace
        self._store: _Tally | _Shared
        if _in_files() if in_files is None else in_files:
            self._store = _Shared(self.registry, namespace)
            self._collectors: list[Any] = self._store.collectors()
        else:
            self._store = _Tally(namespace)
            self.registry.register(self._store)
            self._collectors = [self._store]
        self._labels: set[str] = set()
        self._warned = False
        self._holding: set[tuple[str, int | None, int | None]] = set()
        self._handlers: dict[str, Callable[[ClaimEvent], None]] = {
            "acquired": self._on_acquired,
            "skipped": self._on_skipped,
            "renewed": self._on_renewed,
            "renewal_failed": self._on_renewal_failed,
            "lost": self._on_lost,
            "released": self._on_released,
            "unavailable": self._on_unavailable,
        }

    def __call__(self, event: ClaimEvent) -> None:
        """Count one event."""
        handler = self._handlers.get(event.kind)
        if handler is not None:
            handler(event)

    def unregister(self) -> None:
        """Take the metrics out of the registry."""
        for collector in self._collectors:
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass

    def _label(self, event: ClaimEvent) -> str:
        label = event.label
        if label in self._labels:
            return label
        if len(self._labels) >= MAX_LABELS:
            if not self._warned:
                self._warned = True
                log.warning(
                    "fenced.metrics: more than %d claim labels; further ones are counted as "
                    "%r (give claims a label= that does not carry call arguments)",
                    MAX_LABELS,
                    OTHER,
                )
            return OTHER
        self._labels.add(label)
        return label

    # -- the events -----------------------------------------------------------------------

    def _on_acquired(self, event: ClaimEvent) -> None:
        key = (event.name, event.slot, event.fence)
        fresh = key not in self._holding
        if fresh:
            self._holding.add(key)
        self._store.acquired(self._label(event), fresh)

    def _ended(self, event: ClaimEvent, metric: str, labels: tuple[str, str]) -> None:
        # A loss is often followed by a release (outcome "lost") of the same claim: the
        # gauge and the duration count the first of the two.
        try:
            self._holding.remove((event.name, event.slot, event.fence))
            was_held = True
        except KeyError:
            was_held = False
        self._store.ended(metric, labels, was_held, event.duration)

    def _on_released(self, event: ClaimEvent) -> None:
        outcome = event.outcome if event.outcome in OUTCOMES else OTHER
        self._ended(event, "claims_released", (self._label(event), outcome))

    def _on_lost(self, event: ClaimEvent) -> None:
        self._ended(event, "claims_lost", (self._label(event), loss_cause(event.reason)))

    def _on_skipped(self, event: ClaimEvent) -> None:
        label = self._label(event)
        self._store.count("claims_skipped", (label, skip_reason(event.reason)))

    def _on_renewed(self, event: ClaimEvent) -> None:
        if event.duration is not None:
            self._store.observe("renewal_seconds", self._label(event), event.duration)

    def _on_renewal_failed(self, event: ClaimEvent) -> None:
        self._store.count("renewal_failures", (self._label(event),))

    def _on_unavailable(self, event: ClaimEvent) -> None:
        self._store.count("redis_unavailable", (self._label(event),))


# -- one set per process ----------------------------------------------------------------

_installed: tuple[ClaimMetrics, Callable[[], None]] | None = None
_install_lock = threading.Lock()


def install(
    registry: CollectorRegistry | None = None, *, namespace: str = "fenced"
) -> ClaimMetrics:
    """Count every claim event of this process in ``registry`` (prometheus_client's
    ``REGISTRY`` by default); installed once: a second call returns the same metrics."""
    global _installed
    with _install_lock:
        if _installed is not None:
            metrics = _installed[0]
            wanted = REGISTRY if registry is None else registry
            if metrics.registry is not wanted or metrics.namespace != namespace:
                raise ConfigError(
                    "fenced.metrics is installed already, in another registry or namespace: "
                    "call fenced.metrics.uninstall() first"
                )
            return metrics
        metrics = ClaimMetrics(registry, namespace)
        _installed = (metrics, events.subscribe(metrics))
        return metrics


def installed() -> ClaimMetrics | None:
    """The metrics :func:`install` set up, or None."""
    return _installed[0] if _installed is not None else None


def uninstall() -> None:
    """Stop counting, and take the metrics out of their registry (a no-op when not installed)."""
    global _installed
    with _install_lock:
        if _installed is None:
            return
        metrics, unsubscribe = _installed
        _installed = None
    unsubscribe()
    metrics.unregister()


# -- exposition --------------------------------------------------------------------------


def multiprocess_dir() -> str | None:
    """``PROMETHEUS_MULTIPROC_DIR`` when prometheus_client's multiprocess mode is on."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def registry_for_scrape() -> CollectorRegistry:
    """What a scrape of this process should read: every process's values in multiprocess
    mode (a fresh registry with a ``MultiProcessCollector``), else ``REGISTRY``."""
    folder = multiprocess_dir()
    if folder is None:
        return REGISTRY
    if not os.path.isdir(folder):
        raise ConfigError(
            f"PROMETHEUS_MULTIPROC_DIR={folder!r} is not a directory: create it (empty) "
            "before the worker starts"
        )
    registry = CollectorRegistry()
    _multiprocess.MultiProcessCollector(registry, path=folder)  # type: ignore[no-untyped-call]
    return registry


def serve(port: int, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` over HTTP from a daemon thread (every process's values in
    multiprocess mode); returns the server (``shutdown()`` stops it)."""
    server, _thread = start_http_server(port, addr=addr, registry=registry_for_scrape())
    return server


def mark_process_dead(pid: int) -> None:
    """Multiprocess mode: a process that exited no longer counts in ``claims_held``."""
    if multiprocess_dir() is not None:
        _multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]


# -- one run's metrics in a file ---------------------------------------------------------


def check_textfile(path: str | os.PathLike[str]) -> str:
    """``path`` as text if its directory exists; a ConfigError naming the fix if not."""
    text = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(text))
    if not text or os.path.isdir(text):
        raise ConfigError(f"--metrics-file {text!r} is a directory: name a file, e.g. fenced.prom")
    if not os.path.isdir(folder):
        raise ConfigError(
            f"--metrics-file {text!r}: the directory {folder!r} does not exist "
            "(node_exporter's --collector.textfile.directory, for instance)"
        )
    return text


class Textfile:
    """One run's claim metrics, written to ``path`` at the end in the format
    node_exporter's textfile collector reads (it reads files named ``*.prom``).

    ``with Textfile(path):`` counts the claim events inside the block in a registry of
    its own and writes it when the block ends; the file is replaced atomically (a
    temporary file, then a rename), so the collector never reads half of one.
    """

    def __init__(self, path: str | os.PathLike[str], *, namespace: str = "fenced") -> None:
        self.path = check_textfile(path)
        # Its own numbers, whatever the environment: the file is the run's, not a pool's.
        self.metrics = ClaimMetrics(CollectorRegistry(), namespace, in_files=False)
        self._unsubscribe: Callable[[], None] | None = None

    def start(self) -> None:
        """Count the events of this process from now on."""
        if self._unsubscribe is None:
            self._unsubscribe = events.subscribe(self.metrics)

    def stop(self) -> None:
        """Stop counting."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    def write(self) -> None:
        """Write what was counted (OSError when the file cannot be written)."""
        write_to_textfile(self.path, self.metrics.registry)

    def __enter__(self) -> ClaimMetrics:
        self.start()
        return self.metrics

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.write()

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
collector (:class:`Textfile`). A beat led under fenced (``fenced.celery.beat``) adds
its own (:class:`BeatMetrics`), labelled by the beat's name and the schedule's entries.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator
from itertools import accumulate
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
    "BEAT_METRICS",
    "LOSS_CAUSES",
    "OUTCOMES",
    "SKIP_REASONS",
    "BeatMetrics",
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
    "replaced": "replaced",
    "replaced by": "replaced",
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

#: Events wait to be counted by a thread of their own, woken when this many wait; and
#: whenever the registry is read (this process's own numbers), or :meth:`flush` is called.
BATCH = 512

#: What waits is counted (and in multiprocess mode written to the files) at least this
#: often.
FLUSH_SECONDS = 1.0

#: The seconds between two log lines about counting that keeps failing.
ERROR_LOG_INTERVAL = 60.0

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


#: Every metric: its kind, the attribute of :class:`_Counts` that holds its values, its
#: label names (after ``label``) and a histogram's buckets.
METRICS: dict[str, tuple[str, str, tuple[str, ...], tuple[float, ...]]] = {
    "claims_acquired": ("counter", "acquired", (), ()),
    "claims_skipped": ("counter", "skipped", ("reason",), ()),
    "claims_throttled": ("counter", "throttled", (), ()),
    "claims_lost": ("counter", "lost", ("cause",), ()),
    "claims_released": ("counter", "released", ("outcome",), ()),
    "renewal_failures": ("counter", "failures", (), ()),
    "redis_unavailable": ("counter", "unavailable", (), ()),
    "run_duration_seconds": ("histogram", "run", (), RUN_BUCKETS),
    "renewal_seconds": ("histogram", "renewal", (), RENEWAL_BUCKETS),
    "claims_held": ("gauge", "held", (), ()),
}
#: Each metric's help text.
HELP = {
    "claims_acquired": "Claims acquired.",
    "claims_skipped": "Claims not acquired because another holder had them "
    "(or the name ran recently).",
    "claims_throttled": "Acquires that found the name free but its rate reached "
    "(rate limited: not started yet, or skipped).",
    "claims_lost": "Claims lost while held.",
    "claims_released": "Claims released, by how the work ended.",
    "renewal_failures": "Renewals that failed (Redis errors or timeouts; "
    "the claim may still be held).",
    "redis_unavailable": "Acquires that found Redis unreachable (the work did not start).",
    "run_duration_seconds": "How long a claim was held, until it was released or lost.",
    "renewal_seconds": "Round trip of a renewal that succeeded.",
    "claims_held": "Claims held now.",
}
#: A kind of metric: prometheus_client's metric, and the family a collector hands over.
_CLASSES: dict[str, tuple[Any, Any]] = {
    "counter": (Counter, CounterMetricFamily),
    "histogram": (Histogram, HistogramMetricFamily),
    "gauge": (Gauge, GaugeMetricFamily),
}
#: The kinds of event counted (any other is left alone).
_COUNTED = frozenset(events.KINDS)


class _Counts:
    """One label's values in this process: plain floats, and dicts and lists of them.

    Updated without a lock: each update is one ``+=`` on an attribute, a dict item whose
    key exists already or a list item, which CPython's GIL never interrupts (no call, no
    Python code runs inside it), so threads do not lose counts. (A free-threaded build
    can lose one under a race.) A reader may see a histogram's count before its sum.
    """

    __slots__ = tuple(field for _kind, field, _more, _buckets in METRICS.values())

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Every value back to zero."""
        self.acquired = self.held = self.failures = self.unavailable = self.throttled = 0.0
        # Every word a worded counter takes, in a fixed order.
        self.skipped = dict.fromkeys((*SKIP_REASONS.values(), OTHER), 0.0)
        self.lost = dict.fromkeys((*LOSS_CAUSES.values(), OTHER), 0.0)
        self.released = dict.fromkeys((*sorted(OUTCOMES), OTHER), 0.0)
        # Count per bucket (not cumulative; the last but one is +Inf), then the sum.
        self.run = [0.0] * (len(RUN_BUCKETS) + 2)
        self.renewal = [0.0] * (len(RENEWAL_BUCKETS) + 2)

    def series(self) -> Iterator[tuple[str, str, Any]]:
        """(metric, word, value) of every series with something counted: a worded
        counter's one per word, a histogram's value its list; ``claims_held`` from the
        label's first acquire on, at 0 too."""
        for metric, (_kind, field, more, bounds) in METRICS.items():
            value = getattr(self, field)
            if bounds:
                if any(value[:-1]):
                    yield metric, "", value
            elif more:
                yield from ((metric, word, n) for word, n in list(value.items()) if n)
            elif value or (field == "held" and self.acquired):
                yield metric, "", value


class _Tally:
    """The values kept in this process, one :class:`_Counts` per label; a registry reads
    them as a collector. Cheaper per event than prometheus_client's own metrics."""

    def __init__(self, namespace: str) -> None:
        self.prefix = f"{namespace}_" if namespace else ""
        self.lock = threading.Lock()
        self.labels: dict[str, _Counts] = {}
        #: Counts the events still waiting (set by ClaimMetrics): called before a read.
        self.drain: Callable[[], None] = lambda: None

    def cells(self, label: str) -> _Counts:
        """A new label's values (the caller keeps them, to update)."""
        counts = _Counts()
        with self.lock:
            self.labels[label] = counts
        return counts

    def _families(self) -> dict[str, Any]:
        return {
            metric: _CLASSES[kind][1](self.prefix + metric, HELP[metric], labels=["label", *more])
            for metric, (kind, _field, more, _buckets) in METRICS.items()
        }

    def describe(self) -> Iterator[Any]:
        """The families, without values (so a registry refuses a second set of them)."""
        return iter(self._families().values())

    def collect(self) -> Iterator[Any]:
        """The families with the values of now (a series shows once it was counted)."""
        self.drain()
        with self.lock:
            labels = list(self.labels.items())
        families = self._families()
        for label, counts in labels:
            for metric, word, value in counts.series():
                if isinstance(value, list):  # per bucket, then the sum: cumulative here
                    spread, bounds = list(value), (*METRICS[metric][3], float("inf"))
                    cumulative = zip(map(floatToGoString, bounds), accumulate(spread[:-1]))
                    families[metric].add_metric([label], list(cumulative), spread[-1])
                else:
                    families[metric].add_metric([label, word] if word else [label], value)
        return iter(families.values())


class _Children:
    """One label's prometheus_client metrics (``.labels(...)`` children), made when first
    written (a child shows as a series from then on), and the label's counts not yet
    written to them."""

    __slots__ = ("counts", "label", "made", "metrics")

    def __init__(self, metrics: dict[str, Any], label: str) -> None:
        self.metrics = metrics
        self.label = label
        self.made: dict[tuple[str, str], Any] = {}
        self.counts = _Counts()

    def child(self, metric: str, word: str = "") -> Any:
        key = (metric, word)
        made = self.made.get(key)
        if made is None:
            labels = (self.label, word) if word else (self.label,)
            made = self.made[key] = self.metrics[metric].labels(*labels)
        return made

    def write(self) -> None:
        """Add the counts to the metrics (a write to a file each, in multiprocess mode),
        and start them again from zero. The caller holds the lock of the counts."""
        for metric, word, value in self.counts.series():
            if isinstance(value, list):
                # A histogram child keeps a value per bucket (not cumulative, as here)
                # and the sum: prometheus_client's _buckets and _sum, the values
                # observe() adds to (tests/test_metrics.py checks the two ways agree).
                histogram = self.child(metric)
                for i, n in enumerate(value[:-1]):
                    if n:
                        histogram._buckets[i].inc(n)
                histogram._sum.inc(value[-1])
            else:
                self.child(metric, word).inc(value)
        self.counts.reset()


class _Shared:
    """prometheus_client's own metrics: in multiprocess mode each process writes its values
    to a file of its own in ``PROMETHEUS_MULTIPROC_DIR``, and a scrape adds them up."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        options = {"namespace": namespace, "registry": registry}
        self.metrics = {
            metric: _metric(kind, metric, HELP[metric], ("label", *more), **options, buckets=b)
            for metric, (kind, _field, more, b) in METRICS.items()
        }
        self.labels: list[_Children] = []

    def cells(self, label: str) -> _Counts:
        """A new label's counts (the caller keeps them, to update; :meth:`write` adds them
        to the metrics)."""
        children = _Children(self.metrics, label)
        self.labels.append(children)
        return children.counts

    def write(self) -> None:
        """Add every label's counts to its metrics (the caller holds the counts' lock)."""
        for children in list(self.labels):
            children.write()

    def forget(self) -> None:
        """A forked child: the counts it inherited are its parent's, to be written there."""
        for children in list(self.labels):
            children.counts.reset()


def _metric(kind: str, *spec: Any, buckets: tuple[float, ...] = (), **options: Any) -> Any:
    """One of prometheus_client's own metrics, of ``kind``, from its name, help and label
    names (its values in files in multiprocess mode)."""
    if buckets:
        options["buckets"] = buckets
    elif kind == "gauge":  # livesum: a process that exits takes its value out of the sum
        options["multiprocess_mode"] = "livesum"
    return _CLASSES[kind][0](*spec, **options)


def _in_files() -> bool:
    """prometheus_client keeps values in files (multiprocess mode, chosen when imported)."""
    return bool(getattr(_values.ValueClass, "_multiprocess", False))


#: The metrics of a beat led under fenced (``fenced.celery.beat``): kind, label names and
#: help. A beat's entries are its schedule's, a fixed set: each is a label value.
BEAT_METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "beat_ticks_dispatched": (
        "counter",
        ("beat", "entry"),
        "Ticks this beat sent as its leader (each (entry, due time) is granted to one beat).",
    ),
    "beat_ticks_refused": (
        "counter",
        ("beat", "entry"),
        "Due ticks this beat did not send because it no longer led (its lease was lost "
        "or taken: the next leader sends them).",
    ),
    "beat_leading": ("gauge", ("beat",), "1 while this process leads the beat, else 0."),
    "beat_leaderless_alarms": (
        "counter",
        ("beat",),
        "Times this beat found that no beat had led for longer than fenced_beat_alarm_after "
        "(each logged as an error).",
    ),
}


class BeatMetrics:
    """A beat's metrics (:data:`BEAT_METRICS`) in one registry: prometheus_client's own
    metrics, written at once (a beat sends a few ticks a second at most), so in
    multiprocess mode an embedded beat (``celery worker -B``) shows in the worker's
    ``/metrics``. At most :data:`MAX_LABELS` entries per registry; more count as
    ``"other"``."""

    def __init__(self, registry: CollectorRegistry, namespace: str) -> None:
        self.metrics = {
            metric: _metric(kind, metric, text, labels, namespace=namespace, registry=registry)
            for metric, (kind, labels, text) in BEAT_METRICS.items()
        }
        self._entries: set[tuple[str, str]] = set()

    def _entry(self, beat: str, entry: str) -> str:
        key = (beat, entry)
        if key not in self._entries:
            if len(self._entries) >= MAX_LABELS:
                return OTHER
            self._entries.add(key)
        return entry

    def dispatched(self, beat: str, entry: str) -> None:
        """This beat sent a tick of ``entry``."""
        self.metrics["beat_ticks_dispatched"].labels(beat, self._entry(beat, entry)).inc()

    def refused(self, beat: str, entry: str) -> None:
        """A due tick of ``entry`` was not sent: this beat no longer leads."""
        self.metrics["beat_ticks_refused"].labels(beat, self._entry(beat, entry)).inc()

    def leading(self, beat: str, leads: bool) -> None:
        """Whether this process leads ``beat`` now."""
        self.metrics["beat_leading"].labels(beat).set(1.0 if leads else 0.0)

    def leaderless(self, beat: str) -> None:
        """No beat led for longer than the alarm time (an error was logged)."""
        self.metrics["beat_leaderless_alarms"].labels(beat).inc()


class ClaimMetrics:
    """The claim metrics in one registry, kept up to date by the events it is called with.

    Subscribe :attr:`subscriber` (or call the object) with each
    :class:`~fenced.events.ClaimEvent`. Thread-safe: renewal events come from the
    heartbeat thread. Events wait in a queue, counted by a thread of this process (started
    by its first event) when :data:`BATCH` of them wait and at least every
    :data:`FLUSH_SECONDS`: that costs far less per event than counting each amid a claim's
    own work, and no exception raised into a claim's thread (``ClaimInterrupted``, Ctrl-C)
    can land in the middle of counting. Without multiprocess mode the values are plain
    numbers that a collector hands to the registry when it is read (all waiting events
    are counted first). In prometheus_client's multiprocess mode they are
    prometheus_client's own metrics, whose values live in files other processes read:
    what was counted is added to them each time, by :meth:`flush`, and as the process
    exits (a Celery pool child as it shuts down; any other process at interpreter exit).
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
            self._collectors: list[Any] = list(self._store.metrics.values())
        else:
            self._store = _Tally(namespace)
            self._store.drain = self._drain
            self.registry.register(self._store)
            self._collectors = [self._store]
        # Each label's counts, found with one dict lookup per event; labels are added
        # under the lock (at most MAX_LABELS of them), counts updated by _drain.
        self._cells: dict[str, _Counts] = {}
        # The events wait here and are counted BATCH at a time (see _take).
        self._pending: deque[ClaimEvent] = deque()
        # After unregister() events are counted where they come.
        self._closed = False
        self._warned = False
        # The leases counted as held: (name, slot, fence). Set operations are atomic.
        self._holding: set[tuple[str, int | None, int | None]] = set()
        self._new_locks()
        self._beat: BeatMetrics | None = None
        #: What to subscribe (:func:`install` does): counts one event. A bound method,
        #: which Python calls faster than the object itself.
        self.subscriber: Callable[[ClaimEvent], None] = self._take
        _every_metrics.add(self)  # see _forget

    @property
    def beat(self) -> BeatMetrics:
        """The beat metrics in the same registry, made when first asked for."""
        with self._lock:
            if self._beat is None:
                self._beat = BeatMetrics(self.registry, self.namespace)
                self._collectors.extend(self._beat.metrics.values())
            return self._beat

    def _new_locks(self) -> None:
        """Locks nobody holds, and no counting thread yet (a process starts its own with
        its first event)."""
        self._drain_lock = threading.Lock()
        self._lock = threading.Lock()
        self._counting = False
        self._wake = threading.Event()
        self._stop = threading.Event()

    def __call__(self, event: ClaimEvent) -> None:
        """Count one event (as :attr:`subscriber` does, through one call more)."""
        self.subscriber(event)

    def _take(self, event: ClaimEvent) -> None:
        """An event only waits in the deque, for the counting thread: counting a batch
        at once, in a loop that stays in the processor's caches, costs less than counting
        each event amid a claim's own work. A read of the registry counts what waits
        first; the first event of a process starts its counting thread."""
        pending = self._pending
        pending.append(event)
        if not self._counting:
            self._start_counting()
        elif len(pending) >= BATCH:
            self._wake.set()

    def flush(self) -> None:
        """Count every event waiting now and, in multiprocess mode, write the counts to
        this process's files (before it exits, say)."""
        self._drain()

    def _drain(self) -> None:
        """Count the events waiting, in the order they came (deque appends and pops are
        atomic; the lock keeps two threads from counting at once)."""
        with self._drain_lock:
            self._count_all(self._pending)
            if isinstance(self._store, _Shared):
                self._store.write()

    def _count(self, event: ClaimEvent) -> None:
        """Count one event at once, not through the queue."""
        self._count_all(deque((event,)))

    def _count_all(self, pending: deque[ClaimEvent]) -> None:
        """Count and take out every event in ``pending``, in one loop: one unpacking of
        each, one lookup of its label's values."""
        popleft = pending.popleft
        cells, holding, new_label, counted = self._cells, self._holding, self._new_label, _COUNTED
        while pending:
            kind, name, label, _, fence, _, outcome, reason, duration, slot, _, _ = popleft()
            if kind not in counted:
                continue
            counts = cells.get(label) or new_label(label)
            if kind == "acquired":
                counts.acquired += 1.0
                key = (name, slot, fence)
                if key not in holding:
                    holding.add(key)
                    counts.held += 1.0
            elif kind == "released" or kind == "lost":
                if kind == "released":
                    counts.released[outcome if outcome in OUTCOMES else OTHER] += 1.0
                else:
                    counts.lost[_word(reason, LOSS_CAUSES)] += 1.0
                # A loss is often followed by a release (outcome "lost") of the same lease:
                # the gauge and the duration count the first of the two.
                try:
                    holding.remove((name, slot, fence))
                except KeyError:
                    continue
                counts.held -= 1.0
                if duration is not None:
                    run = counts.run
                    run[bisect_left(RUN_BUCKETS, duration)] += 1.0
                    run[-1] += duration
            elif kind == "skipped":
                counts.skipped[_word(reason, SKIP_REASONS)] += 1.0
            elif kind == "throttled":
                counts.throttled += 1.0
            elif kind == "renewed":
                if duration is not None:
                    renewal = counts.renewal
                    renewal[bisect_left(RENEWAL_BUCKETS, duration)] += 1.0
                    renewal[-1] += duration
            elif kind == "renewal_failed":
                counts.failures += 1.0
            else:
                counts.unavailable += 1.0

    def _start_counting(self) -> None:
        """This process's thread that counts what waits (see :func:`_count_in_thread`);
        after :meth:`unregister`, the event that came is counted at once instead."""
        with self._lock:
            closed = self._closed
            if not (closed or self._counting):
                threading.Thread(
                    target=_count_in_thread,
                    args=(weakref.ref(self), self._wake, self._stop),
                    name="fenced-metrics",
                    daemon=True,
                ).start()
                self._counting = True
        if closed:
            self._drain()

    def _forget(self) -> None:
        """In a forked child: the locks are new (a thread of the parent may have held
        them), no counting thread runs yet, and in multiprocess mode what the parent had
        not written yet is the parent's."""
        self._new_locks()
        if isinstance(self._store, _Shared):
            self._pending.clear()
            self._holding.clear()
            self._store.forget()
        else:
            self._store.lock = threading.Lock()

    def unregister(self) -> None:
        """Stop this process's counting thread, write what waits, and take the metrics out
        of the registry (an event still on its way is counted as it comes)."""
        with self._lock:
            self._closed = True
            self._counting = False
            self._stop.set()
            self._wake.set()
        self.flush()
        for collector in self._collectors:
            try:
                self.registry.unregister(collector)
            except KeyError:
                pass

    def _new_label(self, label: str) -> _Counts:
        """The values of a label not seen yet: its own, or ``"other"``'s past MAX_LABELS."""
        with self._lock:
            cells = self._cells.get(label)
            if cells is not None:
                return cells
            if len(self._cells) >= MAX_LABELS:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "fenced.metrics: more than %d claim labels; further ones are counted "
                        "as %r (give claims a label= that does not carry call arguments)",
                        MAX_LABELS,
                        OTHER,
                    )
                label = OTHER
                cells = self._cells.get(OTHER)
                if cells is not None:
                    return cells
            cells = self._cells[label] = self._store.cells(label)
            return cells


def _count_in_thread(
    ref: weakref.ReferenceType[ClaimMetrics], wake: threading.Event, stop: threading.Event
) -> None:
    """A process's counting thread: count what waits (and in multiprocess mode write it)
    when woken and at least every FLUSH_SECONDS, until the metrics are unregistered or
    gone. Only this thread, a registry read and flush() count: never a claim's thread."""
    logged = -ERROR_LOG_INTERVAL
    while True:
        wake.wait(FLUSH_SECONDS)
        wake.clear()
        metrics = ref()
        if metrics is None or stop.is_set():
            return
        try:
            metrics._drain()
        except Exception:  # a full disk, say: try again next time, never die silently
            now = time.monotonic()
            if now - logged >= ERROR_LOG_INTERVAL:
                logged = now
                log.exception(
                    "fenced.metrics: counting the claim metrics failed (tried again every "
                    "%.0fs; logged at most once a minute)",
                    FLUSH_SECONDS,
                )
        del metrics


#: Every ClaimMetrics of this process: none writes while the process forks, and a
#: forked child makes each forget what its parent had not written yet.
_every_metrics: weakref.WeakSet[ClaimMetrics] = weakref.WeakSet()

#: The locks the forking thread took before the fork (each forking thread its own).
_forking = threading.local()
_LOCK_TYPE = type(threading.Lock())


def _files_lock() -> Any:
    """prometheus_client's one lock over its multiprocess files (a closure variable of its
    value class), or None when not in multiprocess mode or not found."""
    if not _in_files():
        return None
    for method in ("inc", "set", "get"):
        for cell in getattr(getattr(_values.ValueClass, method, None), "__closure__", None) or ():
            if isinstance(cell.cell_contents, _LOCK_TYPE):
                return cell.cell_contents
    return None


def _before_fork() -> None:
    # No counts are being written while the process forks, by fenced or by anyone else:
    # prometheus_client guards its files with one lock, and a child forked while another
    # thread held it would wait for it forever at its first write.
    locks = [metrics._drain_lock for metrics in list(_every_metrics)]
    files = _files_lock()
    if files is not None:
        locks.append(files)
    for lock in locks:
        lock.acquire()
    _forking.locks = locks


def _release_fork_locks() -> None:
    locks = getattr(_forking, "locks", ())
    _forking.locks = ()
    for lock in reversed(locks):
        lock.release()


def _after_fork_in_child() -> None:
    _release_fork_locks()
    for metrics in list(_every_metrics):
        metrics._forget()


def _flush_at_exit() -> None:
    """Multiprocess mode: a process that exits writes what it counted last."""
    for metrics in list(_every_metrics):
        if isinstance(metrics._store, _Shared) and not metrics._closed:
            try:
                metrics.flush()
            except Exception:  # pragma: no cover - the process is going away
                pass


os.register_at_fork(
    before=_before_fork, after_in_parent=_release_fork_locks, after_in_child=_after_fork_in_child
)
atexit.register(_flush_at_exit)


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
        _installed = (metrics, events.subscribe(metrics.subscriber))
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


def serve(port: int, addr: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` over HTTP from a daemon thread (every process's values in
    multiprocess mode), on ``addr`` (this host only unless told); returns the server
    (``shutdown()`` stops it)."""
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
            self._unsubscribe = events.subscribe(self.metrics.subscriber)

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

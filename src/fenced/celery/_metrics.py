"""Prometheus metrics in a Celery worker: the ``fenced_metrics`` settings.

``app.conf.fenced_metrics = True`` (or ``FENCED_METRICS=1`` when the setting is not
given) installs :mod:`fenced.metrics` in the worker: in its main process when it starts
(a prefork child is forked from it and inherits it) and again, idempotently, in each
pool child. ``app.conf.fenced_metrics_port = 9808`` (or ``FENCED_METRICS_PORT``) also
serves ``/metrics`` from the main process once the worker is ready, on 127.0.0.1 unless
``fenced_metrics_address`` (or ``FENCED_METRICS_ADDRESS``) names another address to
listen on (``0.0.0.0`` for every one): the numbers name claims and are served to
anyone who can connect.

The prefork pool's children each keep their own values, so the pool needs
prometheus_client's multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` names an empty
directory where each child writes its values, and the main process's server adds them
up. A child that exits is marked dead (its ``claims_held`` leaves the sum); its counts
stay. A worker asked for metrics with the prefork pool and no such directory does not
start, and says why.

Nothing here imports prometheus_client until a worker asks for metrics.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import sys
from typing import Any

from celery import signals as celery_signals

from .._errors import ConfigError
from ._options import PerApp, switch

__all__ = ["ADDRESS_SETTING", "DEFAULT_ADDRESS", "PORT_SETTING", "SETTING", "address", "settings"]

log = logging.getLogger("fenced.celery")

#: The Celery settings; ``FENCED_METRICS`` and ``FENCED_METRICS_PORT`` are read when
#: they are not given.
SETTING = "fenced_metrics"
PORT_SETTING = "fenced_metrics_port"
#: Where ``/metrics`` listens (``FENCED_METRICS_ADDRESS`` when not given).
ADDRESS_SETTING = "fenced_metrics_address"
#: Loopback: another host sees the metrics only when an address says so.
DEFAULT_ADDRESS = "127.0.0.1"
_HOSTNAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}[A-Za-z0-9])?")
#: The pools that run tasks in child processes.
_PROCESS_POOLS = ("prefork", "processes")

_answers = PerApp((SETTING, PORT_SETTING))
_addresses = PerApp((ADDRESS_SETTING,))


def settings(app: Any) -> tuple[bool, int | None]:
    """Whether a worker of ``app`` keeps claim metrics, and the port it serves them on."""
    answer: tuple[bool, int | None] = _answers(app, _settings)
    return answer


def _settings(app: Any) -> tuple[bool, int | None]:
    on = switch(
        app,
        SETTING,
        "FENCED_METRICS",
        False,
        "1 (claim metrics, pip install 'fenced[metrics]') or 0",
    )
    port = app.conf.get(PORT_SETTING)
    where = PORT_SETTING
    if port is None and os.environ.get("FENCED_METRICS_PORT", "").strip():
        port, where = os.environ["FENCED_METRICS_PORT"].strip(), "FENCED_METRICS_PORT"
        if port.isdigit():
            port = int(port)
    if port is not None:
        check_port(port, where, 9808)
        if not on:
            raise ConfigError(
                f"{where}={port!r} serves claim metrics, which are off: set {SETTING} = True "
                "(or FENCED_METRICS=1) as well"
            )
    return on, port


def check_port(port: Any, where: str, example: int) -> None:
    """ConfigError unless ``port`` (the setting ``where``) is a TCP port number."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ConfigError(f"{where}={port!r} must be a TCP port number (1-65535), e.g. {example}")


def address(app: Any) -> str:
    """The address a worker of ``app`` serves ``/metrics`` on (127.0.0.1 by default)."""
    answer: str = _addresses(app, _address)
    return answer


def _address(app: Any) -> str:
    value, where = app.conf.get(ADDRESS_SETTING), ADDRESS_SETTING
    if value is None:
        value = os.environ.get("FENCED_METRICS_ADDRESS", "").strip() or None
        where = "FENCED_METRICS_ADDRESS"
    if value is None:
        return DEFAULT_ADDRESS
    if isinstance(value, str):
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            if _HOSTNAME.fullmatch(value):
                return value
    raise ConfigError(
        f"{where}={value!r} is not an address to listen on: give an IP address or host "
        f"name, e.g. {DEFAULT_ADDRESS} (this host only, the default) or 0.0.0.0 (every "
        "address: put the port behind a firewall)"
    )


def _process_pool(worker: Any) -> bool:
    pool = getattr(worker, "pool_cls", None)
    if isinstance(pool, str):
        return pool.split(":")[0] in _PROCESS_POOLS
    return getattr(pool, "__module__", "").endswith(".prefork")


def installed() -> Any:
    """The metrics installed in this process, or None (never imports fenced.metrics)."""
    metrics = sys.modules.get("fenced.metrics")
    return None if metrics is None else metrics.installed()


@celery_signals.worker_init.connect(weak=False)
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    """The main process: check the settings, install the metrics."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        on, port = settings(app)
        if not on:
            return
        if port is not None:
            address(app)  # a bad address: refuse to start, as a bad port does
        from .. import metrics

        if _process_pool(sender) and metrics.multiprocess_dir() is None:
            raise ConfigError(
                f"{SETTING}=True with the prefork pool needs prometheus_client's multiprocess "
                "mode: set PROMETHEUS_MULTIPROC_DIR to an empty directory in the worker's "
                "environment (each pool child writes its values there)"
            )
        metrics.registry_for_scrape()  # the directory exists
    except (ConfigError, ImportError) as exc:
        # Celery logs what a signal receiver raises and goes on: a worker asked for
        # metrics it cannot keep must not start as if it kept them.
        log.critical("fenced: %s", exc)
        raise SystemExit(f"fenced: {exc}") from None
    metrics.install()


@celery_signals.worker_ready.connect(weak=False)
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    """The main process, its pool started: serve ``/metrics`` when a port is set."""
    app = getattr(sender, "app", None)
    port = settings(app)[1] if app is not None and installed() is not None else None
    if port is None:
        return
    from .. import metrics

    try:
        where = address(app)
        metrics.serve(port, where)
    except (OSError, ConfigError) as exc:
        log.error("fenced: claim metrics are not served on port %d: %s", port, exc)
        return
    log.info("fenced: claim metrics served on port %d (/metrics, address %s)", port, where)


@celery_signals.worker_process_init.connect(weak=False)
def _on_child_init(**_: Any) -> None:
    """A pool child: the metrics its parent installed, or installed here when not inherited."""
    if installed() is not None:
        return
    from celery import current_app

    try:
        # The app itself: a proxy cannot be weakly referenced (settings are kept per app).
        on, _port = settings(current_app._get_current_object())  # type: ignore[attr-defined]
    except ConfigError:
        return  # the main process refused to start
    if on:
        from .. import metrics

        metrics.install()


@celery_signals.worker_process_shutdown.connect(weak=False)
def _on_child_exit(pid: int | None = None, **_: Any) -> None:
    """A pool child that exits writes what it counted last, and leaves ``claims_held``
    (multiprocess mode)."""
    kept = installed()
    if kept is not None:
        from .. import metrics

        kept.flush()  # what the last FLUSH_SECONDS counted
        metrics.mark_process_dead(pid if pid is not None else os.getpid())

"""A claimed task's options: defaults, settings, checks, and the lock Redis.

Each option is given in the task decorator (``claim_ttl=60``), else by the app setting
``fenced_<option>`` (``app.conf.fenced_claim_ttl``; the namespace's setting is
``fenced_namespace``), else by :data:`DEFAULTS`. They are checked when the task class
is made and resolved when it is bound to its app, so a bad value fails when the worker
starts, not at 02:00 on the first run.

Settings that are not task options: ``fenced_redis_url``, ``fenced_redis_client``,
``fenced_redis_options`` (the lock Redis, below), ``fenced_enabled`` (claims switched
off for tests without Redis: :mod:`fenced.celery._disabled`), ``fenced_metrics``,
``fenced_metrics_port`` and ``fenced_metrics_address`` (Prometheus metrics in a worker:
:mod:`fenced.celery._metrics`), ``fenced_secret_key`` (secret template fields, rerun
triggers' signatures).
"""

from __future__ import annotations

import inspect
import math
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._client import client_from_setting, connect, describe_client, probe_client
from .._errors import ConfigError
from .._guard import BusyPolicy, accepted, busy_policy, check_replace
from .._lease import (
    check_cooldown,
    check_idle_ttl,
    check_limit,
    check_namespace,
    check_rate,
    check_replicas,
    check_timing,
    rate_window,
)
from .._naming import check_label
from .._options import DEFAULT, NAMES, ClaimOptions, refuse_unknown
from .._redact import exception_text, redact
from . import _debounce, _enqueue
from ._enqueue import ENQUEUE_TTL

__all__ = [
    "DEFAULTS",
    "KNOWN_SETTINGS",
    "ON_BUSY",
    "REFUSES",
    "SETTINGS",
    "TaskOptions",
    "lock_redis",
    "resolve",
    "validate",
]

#: The busy policies a task refuses (see fenced._guard): a worker does not block
#: waiting for a holder, it retries.
REFUSES = ("wait",)
ON_BUSY = accepted(REFUSES)
#: The claim's options a task takes as ``claim_<option>`` (fenced.ClaimOptions): all but
#: the run records, which a task always keeps.
CLAIM_OPTIONS = tuple(n for n in NAMES if n not in ("records", "max_records"))
#: Where a task's defaults differ from a claim's: a longer lease, and a redelivery
#: window of a day, longer than a Redis broker's visibility timeout (an hour by
#: default) and RabbitMQ's consumer timeout (30 minutes), after which a message comes back.
TASK_CLAIM = DEFAULT.replace(ttl=60.0, redelivery_window=86400.0, records=True)
#: Built-in defaults; ``app.conf.fenced_<option>`` overrides them, a task option wins.
DEFAULTS: dict[str, Any] = {
    **{f"claim_{n}": getattr(TASK_CLAIM, n) for n in CLAIM_OPTIONS},
    "claim_on_busy": "skip",
    # Alert when this many runs in a row were skipped (0: never), and what to call.
    "claim_alert_after_skips": 5,
    "claim_on_skips_exceeded": None,
    "claim_interrupt": True,
    # While the lock Redis is unreachable: retry after this long, this many times.
    "claim_unavailable_backoff": 1.0,
    "claim_unavailable_retries": 10,
    # Deduplication at enqueue (fenced.celery._enqueue): off, or one of its MODES.
    "claim_enqueue": None,
    "claim_enqueue_ttl": ENQUEUE_TTL,
    # A call over claim_rate: put back until the next start allowed, or skipped.
    "claim_rate_policy": "delay",
    # Debounce (fenced.celery._debounce): off, or seconds; and the longest a burst waits.
    "claim_debounce": None,
    "claim_debounce_max": None,
}
OPTIONS = tuple(DEFAULTS)
#: The setting that gives each option its default.
SETTINGS = {
    option: "fenced_namespace" if option == "claim_namespace" else f"fenced_{option}"
    for option in OPTIONS
}
#: Earlier names of options, still read (with a DeprecationWarning).
RENAMED = {"claim_on_conflict": "claim_on_busy"}
#: Every ``fenced_*`` setting an app may give; any other is a typo, refused.
KNOWN_SETTINGS = frozenset(
    (
        *SETTINGS.values(),
        "fenced_claim_on_conflict",
        "fenced_redis_url",
        "fenced_redis_client",
        "fenced_redis_options",
        "fenced_secret_key",
        "fenced_enabled",
        "fenced_metrics",
        "fenced_metrics_port",
        "fenced_metrics_address",
        # fenced.celery.beat
        "fenced_beat_name",
        "fenced_beat_ttl",
        "fenced_beat_alarm_after",
        "fenced_beat_metrics_port",
    )
)


def _number(value: Any, option: str, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
        raise ConfigError(f"{option}={value!r} must be a number >= 0")
    return value


def _alert(value: Any, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{option}={value!r} must be a whole number of skips (0 never alerts), e.g. 5"
        )
    return value


def _callback(value: Any, option: str) -> Callable[..., Any]:
    if not callable(value):
        raise ConfigError(
            f"{option}={value!r} is not callable; pass a function taking (sender, name, "
            "skips, holder) as keywords, or None"
        )
    return value  # type: ignore[no-any-return]


def _switch(value: Any, option: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{option}={value!r} must be True or False")
    return value


#: What a call over ``claim_rate`` does: each policy and its help.
RATE_POLICIES = {
    "delay": "book the next free start for the call and put it back until then (a "
    "retry that max_retries does not count)",
    "skip": "return a skipped result (reason 'rate limited')",
}


def _rate_policy(value: Any, option: str) -> str:
    if value not in RATE_POLICIES:
        choices = ", ".join(f"{k!r} ({v})" for k, v in RATE_POLICIES.items())
        raise ConfigError(f"{option}={value!r} is not one of: {choices}")
    return str(value)


def _cooldown(value: Any, given: Mapping[str, Any]) -> float | None:
    idle = given.get("claim_idle_ttl")
    idle_ms = int(idle * 1000) if isinstance(idle, (int, float)) and idle > 0 else 0
    ms = check_cooldown(value, idle_ms, "claim_cooldown")
    if ms and given.get("claim_on_busy") == "rerun":
        # The rerun would be sent when the run ends ok: inside the window it just opened.
        raise ConfigError(
            "claim_on_busy='rerun' asks for a run right after the holder's, which "
            "claim_cooldown then skips: use claim_on_busy='skip' with a cooldown"
        )
    return ms / 1000 if ms else None


def _replicas(given: Mapping[str, Any], span: float) -> tuple[int, int]:
    def of(option: str) -> Any:
        return given.get(option, DEFAULTS[option])

    names = ("claim_replicas", "claim_replica_timeout")
    return check_replicas(of(names[0]), of(names[1]), span, names=names)


def _idle(value: Any, given: Mapping[str, Any], span: float) -> float:
    check_idle_ttl(value, given.get("claim_ttl") or 0.0, "claim_idle_ttl")
    return float(value)


def _rate(value: Any, given: Mapping[str, Any], span: float) -> str:
    check_rate(value, "claim_rate")
    return str(value)


def _rate_spread(value: Any, given: Mapping[str, Any], span: float) -> bool:
    rate_window(given.get("claim_rate"), value, ("claim_rate", "claim_rate_spread"))
    return bool(value)


# Each option's check, in the order they are checked: (value, the options given, the
# ttl given or infinity) -> the value cleaned. Without a ttl here (it comes from
# settings) only what does not hang on it is checked.
_Check = Callable[[Any, Mapping[str, Any], float], Any]
_CHECKS: dict[str, _Check] = {
    "claim_ttl": lambda v, g, span: check_timing(v, None, names=("claim_ttl", ""))[0],
    "claim_refresh_every": lambda v, g, span: check_timing(
        span, v, names=("claim_ttl", "claim_refresh_every")
    )[1],
    "claim_namespace": lambda v, g, span: check_namespace(v),
    "claim_on_busy": lambda v, g, span: busy_policy(v, REFUSES, option="claim_on_busy").name,
    "claim_alert_after_skips": lambda v, g, span: _alert(v, "claim_alert_after_skips"),
    "claim_on_skips_exceeded": lambda v, g, span: _callback(v, "claim_on_skips_exceeded"),
    "claim_interrupt": lambda v, g, span: _switch(v, "claim_interrupt"),
    "claim_unavailable_backoff": lambda v, g, span: _number(v, "claim_unavailable_backoff"),
    "claim_redelivery_window": lambda v, g, span: float(_number(v, "claim_redelivery_window")),
    "claim_idle_ttl": _idle,
    "claim_replicas": lambda v, g, span: _replicas(g, span)[0],
    "claim_replica_timeout": lambda v, g, span: _replicas(g, span)[1] / 1000,
    "claim_enqueue": lambda v, g, span: _enqueue.check_mode(v),
    "claim_enqueue_ttl": lambda v, g, span: _enqueue.check_ttl(v),
    "claim_unavailable_retries": lambda v, g, span: _number(v, "claim_unavailable_retries", True),
    "claim_cooldown": lambda v, g, span: _cooldown(v, g),
    "claim_limit": lambda v, g, span: check_limit(v, "claim_limit"),
    "claim_rate": _rate,
    "claim_rate_spread": _rate_spread,
    "claim_rate_policy": lambda v, g, span: _rate_policy(v, "claim_rate_policy"),
    "claim_label": lambda v, g, span: check_label(v, "claim_label"),
}


def validate(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check every option given (None means: from settings) and return them cleaned."""
    given = {k: v for k, v in values.items() if v is not None}
    span = given.get("claim_ttl", math.inf)
    try:
        out = {k: check(given[k], given, span) for k, check in _CHECKS.items() if k in given}
        out.update(_debounce.check(given))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    return out


@dataclass(frozen=True)
class TaskOptions:
    """A task's options after settings and defaults are applied."""

    claim: ClaimOptions
    on_busy: str
    policy: BusyPolicy
    alert_after: int
    on_skips_exceeded: Callable[..., Any] | None
    interrupt: bool
    backoff: float
    unavailable_retries: int
    enqueue: str | None
    enqueue_ttl: float
    #: Every option (``claim_ttl``, ...) as resolved: what the task's attributes say.
    values: Mapping[str, Any]


def resolve(
    given: Mapping[str, Any], conf: Any, where: str, label: str | None = None
) -> TaskOptions:
    """The options of a task: what it gives, else the app's settings, else the defaults;
    ``label``: its claims' label when none is given (its template's)."""
    refuse_unknown(
        [k for k in conf if isinstance(k, str) and k.startswith("fenced_")],
        KNOWN_SETTINGS,
        f"{where}: app.conf",
        "setting",
    )
    raw: dict[str, Any] = {}
    for option in OPTIONS:
        value = given.get(option)
        if value is None:
            value = conf.get(SETTINGS[option])
        if value is None and option == "claim_on_busy":
            value = conf.get("fenced_claim_on_conflict")  # the setting's earlier name
        raw[option] = DEFAULTS[option] if value is None else value
    if raw["claim_debounce"] is not None and given.get("claim_on_busy") is None:
        # A debounced run waits for a busy name, whatever the app's default policy for
        # its other tasks (a task that asks for another policy itself is refused).
        raw["claim_on_busy"] = "retry"
    merged = {**raw, **validate(raw, where)}
    claim = TASK_CLAIM.replace(prefix="claim_", **{n: merged[f"claim_{n}"] for n in CLAIM_OPTIONS})
    values = {**merged, **{f"claim_{n}": getattr(claim, n) for n in CLAIM_OPTIONS}}
    values["claim_cooldown"] = claim.cooldown_seconds
    if claim.label is None and label is not None:
        claim = claim.replace(label=label)
    policy = busy_policy(merged["claim_on_busy"], REFUSES, option="claim_on_busy")
    check_replace(policy, claim.limit, where, merged["claim_enqueue"], "claim_on_busy", claim.rate)
    return TaskOptions(
        claim=claim,
        on_busy=merged["claim_on_busy"],
        policy=policy,
        alert_after=merged["claim_alert_after_skips"],
        on_skips_exceeded=merged["claim_on_skips_exceeded"],
        interrupt=merged["claim_interrupt"],
        backoff=float(merged["claim_unavailable_backoff"]),
        unavailable_retries=int(merged["claim_unavailable_retries"]),
        enqueue=merged["claim_enqueue"],
        enqueue_ttl=float(merged["claim_enqueue_ttl"]),
        values=values,
    )


def as_attribute(value: Any) -> Any:
    """A function given as an option must not become a method of the task class."""
    return staticmethod(value) if inspect.isfunction(value) else value


# -- the lock Redis -------------------------------------------------------------------

_clients: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()
_clients_lock = threading.Lock()


def _encoded_keys(names: tuple[str, ...]) -> tuple[Any, ...] | None:
    """Each setting's environment variable as os.environ keeps it (its encoded
    upper-case name); None when os.environ is not the standard mapping."""
    encode = getattr(os.environ, "encodekey", None)
    if encode is None:
        return None
    return tuple(encode(name.upper()) for name in names)


class PerApp:
    """One answer per app, given again while the settings it reads are as they were.

    ``names`` are the settings the answer hangs on (see :func:`settings_seen`); an app
    whose settings are not Celery's own is asked every time.
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._env_keys = _encoded_keys(names)
        self._answers: weakref.WeakKeyDictionary[Any, tuple[tuple[Any, ...], Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        # The last app asked (weakly) and its entry: every run of a worker's tasks asks
        # for the same app, and a weak mapping's lookup makes a weak reference per call.
        self._last: tuple[weakref.ref[Any], tuple[tuple[Any, ...], Any]] | None = None

    def __call__(self, app: Any, compute: Callable[[Any], Any]) -> Any:
        """``compute(app)``, or its answer given before under the same settings."""
        seen = settings_seen(app, self.names, self._env_keys)
        if seen is not None:
            last = self._last
            known = last[1] if last is not None and last[0]() is app else self._answers.get(app)
            if known is not None and known[0] == seen:
                return known[1]
        answer = compute(app)
        if seen is not None:
            with self._lock:
                entry = self._answers[app] = (seen, answer)
                self._last = (weakref.ref(app), entry)
        return answer


# The client each app was last given (read again when its settings change).
_given = PerApp(("fenced_redis_client", "fenced_redis_url", "fenced_redis_options"))


def settings_seen(
    app: Any, names: tuple[str, ...], env_keys: tuple[Any, ...] | None = None
) -> tuple[Any, ...] | None:
    """What some fenced settings of an app hang on, read without a settings lookup.

    Every run asks for them, and looking up a setting an app does not have costs
    Celery a few KeyErrors per settings map. The settings object (a new one after
    ``config_from_object``), its runtime changes (``app.conf.x = ...``, ``update()``)
    and the environment (each setting's upper-case name) are what can change after the
    first run: while they are as they were, so is the answer. None when the settings
    are not Celery's own. ``env_keys``: the names' variables as :func:`_encoded_keys`
    gave them (the caller keeps them).
    """
    conf = app.conf
    changes = getattr(conf, "__dict__", {}).get("changes")
    if not isinstance(changes, dict):
        return None
    data = getattr(os.environ, "_data", None)
    if env_keys is not None and type(data) is dict:
        return (conf, len(changes), *map(changes.get, names), *map(data.get, env_keys))
    return (conf, len(changes), *map(changes.get, names), *_environment(names))


# Each setting's environment variable as os.environ keeps it (its encoded upper-case
# name), so that a run's look at the environment is one dict lookup per name.
_env_keys: dict[tuple[str, ...], tuple[Any, ...]] = {}


def _environment(names: tuple[str, ...]) -> tuple[Any, ...]:
    """The environment's value of each setting's upper-case name (None when unset), as
    os.environ stores it: compared with an earlier look, never shown."""
    env = os.environ
    data = getattr(env, "_data", None)
    encode = getattr(env, "encodekey", None)
    if type(data) is not dict or encode is None:  # not the standard os.environ
        return tuple(env.get(name.upper()) for name in names)
    keys = _env_keys.get(names)
    if keys is None:
        keys = _env_keys[names] = tuple(encode(name.upper()) for name in names)
    return tuple(map(data.get, keys))


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def switch(app: Any, setting: str, env: str, default: bool, use: str, means: str = "") -> bool:
    """An on/off setting: True or False, else the environment variable ``env`` (1/0,
    true/false, yes/no, on/off; empty or unset: ``default``). ``use`` is what the
    variable's error suggests, ``means`` what the setting's adds."""
    value = app.conf.get(setting)
    if value is None:
        text = os.environ.get(env, "")
        word = text.strip().lower()
        if not word:
            return default
        if word not in _TRUE + _FALSE:
            raise ConfigError(f"{env}={text!r} is not a switch: use {use}")
        return word in _TRUE
    if not isinstance(value, bool):
        raise ConfigError(f"{setting}={value!r} must be True or False{means}")
    return value


def lock_url(app: Any) -> str | None:
    """The URL of the Redis that holds an app's claims, or None when none is set."""
    url = app.conf.get("fenced_redis_url") or os.environ.get("FENCED_REDIS_URL")
    return str(url) if url else None


def lock_redis(app: Any) -> Any:
    """The Redis client that holds claims for a Celery app (one per app and process).

    ``fenced_redis_client`` (a callable, or its dotted path, returning a redis-py client)
    comes first; then the ``fenced_redis_url`` setting, then ``FENCED_REDIS_URL``, in any
    form :mod:`fenced._client` reads (standalone, TLS, unix, Sentinel, Cluster).
    """
    return _given(app, _lock_redis)


def _lock_redis(app: Any) -> Any:
    factory = app.conf.get("fenced_redis_client") or os.environ.get("FENCED_REDIS_CLIENT")
    if factory:
        key: tuple[Any, ...] = ("client", factory)
    else:
        url = lock_url(app)
        if not url:
            raise ConfigError(
                "fenced has no Redis for claims: set app.conf.fenced_redis_url = "
                "'redis://host:6379/1' or the environment variable FENCED_REDIS_URL "
                "(the broker's Redis is not used by default: claims need a database with "
                "maxmemory-policy noeviction)"
            )
        # A paused Redis must not hold a task forever: acquire fails closed instead.
        options: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        options.update(app.conf.get("fenced_redis_options") or {})
        # Changed options for the same URL (a longer timeout, TLS files) are a new client.
        key = ("url", url, options)
    with _clients_lock:
        cached = _clients.get(app)
        if cached is None or cached[0] != key:
            # redis-py pools notice a fork and reconnect, so one client serves the main
            # process and every pool child.
            made = (
                client_from_setting(factory) if factory else connect(url, what="claims", **options)
            )
            cached = _clients[app] = (key, made)
        return cached[1]


def ping_claims(app: Any, timeout: float) -> tuple[str, str | None]:
    """One PING of the Redis an app's claims are taken on: where it is, fit to print
    (passwords as ``***``), and why it did not answer (None: it did).

    A URL (``fenced_redis_url``, ``FENCED_REDIS_URL``) is asked through a client of its
    own, with ``fenced_redis_options``, that waits ``timeout`` seconds at most and
    never retries; a client the app builds (``fenced_redis_client``) is asked as it is.
    """
    factory = app.conf.get("fenced_redis_client") or os.environ.get("FENCED_REDIS_CLIENT")
    url = None if factory else lock_url(app)
    where = redact(url) if url else "(none set)"
    try:
        if url is None:
            client = lock_redis(app)  # the factory's client, or ConfigError: none set
            where = describe_client(client)
            client.ping()
        else:
            options = dict(app.conf.get("fenced_redis_options") or {})
            probe = probe_client(url, timeout, **options)
            try:
                probe.ping()
            finally:
                probe.close()
    except Exception as exc:
        return where, exception_text(exc)
    return where, None

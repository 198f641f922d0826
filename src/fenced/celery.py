"""Celery integration: a task base class whose every run holds a fenced claim.

::

    from fenced.celery import ClaimedTask

    @app.task(base=ClaimedTask, bind=True, acks_late=True,
              claim="rebuild:{tenant}:{layer}", claim_ttl=60)
    def rebuild_map(self, tenant, layer):
        for step in self.claim.steps(build_steps(tenant, layer)):
            step.run(fence=self.claim.fence)

What one run does:

1. It names its claim from the task's arguments and acquires it: one round trip, which
   also writes the ``started`` run record (or the ``skipped`` one, counting the skip).
2. If another holder has the claim: a holder carrying *this* task id is an earlier
   attempt that died holding it (the message was redelivered), so the task retries when
   that lease ends; anyone else is a conflict, handled by ``claim_on_conflict``:
   ``skip`` returns a result (no retry, no failure), ``rerun`` also asks the holder for
   one more run, ``retry`` retries after the holder's lease, ``raise`` fails with
   ``ClaimHeld``.
   A retried or redelivered message whose task id already ran to the end (its run
   record says ``ok``) does not run again: it is ignored, keeping the stored result.
3. The body runs with ``self.claim``. The process's heartbeat renews the lease; once it is
   lost, ``self.claim.check()`` and ``steps()`` raise ``ClaimLost``, and a task that never
   checks is interrupted (``claim_interrupt``): ``ClaimInterrupted`` is raised in the
   thread running it at its next bytecode, and a task in a main thread (prefork, solo)
   is also woken from a sleep or a blocking call by ``SIGUSR2``. The run fails with
   ``ClaimLost`` and its record says ``lost``; the loser never deletes the new
   holder's lease. (Under gevent or eventlet there is no interrupt; checks still raise.)
4. In ``finally`` the claim is released with the run's outcome (one round trip, which
   also ends the run record), and if a rerun was asked meanwhile the task is sent once
   more with the same arguments.

Redis unreachable at acquire: the task retries with exponential backoff; it never runs
unclaimed. A prefork child killed mid-run: the worker's main process releases that
child's claim (``ClaimedRequest``), so the redelivered message runs at once instead of
waiting for the lease to expire.

Settings (``app.conf``): ``fenced_redis_url`` (or the ``FENCED_REDIS_URL`` environment
variable; there is no fallback to the broker), ``fenced_redis_options``,
``fenced_namespace``, and defaults for every task option as ``fenced_<option>``, e.g.
``fenced_claim_ttl``, read when the task is bound to its app. The Redis client is made
on first use, one per app and process.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import os
import random
import signal
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, cast

import redis

try:
    from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
    from billiard.exceptions import WorkerLostError
    from celery import Task
    from celery.exceptions import Ignore, Retry, SoftTimeLimitExceeded
    from celery.worker.request import Request
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"fenced.celery needs Celery: pip install 'fenced[celery]' ({exc})") from exc

if TYPE_CHECKING:
    from celery import Celery

from . import _claim, records
from . import celery_signals as signals
from ._claim import _HOST, Claim, Holder, force_release
from ._errors import ClaimHeld, ClaimLost, ClaimUnavailable, ConfigError
from ._keys import ClaimKeys, _render, template_fields, validate_name

__all__ = [
    "ClaimInterrupted",
    "ClaimedRequest",
    "ClaimedTask",
    "lock_redis",
    "metrics",
    "signals",
]

log = logging.getLogger("fenced.celery")

POLICIES = ("skip", "rerun", "retry", "raise")
#: Built-in defaults; ``app.conf.fenced_<option>`` overrides them, a task option wins.
DEFAULTS: dict[str, Any] = {
    "claim_ttl": 60.0,
    "claim_refresh_every": None,
    "claim_on_conflict": "skip",
    "claim_alert_after_skips": 5,
    "claim_on_skips_exceeded": None,
    "claim_interrupt": True,
    "claim_namespace": "fenced",
    "claim_unavailable_backoff": 1.0,
    "claim_unavailable_retries": 10,
}
#: Longest wait between retries while Redis is unreachable.
UNAVAILABLE_MAX_DELAY = 60.0
#: Retries a redelivered task makes while an earlier attempt's lease runs out. Each
#: waits for the lease, so this bounds only an attempt that keeps renewing (alive).
REDELIVERY_MAX_RETRIES = 100
#: Added to a holder's remaining lease before retrying, so the retry finds it gone.
RETRY_MARGIN = 0.25
#: The signal that wakes a task in a main thread when its claim is lost.
INTERRUPT_SIGNAL = getattr(signal, "SIGUSR2", None)


#: In-process counters: runs, ok, failed, lost, skipped, skips_exceeded, reruns,
#: conflict_retries, redelivery_retries, unavailable, duplicates, aborted (per process:
#: a prefork child counts its own runs, the main process counts ``aborted``).
metrics: Counter[str] = Counter()
_metrics_lock = threading.Lock()


def _count(key: str) -> None:
    with _metrics_lock:
        metrics[key] += 1


class ClaimInterrupted(ClaimLost):
    """Raised inside a task that did not check its claim, when the claim was lost."""

    def __init__(
        self, message: str = "the claim was lost while the task ran", **kwargs: Any
    ) -> None:
        super().__init__(message, **kwargs)


# -- the lock Redis -------------------------------------------------------------------

_clients: weakref.WeakKeyDictionary[Any, tuple[str, Any]] = weakref.WeakKeyDictionary()
_clients_lock = threading.Lock()


def lock_redis(app: Any) -> Any:
    """The Redis client that holds claims for a Celery app (one per app and process)."""
    url = app.conf.get("fenced_redis_url") or os.environ.get("FENCED_REDIS_URL")
    if not url:
        raise ConfigError(
            "fenced has no Redis for claims: set app.conf.fenced_redis_url = "
            "'redis://host:6379/1' or the environment variable FENCED_REDIS_URL "
            "(the broker's Redis is not used by default: claims need a database with "
            "maxmemory-policy noeviction)"
        )
    with _clients_lock:
        cached = _clients.get(app)
        if cached is not None and cached[0] == url:
            return cached[1]
        # A paused Redis must not hold a task forever: acquire fails closed instead.
        options: dict[str, Any] = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}
        options.update(app.conf.get("fenced_redis_options") or {})
        # redis-py pools notice a fork and reconnect, so one client serves the main
        # process and every pool child.
        client = redis.Redis.from_url(url, **options)
        _clients[app] = (url, client)
        return client


# -- options --------------------------------------------------------------------------


def _check_ttl(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"{where}: claim_ttl={value!r} is not a positive number of seconds; choose one "
            "well above the refresh interval, e.g. claim_ttl=60"
        )
    return float(value)


def _check_refresh(value: Any, ttl: float | None, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(
            f"{where}: claim_refresh_every={value!r} must be a positive number of seconds "
            "below claim_ttl; leave it None for claim_ttl/3"
        )
    if ttl is not None and not value < ttl:
        raise ConfigError(
            f"{where}: claim_refresh_every={value!r} must be below claim_ttl={ttl}: a lease "
            "renewed no sooner than it expires is lost between renewals; leave it None "
            "for claim_ttl/3"
        )
    return float(value)


def _check_policy(value: Any, where: str) -> str:
    if value not in POLICIES:
        raise ConfigError(
            f"{where}: claim_on_conflict={value!r} is not one of {', '.join(POLICIES)}; "
            "use 'skip' to return a skipped result while another run holds the claim"
        )
    return str(value)


def _check_alert(value: Any, where: str) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(
            f"{where}: claim_alert_after_skips={value!r} must be a whole number of skips "
            "(0 never alerts), e.g. 5"
        )
    return value


def _check_callback(value: Any, where: str) -> Callable[..., Any] | None:
    if value is not None and not callable(value):
        raise ConfigError(
            f"{where}: claim_on_skips_exceeded={value!r} is not callable; pass a function "
            "taking (sender, name, skips, holder) as keywords, or None"
        )
    callback: Callable[..., Any] | None = value
    return callback


def _check_bool(value: Any, option: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {option}={value!r} must be True or False")
    return value


def _check_namespace(value: Any, where: str) -> str:
    try:
        ClaimKeys.of("x", value)
    except ConfigError as exc:
        raise ConfigError(f"{where}: claim_namespace: {exc}") from None
    return str(value)


def _check_positive(value: Any, option: str, where: str, integer: bool = False) -> Any:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value < 0:
        raise ConfigError(f"{where}: {option}={value!r} must be a number >= 0")
    return value


def _validate(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Check every option given (None means: from settings) and return them cleaned."""
    out: dict[str, Any] = {}
    ttl = values.get("claim_ttl")
    if ttl is not None:
        out["claim_ttl"] = _check_ttl(ttl, where)
    if values.get("claim_refresh_every") is not None:
        out["claim_refresh_every"] = _check_refresh(
            values["claim_refresh_every"], out.get("claim_ttl"), where
        )
    if values.get("claim_on_conflict") is not None:
        out["claim_on_conflict"] = _check_policy(values["claim_on_conflict"], where)
    if "claim_alert_after_skips" in values and values["claim_alert_after_skips"] is not None:
        out["claim_alert_after_skips"] = _check_alert(values["claim_alert_after_skips"], where)
    if values.get("claim_on_skips_exceeded") is not None:
        out["claim_on_skips_exceeded"] = _check_callback(values["claim_on_skips_exceeded"], where)
    if values.get("claim_interrupt") is not None:
        out["claim_interrupt"] = _check_bool(values["claim_interrupt"], "claim_interrupt", where)
    if values.get("claim_namespace") is not None:
        out["claim_namespace"] = _check_namespace(values["claim_namespace"], where)
    if values.get("claim_unavailable_backoff") is not None:
        out["claim_unavailable_backoff"] = _check_positive(
            values["claim_unavailable_backoff"], "claim_unavailable_backoff", where
        )
    if values.get("claim_unavailable_retries") is not None:
        out["claim_unavailable_retries"] = _check_positive(
            values["claim_unavailable_retries"], "claim_unavailable_retries", where, True
        )
    return out


@dataclass(frozen=True)
class _Spec:
    """How a task class names its claim: from a template over its arguments, or a callable."""

    template: str | None
    func: Callable[[tuple[Any, ...], dict[str, Any]], str] | None
    fields: tuple[str, ...]
    positional: tuple[str, ...]
    defaults: Mapping[str, Any]
    label: str

    def values(self, task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The template fields' values in one call's arguments."""
        out: dict[str, Any] = {}
        for field in self.fields:
            if field in kwargs:
                out[field] = kwargs[field]
                continue
            try:
                out[field] = args[self.positional.index(field)]
            except (ValueError, IndexError):
                if field not in self.defaults:
                    raise ConfigError(
                        f"task {task} was called without {field!r}, which its claim template "
                        f"{self.template!r} needs: pass {field}=..."
                    ) from None
                out[field] = self.defaults[field]
        return out


def _signature_of(run: Any) -> inspect.Signature | None:
    """The task's own parameters (without ``self`` for a bound ``run``)."""
    func = run.__func__ if isinstance(run, staticmethod) else run
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return None
    if not isinstance(run, staticmethod):
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


def _make_spec(source: Any, run: Any, where: str) -> _Spec:
    if callable(source) and not isinstance(source, str):
        label = getattr(source, "__qualname__", None) or repr(source)
        return _Spec(None, source, (), (), {}, label)
    if not isinstance(source, str):
        raise ConfigError(
            f"{where}: claim={source!r} must be a template over the task's arguments, "
            "e.g. claim='rebuild:{tenant}:{layer}', or a callable(args, kwargs) -> str"
        )
    try:
        fields = template_fields(source)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    sig = _signature_of(run)
    positional: list[str] = []
    defaults: dict[str, Any] = {}
    if sig is not None:
        kinds = inspect.Parameter
        names: set[str] = set()
        var_kw = False
        for p in sig.parameters.values():
            if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD):
                positional.append(p.name)
            if p.kind is kinds.VAR_KEYWORD:
                var_kw = True
            elif p.kind is not kinds.VAR_POSITIONAL:
                names.add(p.name)
            if p.default is not kinds.empty:
                defaults[p.name] = p.default
        missing = [f for f in fields if f not in names]
        if missing and not var_kw:
            raise ConfigError(
                f"{where}: claim template {source!r} names {', '.join(missing)}, but the "
                f"task has no argument of that name (it has: {', '.join(sorted(names)) or 'none'}"
                "); rename the field or add the argument"
            )
    return _Spec(source, None, tuple(fields), tuple(positional), defaults, source)


@dataclass(frozen=True)
class _Config:
    """A task's options after settings are applied (resolved once per process)."""

    client: Any
    ttl: float
    refresh_every: float | None
    on_conflict: str
    alert_after: int
    on_skips_exceeded: Callable[..., Any] | None
    interrupt: bool
    namespace: str
    backoff: float
    unavailable_retries: int


# -- interrupting a task that does not check -------------------------------------------

_local = threading.local()
_main_runs: list[_Run] = []
_handler_pid: int | None = None
_previous_handler: Any = None


class _Run:
    """One claimed run in one thread: what the heartbeat interrupts when the claim is lost."""

    __slots__ = ("active", "claim", "lock", "main", "raised", "sent", "thread")

    def __init__(self, main: bool) -> None:
        self.thread = threading.get_ident()
        self.main = main
        self.lock = threading.Lock()
        self.active = False
        self.sent = False
        self.raised = False
        self.claim: Claim | None = None

    def on_lost(self, claim: Claim) -> None:
        if threading.get_ident() == self.thread:
            return  # the task's own thread noticed: check() raises there
        with self.lock:
            if not self.active or self.sent:
                return
            self.sent = True
            log.warning(
                "fenced: claim %r lost while its task ran (%s); interrupting it",
                claim.name,
                claim.lost_reason,
            )
            if self.main and INTERRUPT_SIGNAL is not None:
                # A signal also wakes a main thread that sleeps or waits in C.
                signal.pthread_kill(self.thread, INTERRUPT_SIGNAL)
            else:
                _async_raise(self.thread, ClaimInterrupted)

    def deactivate(self) -> None:
        with self.lock:
            if not self.active:
                return
            self.active = False
            if self.sent and not self.main:
                _async_raise(self.thread, None)  # withdraw it if not yet delivered


def _async_raise(thread: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in another thread at its next bytecode (None cancels a pending one)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread), ctypes.py_object(exc) if exc is not None else None
    )


def _on_interrupt_signal(signum: int, frame: Any) -> None:
    for run in reversed(_main_runs):
        if run.active and run.sent and not run.raised:
            run.raised = True
            raise ClaimInterrupted()
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)


def _install_signal_handler() -> bool:
    """Install the interrupt handler once per process; only a main thread can."""
    global _handler_pid, _previous_handler
    if INTERRUPT_SIGNAL is None:
        return False
    if _handler_pid == _claim._pid:  # kept current across fork, without a system call
        return True
    try:
        previous = signal.signal(INTERRUPT_SIGNAL, _on_interrupt_signal)
    except ValueError:  # not the main thread of the main interpreter
        return False
    if previous is not _on_interrupt_signal:
        _previous_handler = previous
    _handler_pid = _claim._pid
    return True


def _green_threads() -> bool:
    """True when gevent or eventlet replaced threads: an interrupt could hit another task."""
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("threading"):
        return True
    eventlet = sys.modules.get("eventlet.patcher")
    return bool(eventlet is not None and eventlet.is_monkey_patched("thread"))


def _stack() -> list[tuple[Task[Any, Any], Claim]]:
    stack: list[tuple[Task[Any, Any], Claim]] | None = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


# -- the task base --------------------------------------------------------------------

_OPTIONS = tuple(DEFAULTS)
#: The setting that gives each option its default.
_SETTINGS = {
    option: "fenced_namespace" if option == "claim_namespace" else f"fenced_{option}"
    for option in _OPTIONS
}


class ClaimedTask(Task[Any, Any]):
    """A Celery task base whose runs hold a fenced claim; ``self.claim`` inside the task."""

    #: The custom request releases a killed pool child's claim in the main process.
    Request = "fenced.celery:ClaimedRequest"

    #: A template over the task's arguments, or a callable(args, kwargs) -> claim name.
    #: Inside a run, ``self.claim`` is the held :class:`fenced.Claim` instead.
    claim_template: Any = None
    claim_ttl: float | None = None
    claim_refresh_every: float | None = None
    claim_on_conflict: str | None = None
    claim_alert_after_skips: int | None = None
    claim_on_skips_exceeded: Callable[..., Any] | None = None
    claim_interrupt: bool | None = None
    claim_namespace: str | None = None
    claim_unavailable_backoff: float | None = None
    claim_unavailable_retries: int | None = None

    _fenced_spec: _Spec | None = None
    _fenced_config: _Config | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ns = cls.__dict__
        where = f"task {ns.get('name') or cls.__module__ + '.' + cls.__qualname__}"
        given = {k: ns[k] for k in _OPTIONS if k in ns}
        if "claim_ttl" not in given:
            given["claim_ttl"] = getattr(cls, "claim_ttl", None)  # to check refresh_every
        _validate(given, where)
        # Functions given as options must not become methods of the task.
        if "claim" in ns and not isinstance(ns["claim"], property):
            # The decorator's claim= option arrives as a class attribute; inside a run
            # self.claim is the held Claim, so the option moves to claim_template.
            source = ns["claim"]
            delattr(cls, "claim")
            cls.claim_template = staticmethod(source) if inspect.isfunction(source) else source
        callback = ns.get("claim_on_skips_exceeded")
        if inspect.isfunction(callback):
            cls.claim_on_skips_exceeded = staticmethod(callback)
        if "run" in ns or "claim_template" in ns:
            run = _raw_run(cls)
            if run is not None:  # a concrete task, not an abstract base
                source = cls.claim_template
                if source is None:
                    raise ConfigError(
                        f"{where} uses ClaimedTask but has no claim: name the resource two "
                        "runs would collide on, e.g. claim='rebuild:{tenant}:{layer}'"
                    )
                cls._fenced_spec = _make_spec(source, run, where)

    @classmethod
    def bind(cls, app: Celery) -> Celery:
        """Bind to an app: options the task does not give come from its settings."""
        bound = super().bind(app)
        if cls._fenced_spec is None:
            return bound  # an abstract base: its tasks resolve their own options
        conf = app.conf
        for option in _OPTIONS:
            if getattr(cls, option) is None:
                value = conf.get(_SETTINGS[option])
                if value is None:
                    value = DEFAULTS[option]
                if value is not None:
                    setattr(
                        cls, option, staticmethod(value) if inspect.isfunction(value) else value
                    )
        # As Celery does for its own options; settings checked here fail when the task
        # is built (at the latest when a worker starts), not at its first run.
        _validate({k: getattr(cls, k) for k in _OPTIONS}, f"task {cls.name}")
        return bound

    # -- the claim of the current run --------------------------------------------------

    @property
    def claim(self) -> Claim:
        """The claim this run holds; outside a run, the claim option (for introspection)."""
        for entry in reversed(_stack()):
            if entry[0] is self:
                held: Claim = entry[1]
                return held
        # Tools such as fenced's doctor read the option the task was given.
        return cast(Claim, self.claim_template)

    def claim_name_for(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The claim name one call with these arguments takes."""
        return self._name(args, kwargs)[0]

    def _name(
        self, args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[str, dict[str, Any] | None]:
        """The claim name, and the template values as run records show them."""
        spec = self._spec()
        if spec.func is not None:
            return validate_name(spec.func(tuple(args), dict(kwargs))), None
        assert spec.template is not None
        # Rendered as in the name: short safe values as they are, others as digests.
        rendered = {k: _render(v) for k, v in spec.values(self.name, args, kwargs).items()}
        return validate_name(spec.template.format(**rendered)), rendered

    def _spec(self) -> _Spec:
        spec = type(self)._fenced_spec
        if spec is None:
            raise ConfigError(
                f"task {self.name} uses ClaimedTask but has no claim: name the resource two "
                "runs would collide on, e.g. claim='rebuild:{tenant}:{layer}'"
            )
        return spec

    def _config(self) -> _Config:
        cfg = self._fenced_config
        if cfg is not None:
            return cfg
        conf = self.app.conf
        raw: dict[str, Any] = {}
        for option in _OPTIONS:
            value = getattr(self, option)
            if value is None:
                value = conf.get(_SETTINGS[option])
            raw[option] = DEFAULTS[option] if value is None else value
        checked = _validate(raw, f"task {self.name}")
        merged = {**raw, **checked}
        cfg = _Config(
            client=lock_redis(self.app),
            ttl=merged["claim_ttl"],
            refresh_every=merged["claim_refresh_every"],
            on_conflict=merged["claim_on_conflict"],
            alert_after=merged["claim_alert_after_skips"],
            on_skips_exceeded=merged["claim_on_skips_exceeded"],
            interrupt=merged["claim_interrupt"],
            namespace=merged["claim_namespace"],
            backoff=float(merged["claim_unavailable_backoff"]),
            unavailable_retries=int(merged["claim_unavailable_retries"]),
        )
        self._fenced_config = cfg
        return cfg

    # -- a run -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cfg = self._config()
        request = self.request
        main = threading.current_thread() is threading.main_thread()
        run = _Run(main)
        name, shown = self._name(args, kwargs)
        extra: dict[str, Any] = {"task": self.name, "template": self._spec().label}
        if shown is not None:
            extra["args"] = shown
        if request.hostname:
            extra["worker"] = request.hostname
        claim = Claim(
            cfg.client,
            name,
            ttl=cfg.ttl,
            refresh_every=cfg.refresh_every,
            namespace=cfg.namespace,
            on_lost=run.on_lost if cfg.interrupt and not _green_threads() else None,
            task_id=request.id,
            records=True,
            record_extra=extra,
        )
        run.claim = claim
        try:
            acquired = claim.acquire(request_rerun=cfg.on_conflict == "rerun")
        except ClaimUnavailable as exc:
            raise self._unavailable(exc, cfg) from None
        except BaseException as exc:  # e.g. a soft time limit: never leave a lease renewed
            claim.release(outcome="failed", reason=f"interrupted while acquiring: {exc!r}")
            raise
        if not acquired:
            return self._conflict(claim, cfg)
        if request.id and (request.retries or (request.delivery_info or {}).get("redelivered")):
            try:
                self._settle_earlier_attempts(claim, cfg, request.id, args, kwargs)
            except Ignore:
                raise
            except BaseException as exc:
                self._finish(claim, "failed", repr(exc)[:500], args, kwargs)
                raise
        return self._run(run, claim, cfg, args, kwargs)

    def _settle_earlier_attempts(
        self,
        claim: Claim,
        cfg: _Config,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Before a retried or redelivered message runs, look at its task id's earlier runs.

        An earlier run that ended ``ok`` means this delivery is a duplicate: it does not
        run again (e.g. a Redis broker's visibility timeout shorter than the run handed
        the message to a second worker, which waited for the first attempt's lease). An
        earlier run with no end recorded died with its worker: it is recorded as
        ``aborted``. We hold the claim, so no attempt of this task id is running. This
        costs a round trip, on this path only.
        """
        try:
            runs = records.history(cfg.client, claim.name, limit=100, namespace=cfg.namespace)
            for run in runs:
                if run.task_id == task_id and run.outcome == "running" and run.token:
                    if run.token == claim.token:
                        continue
                    records.record(
                        cfg.client,
                        claim.name,
                        "aborted",
                        namespace=cfg.namespace,
                        token=run.token,
                        reason="its worker died mid-run (found by a later delivery)",
                        task_id=task_id,
                    )
        except (redis.RedisError, OSError):  # cannot tell: running again is safe under the claim
            log.warning("fenced: could not read the run records of %r", claim.name, exc_info=True)
            return
        if not any(run.task_id == task_id and run.outcome == "ok" for run in runs):
            return
        _count("duplicates")
        log.info(
            "fenced: %s[%s] already completed under claim %r: this delivery does not run again",
            self.name,
            task_id,
            claim.name,
        )
        self._finish(claim, "skipped", "duplicate delivery of a completed task", args, kwargs)
        # Ignore keeps the first run's stored result and fires neither failure nor retry.
        raise Ignore()

    def _run(
        self,
        run: _Run,
        claim: Claim,
        cfg: _Config,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        _count("runs")
        stack = _stack()
        stack.append((self, claim))
        if run.main and cfg.interrupt and not _install_signal_handler():
            run.main = False  # fall back to an asynchronous exception
        if run.main:
            _main_runs.append(run)  # before active: the signal handler looks here
        run.active = True
        outcome, reason = "failed", None
        try:
            try:
                if claim.lost:  # lost before it could be interrupted: do not start
                    raise ClaimInterrupted()
                result = super().__call__(*args, **kwargs)
            finally:
                run.deactivate()
            if claim.lost:
                # The body finished, but not under the claim: its writes were not protected.
                raise ClaimLost(
                    f"claim {claim.name!r} was lost while the task ran ({claim.lost_reason})",
                    name=claim.name,
                    token=claim.token,
                    fence=claim.fence,
                )
            outcome = "ok"
            return result
        except ClaimInterrupted:
            outcome, reason = "lost", claim.lost_reason or "interrupted"
            raise ClaimLost(
                f"claim {claim.name!r} was lost while the task ran ({reason}); the task was "
                "interrupted: another holder may be working on the same resource",
                name=claim.name,
                token=claim.token,
                fence=claim.fence,
            ) from None
        except SoftTimeLimitExceeded:
            if claim.lost:
                outcome, reason = "lost", claim.lost_reason
            else:
                reason = "soft time limit exceeded"
            raise
        except Retry as exc:
            reason = f"retry requested: {exc}"
            raise
        except BaseException as exc:
            if claim.lost:
                outcome, reason = "lost", claim.lost_reason
            else:
                reason = repr(exc)[:500]
            raise
        finally:
            run.active = False
            if run.main:
                _main_runs.remove(run)
            stack.pop()
            _count(outcome)
            self._finish(claim, outcome, reason, args, kwargs)

    def _finish(
        self,
        claim: Claim,
        outcome: str,
        reason: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        try:
            released = claim.release(outcome=outcome, reason=reason)
        except Exception:  # never hide the run's own outcome behind a release error
            log.exception("fenced: releasing claim %r failed", claim.name)
            return
        if released and claim.rerun_requested > 0:
            self._send_rerun(claim, args, kwargs)

    def _send_rerun(self, claim: Claim, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        options: dict[str, Any] = {}
        info = self.request.delivery_info or {}
        exchange, routing_key = info.get("exchange"), info.get("routing_key")
        if exchange == "" and routing_key:
            options["queue"] = routing_key
        elif routing_key:
            options.update(exchange=exchange, routing_key=routing_key)
        if info.get("priority") is not None:
            options["priority"] = info["priority"]
        try:
            sent = self.apply_async(args, kwargs, **options)
        except Exception:
            log.exception(
                "fenced: could not send the rerun of %s that %d trigger(s) asked for; "
                "the request stays for the next run of %r",
                self.name,
                claim.rerun_requested,
                claim.name,
            )
            try:  # hand the request back, so the next holder runs once more
                claim.redis.incrby(claim.keys.rerun, claim.rerun_requested)
            except Exception:
                pass
            return
        _count("reruns")
        log.info(
            "fenced: %s ran while %d trigger(s) asked for another run of %r: sent %s",
            self.name,
            claim.rerun_requested,
            claim.name,
            sent.id,
        )

    # -- when the claim is not ours -----------------------------------------------------

    def _conflict(self, claim: Claim, cfg: _Config) -> Any:
        holder = claim.holder
        left = (holder.expires_in if holder else None) or 0.0
        task_id = self.request.id
        held = ClaimHeld(
            f"claim {claim.name!r} is held by {holder}",
            name=claim.name,
            token=None,
            fence=holder.fence if holder else None,
            expires_in=left,
        )
        if holder is not None and task_id and holder.task_id == task_id:
            # An earlier attempt of this very task died holding the claim and its
            # message came back: not a duplicate. Run once that lease has ended.
            _count("redelivery_retries")
            log.info(
                "fenced: %s[%s] was redelivered while an earlier attempt's lease on %r "
                "runs (%.1fs left): retrying after it",
                self.name,
                task_id,
                claim.name,
                left,
            )
            raise self.retry(
                countdown=left + RETRY_MARGIN, max_retries=REDELIVERY_MAX_RETRIES, exc=held
            )
        self._after_skip(claim, cfg)
        if cfg.on_conflict == "retry":
            _count("conflict_retries")
            raise self.retry(countdown=left + RETRY_MARGIN, exc=held)
        if cfg.on_conflict == "raise":
            raise held
        _count("skipped")
        reason = "already running"
        if cfg.on_conflict == "rerun":
            reason = "already running; rerun requested"
        log.info("fenced: %s skipped: %r %s (held by %s)", self.name, claim.name, reason, holder)
        return {
            "status": "skipped",
            "reason": reason,
            "claim": claim.name,
            "holder": holder.as_dict() if holder else None,
            "expires_in": left,
            "skips": claim.skips,
        }

    def _after_skip(self, claim: Claim, cfg: _Config) -> None:
        """Alert when the consecutive skips reach the threshold, and at each multiple."""
        skips, every = claim.skips, cfg.alert_after
        if not every or skips < every or skips % every:
            return
        _count("skips_exceeded")
        log.warning(
            "fenced: claim %r was skipped %d times in a row; held by %s. A run this long, "
            "or a stale claim? `fenced` can show its run records",
            claim.name,
            skips,
            claim.holder,
        )
        signals.claim_skips_exceeded.send(
            sender=self, name=claim.name, skips=skips, holder=claim.holder
        )
        callback = cfg.on_skips_exceeded
        if callback is not None:
            try:
                callback(sender=self, name=claim.name, skips=skips, holder=claim.holder)
            except Exception:
                log.exception("fenced: claim_on_skips_exceeded callback failed")

    def _unavailable(self, exc: ClaimUnavailable, cfg: _Config) -> NoReturn:
        _count("unavailable")
        retries = self.request.retries or 0
        delay = min(UNAVAILABLE_MAX_DELAY, cfg.backoff * (2**retries))
        delay *= random.uniform(0.8, 1.2)  # spread the herd of tasks waiting for Redis
        log.warning("fenced: %s; retrying %s in %.1fs", exc, self.name, delay)
        raise self.retry(exc=exc, countdown=delay, max_retries=cfg.unavailable_retries)

    # -- a killed pool child ------------------------------------------------------------

    def release_dead_holder(
        self, task_id: str, pid: int, args: Sequence[Any], kwargs: Mapping[str, Any], why: str
    ) -> Holder | None:
        """Release the claim that process ``pid`` held for ``task_id`` (it is dead)."""
        cfg = self._config()
        name = self.claim_name_for(args, kwargs)
        holder = force_release(
            cfg.client,
            name,
            cfg.namespace,
            task_id=task_id,
            pid=pid,
            host=_HOST,
            outcome="aborted",
            reason=why,
            task=self.name,
        )
        if holder is not None:
            _count("aborted")
            log.warning("fenced: released claim %r of %s[%s]: %s", name, self.name, task_id, why)
        return holder


def _raw_run(cls: type) -> Any:
    """The task's ``run`` as defined (function or staticmethod), None if abstract."""
    for klass in cls.__mro__:
        if "run" in klass.__dict__:
            run = klass.__dict__["run"]
            return None if klass is Task or run is Task.__dict__.get("run") else run
    return None


class ClaimedRequest(Request):
    """Worker-side request: when a pool child dies mid-run, release the claim it held."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        task = self.task
        # Release before the message is requeued below, so the redelivery finds the
        # claim free. Only this child's lease for this task id is touched.
        if isinstance(exc, WorkerLostError) and self.worker_pid and isinstance(task, ClaimedTask):
            try:
                task.release_dead_holder(
                    self.id,
                    int(self.worker_pid),
                    self.args,
                    self.kwargs,
                    f"worker process {self.worker_pid} died mid-run: {exc}",
                )
            except Exception:
                log.exception("fenced: could not release the claim of %s[%s]", self.name, self.id)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )

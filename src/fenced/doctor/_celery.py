"""Checks of a Celery app's settings and claimed tasks against claim-safe settings."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import parse_qs, urlsplit

from .._client import redact
from ._finding import Finding, Severity, listed

__all__ = ["DEFAULT_VISIBILITY_TIMEOUT", "check_celery", "lock_store_url"]

#: The Redis transport's visibility timeout when ``broker_transport_options`` sets none.
DEFAULT_VISIBILITY_TIMEOUT = 3600.0

_REDIS_SCHEMES = {"redis", "rediss", "redis+socket", "socket", "sentinel", "unix"}


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _first_url(value: Any) -> str | None:
    """The first URL of a broker setting (a list or a ';'-separated failover string)."""
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    if not value:
        return None
    return str(value).split(";")[0].strip() or None


def _is_redis(url: str | None) -> bool:
    return bool(url) and urlsplit(str(url)).scheme.lower() in _REDIS_SCHEMES


def _same_database(a: str | None, b: str | None) -> bool:
    """True when two Redis URLs name the same database on the same server."""
    return _is_redis(a) and _is_redis(b) and _database(str(a)) == _database(str(b))


def _database(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    db_text = (query.get("db") or query.get("virtual_host") or [""])[0]
    if parts.scheme in ("unix", "socket", "redis+socket"):
        where = parts.path
    else:
        host = (parts.hostname or "localhost").lower()
        if host in ("localhost", "::1"):
            host = "127.0.0.1"
        where = f"{host}:{parts.port or 6379}"
        db_text = db_text or parts.path.strip("/")
    return where, int(db_text) if db_text.isdigit() else 0


def lock_store_url(app: Any) -> str | None:
    """The URL of the Redis that a Celery app's claims use, or None when none is set.

    Resolved as :func:`fenced.celery.lock_redis` resolves it: the ``fenced_redis_url``
    setting, then the ``FENCED_REDIS_URL`` environment variable; never the broker.
    """
    url = app.conf.get("fenced_redis_url") or os.environ.get("FENCED_REDIS_URL")
    return str(url) if url else None


def _claim_option(task: Any, option: str) -> float:
    """A claim option as the task finds it at run time: its own, the app's, the default."""
    from ..celery import DEFAULTS  # only with an app: the doctor runs without Celery too

    for value in (getattr(task, option, None), task.app.conf.get(f"fenced_{option}")):
        if value is not None:
            return float(value)
    return float(DEFAULTS[option])


def _claim_ttl(task: Any, claim_ttls: Mapping[str, float]) -> float:
    """The lease a task's claims get: ``claim_ttls`` overrides what the task would find."""
    if task.name in claim_ttls:
        return float(claim_ttls[task.name])
    return _claim_option(task, "claim_ttl")


def _hard_limit(task: Any, conf: Any) -> float | None:
    limit = getattr(task, "time_limit", None) or conf.get("task_time_limit")
    return float(limit) if limit else None


def _asks_rerun(task: Any) -> bool:
    policy = getattr(task, "claim_on_busy", None)
    return policy == "rerun" or bool(getattr(policy, "asks_rerun", False))


def _names(tasks: Iterable[Any]) -> str:
    return ", ".join(t.name for t in tasks)


def _about(
    tasks: list[Any], severity: Severity, code: str, what: str, why: str, fix: str
) -> list[Finding]:
    """A finding about ``tasks``, their names after ``what``; none without tasks."""
    names = _names(tasks)
    return [Finding(severity, code, what + names, why, fix, subject=names)] if tasks else []


def _registered(app: Any) -> tuple[Mapping[str, Any], list[Finding]]:
    """The app's tasks, and an error for each task whose definition fenced refuses (a
    claim template naming a missing argument, an unknown ``claim_*`` option...): the
    workers would refuse to start with the same error."""
    from .._errors import ConfigError

    refused: dict[str, Finding] = {}  # a shared task is built twice: said once

    def refuse(exc: ConfigError) -> None:
        refused[exc.message] = Finding(
            "error",
            "celery.task-refused",
            f"a task's definition is refused: {exc.message}",
            "a worker importing this app stops at the same error, so none of its tasks run",
            "correct the task's claim options as the message says",
        )

    try:
        return app.tasks, []  # the app builds its pending tasks here
    except ConfigError as exc:
        refuse(exc)
    # Celery counts the app finalized before it builds its pending tasks: build the
    # rest one by one, then bind them as finalize() would have.
    from celery.local import maybe_evaluate

    pending = getattr(app, "_pending", ())
    while pending:
        try:
            maybe_evaluate(pending.popleft())
        except ConfigError as exc:
            refuse(exc)
    for task in app._tasks.values():
        try:
            task.bind(app)  # where the options are resolved with the app's settings
        except ConfigError as exc:
            refuse(exc)
    return app._tasks, list(refused.values())


@listed
def check_celery(
    app: Any,
    claim_ttls: Mapping[str, float] | None = None,
    *,
    longest_eta: float | None = None,
) -> Iterator[Finding]:
    """Check a Celery app's settings and registered tasks against claim-safe settings.

    A task is *claimed* when it is a :class:`fenced.celery.ClaimedTask` with a
    ``claim_template`` (the ``claim=`` option); its lease is ``claim_ttls[name]``, else
    its ``claim_ttl``, else the app's ``fenced_claim_ttl``, else the ClaimedTask default.
    ``longest_eta`` is the longest ETA/countdown the application uses, when known;
    time limits and ETAs passed per call to ``apply_async`` cannot be seen here.
    """
    from ..celery import ClaimedTask

    conf = app.conf
    ttls = dict(claim_ttls or {})
    registered, refused = _registered(app)
    yield from refused
    tasks = [t for name, t in sorted(registered.items()) if not name.startswith("celery.")]
    # A ClaimedTask with a claim template (or callable) takes a claim.
    claimed = [t for t in tasks if getattr(t, "claim_template", None) is not None]
    late = [t for t in claimed if getattr(t, "acks_late", False)]
    broker = _first_url(conf.broker_url)

    if claimed:
        yield Finding(
            "info",
            "celery.claimed-tasks",
            f"{len(claimed)} of the {len(tasks)} registered tasks take a claim: {_names(claimed)}",
            "These are the tasks whose settings were checked against their claims.",
            "A claimed task missing here is not registered when the app is imported: "
            "list its module in `imports`/`include`, or call `app.autodiscover_tasks()`.",
            subject=_names(claimed),
        )
    else:
        yield Finding(
            "info",
            "celery.no-claimed-tasks",
            f"None of the {len(tasks)} registered tasks has a claim",
            "Task-level checks (acks_late, time limits versus claim TTL) had nothing to check.",
            "Give a task a claim, e.g. "
            '`@app.task(base=ClaimedTask, claim="rebuild:{layer}", acks_late=True)`.',
        )

    for task in tasks:
        # A claim option on a task that is not a ClaimedTask: nothing reads it (and
        # a ClaimedTask's claim is its running claim: asked for outside a run, it raises).
        if isinstance(task, ClaimedTask) or getattr(task, "claim", None) is None:
            continue
        option = repr(task.claim) if isinstance(task.claim, str) else "..."
        yield Finding(
            "error",
            "celery.claim-not-applied",
            f"Task {task.name} is given claim={option} but is not a ClaimedTask",
            "Celery keeps an option it does not know as a plain attribute: nothing "
            "takes the claim, so every run of this task proceeds unprotected, "
            "alongside any other run on the same resource.",
            f"`@app.task(base=ClaimedTask, claim={option})`, with "
            "`from fenced.celery import ClaimedTask`.",
            subject=task.name,
        )

    yield from _about(
        [t for t in claimed if not getattr(t, "acks_late", False)],
        "warning",
        "celery.acks-late",
        "acks_late is off for claimed task(s): ",
        "Without acks_late the message is acknowledged when the task starts: a "
        "worker killed mid-run (a deploy, OOM) loses the work outright. The claim "
        "it held expires, but nothing brings the run back.",
        "`task_acks_late = True` in the Celery config, or `acks_late=True` in each "
        "task's decorator; fenced treats the redelivery as a resumption, not a "
        "duplicate.",
    )

    for task in claimed:
        ttl = _claim_ttl(task, ttls)
        limit = _hard_limit(task, conf)
        if limit is not None and limit <= ttl:
            yield Finding(
                "error",
                "celery.time-limit",
                f"Task {task.name}: time_limit {_seconds(limit)} is not longer than "
                f"its claim TTL {_seconds(ttl)}",
                "Task time limits must be longer than the lock TTL: the hard limit kills "
                "the process holding the claim, which then cannot release it, so the "
                "resource stays blocked for up to the TTL. A limit within one lease "
                "means the TTL (sized to outlive a run) and the limit disagree about "
                "how long a run takes.",
                f"Raise the limit above the TTL, e.g. `@app.task(time_limit="
                f"{math.ceil(ttl * 2)})`, or shorten `claim_ttl` (the heartbeat renews the "
                "lease, so it needs only to cover a few missed renewals).",
                subject=task.name,
            )

    if _is_redis(broker):
        yield from _visibility_findings(app, tasks, claimed, ttls, longest_eta)

    multiplier = int(conf.get("worker_prefetch_multiplier") or 0)
    if late and multiplier > 1:
        yield Finding(
            "warning",
            "celery.prefetch-multiplier",
            f"worker_prefetch_multiplier is {multiplier} with acks_late claimed tasks",
            "Each worker process reserves extra messages behind a long run: they wait "
            "there unacknowledged while other workers sit idle, and on a Redis broker "
            "their visibility timeout runs down while they wait.",
            "`worker_prefetch_multiplier = 1`.",
        )

    yield from _about(
        [
            t
            for t in late
            if not getattr(t, "reject_on_worker_lost", None)
            and not getattr(t, "retry_on_worker_lost", None)
        ],
        "warning",
        "celery.reject-on-worker-lost",
        "task_reject_on_worker_lost is not set for acks_late claimed task(s): ",
        "When a pool process dies (OOM killer, SIGKILL) Celery acknowledges the "
        "message as failed by default, so acks_late does not bring the run back. "
        "With it set the message is redelivered; fenced recognises its own task id "
        "on the claim and resumes once the dead holder's lease ends.",
        "`task_reject_on_worker_lost = True` (or `reject_on_worker_lost=True` on the "
        "task; newer Celery also offers `task_retry_on_worker_lost = True`).",
    )

    if not (conf.get("fenced_secret_key") or os.environ.get("FENCED_SECRET_KEY")):
        yield from _about(
            [t for t in claimed if _asks_rerun(t)],
            "warning",
            "celery.rerun-unsigned",
            "claim_on_busy='rerun' with no secret key to sign reruns, for claimed task(s): ",
            "A skipped call leaves its arguments in the claims' Redis for the holder to "
            "run once more. Unsigned, anyone who can write that Redis can choose the "
            "arguments of a rerun (within the claim's name), and the worker sends it with "
            "its broker credentials.",
            "`fenced_secret_key` in the Celery config (or FENCED_SECRET_KEY in every "
            "worker's environment), the same in every worker: at least 16 random bytes, "
            "e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`.",
        )

    setting = "worker_cancel_long_running_tasks_on_connection_loss"
    if late and setting in conf and not conf.get(setting):
        yield Finding(
            "warning",
            "celery.cancel-on-connection-loss",
            f"{setting} is False with acks_late claimed tasks",
            "After a broker connection loss the running task can no longer acknowledge "
            "its message, which is redelivered while the task keeps running: the copy "
            "finds the claim held under its own task id, waits out the lease the "
            "original keeps renewing, then runs the whole task a second time.",
            f"`{setting} = True`.",
        )

    switched_off = _switched_off(app, claimed)
    if switched_off is not None:
        yield switched_off
    else:
        yield from _lock_store_findings(app, claimed, broker)


def _switched_off(app: Any, claimed: list[Any]) -> Finding | None:
    """A finding when the app's claims are switched off (``fenced_enabled``), else None."""
    from .._errors import ConfigError
    from ..celery._disabled import SETTING, enabled

    try:
        if enabled(app):
            return None
    except ConfigError as exc:
        return Finding(
            "error",
            "celery.fenced-enabled-invalid",
            f"The switch {SETTING} / FENCED_ENABLED cannot be read: {exc.message}",
            "Every run of a claimed task fails with this ConfigError before its work starts.",
            f"`{SETTING} = True` (or leave it unset), or `FENCED_ENABLED=1`.",
        )
    return Finding(
        "warning",
        "celery.fenced-disabled",
        f"fenced is switched off for this app ({SETTING}=False or FENCED_ENABLED=0)"
        + (f": claimed tasks {_names(claimed)} run without claims" if claimed else ""),
        "With the switch off a claimed task runs its body under a local stand-in claim: "
        "check() always passes and nothing is exclusive, so two runs on one resource "
        "overlap and write over each other. The switch exists for test suites that run "
        "tasks eagerly without Redis. (The doctor sees its own environment, not the "
        "workers'.)",
        f"Remove `{SETTING} = False` from the production settings, and `FENCED_ENABLED` "
        "from the workers' environment.",
    )


def _visibility_findings(
    app: Any,
    tasks: list[Any],
    claimed: list[Any],
    ttls: Mapping[str, float],
    longest_eta: float | None,
) -> Iterator[Finding]:
    conf = app.conf
    options = conf.get("broker_transport_options") or {}
    visibility = float(options.get("visibility_timeout", DEFAULT_VISIBILITY_TIMEOUT))
    late = [t for t in tasks if getattr(t, "acks_late", False)]
    needs: list[tuple[float, str]] = []
    for task in late:
        limit = _hard_limit(task, conf)
        if limit is not None:
            needs.append((limit, f"time_limit of {task.name}"))
    if longest_eta is not None:
        needs.append((float(longest_eta), "longest ETA/countdown"))
    for task in claimed:
        # A conflict retries (or a redelivery resumes) after the holder's lease: a
        # countdown up to the claim TTL, and retries use default_retry_delay.
        needs.append((_claim_ttl(task, ttls), f"claim TTL of {task.name} (retry countdown)"))
        delay = getattr(task, "default_retry_delay", None)
        if delay:
            needs.append((float(delay), f"default_retry_delay of {task.name}"))
    need, source = max(needs, default=(0.0, ""))
    if needs and need >= visibility:
        suggested = math.ceil(need * 1.25 / 60) * 60
        yield Finding(
            "error",
            "celery.visibility-timeout",
            f"The Redis broker's visibility_timeout ({_seconds(visibility)}) is not "
            f"longer than the {source} ({_seconds(need)})",
            "A Redis broker redelivers any message unacknowledged for longer than "
            "visibility_timeout, to another worker, while the first still runs it "
            "(acks_late) or still waits for its ETA: the same task runs twice, and "
            "the copy queues behind, or collides with, the original's claim.",
            f'`broker_transport_options = {{"visibility_timeout": {suggested}}}` '
            "(longer than the longest time limit and ETA).",
        )
    windows = {t.name: _claim_option(t, "claim_redelivery_window") for t in claimed}
    short = [t for t in claimed if windows[t.name] < visibility]
    if short:
        window = min(windows[t.name] for t in short)
        names = _names(short)
        yield Finding(
            "error",
            "celery.redelivery-window",
            f"claim_redelivery_window ({_seconds(window)}) of {names} is shorter than the "
            f"Redis broker's visibility_timeout ({_seconds(visibility)})",
            "A task id that finished ok is remembered for claim_redelivery_window, so a "
            "message delivered again is not run twice; a broker that redelivers after "
            "the window has passed gets a second run of a finished task.",
            f"`fenced_claim_redelivery_window = {math.ceil(visibility * 2)}` (or the "
            "task option claim_redelivery_window), above the visibility timeout.",
            subject=names,
        )
    yield from _about(
        [t for t in late if _hard_limit(t, conf) is None],
        "warning",
        "celery.unbounded-task",
        "acks_late task(s) without a time limit on a Redis broker: ",
        f"Nothing bounds these runs below the visibility timeout "
        f"({_seconds(visibility)}): a run that outlasts it is delivered again while "
        "it still works.",
        "Give each a `time_limit` below the visibility timeout (and above its claim "
        "TTL), or raise `visibility_timeout` above the slowest run.",
    )


def _lock_store_findings(app: Any, claimed: list[Any], broker: str | None) -> Iterator[Finding]:
    conf = app.conf
    store = lock_store_url(app)
    if store is None:
        if claimed and not conf.get("fenced_redis_client"):
            yield Finding(
                "error",
                "fenced.lock-store-missing",
                "Neither the Celery setting fenced_redis_url nor the environment variable "
                "FENCED_REDIS_URL is set: claimed tasks have no Redis for their claims",
                "fenced.celery.lock_redis(app) raises ConfigError without one of them, so "
                "every run of a claimed task fails before its work starts. The broker's "
                "Redis is never used for claims: they need a database of their own, on a "
                "Redis with maxmemory-policy noeviction. (The doctor sees its own "
                "environment, not the workers'.)",
                '`app.conf.fenced_redis_url = "redis://host:6379/1"` in the Celery config, '
                "or `FENCED_REDIS_URL=redis://host:6379/1` in every worker's environment "
                "(and in the doctor's, to check it).",
            )
        return
    for role, url in (("broker", broker), ("result backend", conf.get("result_backend"))):
        if isinstance(url, str) and _same_database(store, url):
            yield Finding(
                "warning",
                "fenced.lock-store-shared",
                f"The lock store is the same Redis database as the {role} ({redact(url)})",
                f"Locks share a database with the {role}'s keys: flushing or "
                "reconfiguring it (eviction, a cache TTL policy) removes live claims.",
                "Give claims a database of their own, e.g. "
                '`fenced_redis_url = "redis://host:6379/1"`, separate from broker and '
                "result backend.",
                subject=role,
            )

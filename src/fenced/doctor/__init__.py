"""Configuration checks: the Redis, Celery, naming and object store mistakes that quietly
break claims and fenced output.

Each check returns :class:`Finding` objects (what is wrong, why it matters, the fix);
:func:`run_doctor` gathers them into a :class:`Report`, whose exit code is 1 when any
finding is an error. For a Celery app the Redis checked is the one its claims use
(:func:`lock_store_url`), never the broker; nothing is imported from Celery until an
app is given. An object store (``store=URL``) is probed for the conditional writes an
:class:`~fenced.store.ObjectPointer` relies on (:func:`check_store`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .._public import publish as _publish
from ._celery import DEFAULT_VISIBILITY_TIMEOUT, check_celery, lock_store_url
from ._finding import Finding, Report, Severity, format_text, render
from ._naming import CONTENDED_OUTCOMES, check_naming, load_records, name_shape
from ._redis import MIN_REDIS, check_redis, version_findings
from ._store import check_store

__all__ = [
    "CONTENDED_OUTCOMES",
    "DEFAULT_VISIBILITY_TIMEOUT",
    "MIN_REDIS",
    "Finding",
    "Report",
    "Severity",
    "check_celery",
    "check_naming",
    "check_redis",
    "check_store",
    "format_text",
    "load_records",
    "lock_store_url",
    "name_shape",
    "render",
    "run_doctor",
    "version_findings",
]


# Tracebacks, help() and pickles name these as this package exports them.
_publish(__name__, globals(), __all__)


def run_doctor(
    client: Any = None,
    app: Any = None,
    records: Iterable[Mapping[str, Any]] | None = None,
    *,
    claim_ttls: Mapping[str, float] | None = None,
    longest_eta: float | None = None,
    namespace: str = "fenced",
    max_skew: float = 0.5,
    clock: Callable[[], float] = time.time,
    store: Any = None,
) -> Report:
    """Run every check that has something to look at; records default to those in Redis."""
    found: list[Finding] = []
    reachable = False
    if client is not None:
        redis_found = check_redis(client, max_skew=max_skew, clock=clock)
        reachable = "redis.unreachable" not in {f.code for f in redis_found}
        found += redis_found
    if app is not None:
        found += check_celery(app, claim_ttls, longest_eta=longest_eta)
    if records is None and reachable:
        try:
            records = load_records(client, namespace)
        except Exception as exc:
            found.append(
                Finding(
                    "info",
                    "naming.records-unavailable",
                    f"Could not read run records ({exc})",
                    "The naming checks (claim names too fine or too coarse) read the run "
                    "records in the lock Redis; they were skipped.",
                    "Let this Redis user run SCAN, LRANGE and XREVRANGE on the claim keys "
                    f"(`ACL SETUSER <user> ~{namespace}:* +scan +lrange +xrevrange`), and "
                    "pass the Redis the workers use: `--redis URL` or `fenced_redis_url`.",
                )
            )
    if records is not None:
        found += check_naming(records)
    if store is not None:
        found += check_store(store)
    return Report(found)

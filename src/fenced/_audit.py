"""The audit trail of operator acts (one ``fenced.audit`` log line per force release, and
per enqueue marker cleared by hand),
and the ``fenced_*`` fields of every other log line about a claim (:func:`claim_fields`).

The run record of a force release lives in the claim's run records, which are capped and
writable by anyone who can reach Redis, and its ``by`` is whatever the caller claims.
So every act that clears another holder's lease (``fenced release``,
:func:`fenced.force_release`, a Celery worker releasing the claim of a killed pool
child) is also logged on the ``fenced.audit`` logger at INFO, whether or not Redis
answered, and goes wherever the process's logging sends it. Each line carries these
``extra`` fields (every structured fenced log field is named ``fenced_*``):

==================== ==================================================================
fenced_action        what was done: ``"force_release"``, or ``"unqueue"`` (an enqueue
                     marker cleared: ``fenced unqueue``, :func:`fenced.celery.clear_queued`)
fenced_name          the claim name
fenced_token_prefix  the start of the cleared holder's token (never the whole token); when
                     nothing was cleared, the prefix asked for, or None; for
                     ``"unqueue"``, the task id the marker held
fenced_fence         the cleared holder's fence; None when nothing was cleared
fenced_by            who the caller says it is (``by=``, else the login name): self-declared
fenced_uid           the real uid of the acting process (``os.getuid()``)
fenced_host          the host of the acting process
fenced_pid           the pid of the acting process
fenced_reason        why, as the caller gave it
fenced_outcome       ``"released"``; ``"not_held"`` (nothing held, or not by the holder
                     named); ``"unreachable"`` (Redis did not answer); ``"error"``; for
                     ``"unqueue"``: ``"cleared"`` or ``"not_marked"``
==================== ==================================================================
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
import sys
from typing import Any

from ._printable import printable

__all__ = [
    "CLAIM_FIELDS",
    "FIELDS",
    "LOGGER",
    "claim_fields",
    "claimed_user",
    "echo_to_stderr",
    "force_released",
    "unqueued",
]

#: The audit logger's name; its lines go wherever the process's logging goes.
LOGGER = "fenced.audit"
#: The ``extra`` fields of every audit line, in the order the table above gives them.
FIELDS = (
    "fenced_action",
    "fenced_name",
    "fenced_token_prefix",
    "fenced_fence",
    "fenced_by",
    "fenced_uid",
    "fenced_host",
    "fenced_pid",
    "fenced_reason",
    "fenced_outcome",
)

#: The ``extra`` fields of every other log line fenced writes about a claim (on the
#: ``fenced``, ``fenced.heartbeat`` and ``fenced.celery`` loggers): the claim name, its
#: fence, the holder (``host:pid[:task_id]``: this process's own, or the one that made
#: it skip), the outcome; ``fenced_label`` and ``fenced_event`` where they apply.
CLAIM_FIELDS = (
    "fenced_claim",
    "fenced_fence",
    "fenced_holder",
    "fenced_outcome",
    "fenced_label",
    "fenced_event",
)

log = logging.getLogger(LOGGER)


def claim_fields(
    name: str,
    fence: int | None = None,
    holder: str | None = None,
    outcome: str | None = None,
    label: str | None = None,
    event: str | None = None,
) -> dict[str, Any]:
    """The ``extra`` of a log line about claim ``name`` (see :data:`CLAIM_FIELDS`)."""
    extra: dict[str, Any] = dict(zip(CLAIM_FIELDS, (name, fence, holder, outcome)))
    for key, value in (("fenced_label", label), ("fenced_event", event)):
        if value is not None:
            extra[key] = value
    return extra


def claimed_user() -> str:
    """The login name this process claims (LOGNAME, USER, ... or the passwd entry)."""
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry in some containers
        return str(os.getuid())


def _shown(value: Any) -> str:
    """A field as the line prints it: control characters as visible escapes, so a
    newline in a reason cannot start a forged line, nor an ESC reach a terminal."""
    return "-" if value is None else printable(value)


def _log(
    act: tuple[str, str, str],
    name: str,
    subject: str | None,
    *held: Any,
    fence: int | None,
    by: str | None,
    reason: str | None,
    outcome: str,
) -> None:
    """Log one act on ``fenced.audit`` at INFO, with the FIELDS as extra: ``act`` is the
    action, the line's words for it and for what it cleared (``subject``, then ``held``)."""
    action, what, cleared = act
    who = (by or claimed_user(), os.getuid(), socket.gethostname(), os.getpid())
    values = (action, name, subject, fence, *who, reason, outcome)
    log.info(
        f"fenced: {what} of %r: %s ({cleared}; by %s, uid %d, on %s pid %d; reason: %s)",
        name,
        outcome,
        _shown(subject or None),
        *held,
        _shown(who[0]),
        who[1],
        _shown(who[2]),
        who[3],
        _shown(reason),
        extra=dict(zip(FIELDS, values, strict=True)),
    )


def force_released(
    name: str,
    *,
    token_prefix: str | None,
    fence: int | None,
    by: str | None,
    reason: str | None,
    outcome: str,
) -> None:
    """Log one force release on ``fenced.audit`` (at INFO, with the FIELDS as extra)."""
    act = ("force_release", "force release", "holder %s, fence %s")
    shown_fence = "-" if fence is None else fence
    _log(act, name, token_prefix, shown_fence, fence=fence, by=by, reason=reason, outcome=outcome)


def unqueued(
    name: str, *, task_id: str | None, by: str | None, reason: str | None, outcome: str
) -> None:
    """Log one enqueue marker cleared by hand on ``fenced.audit`` (the FIELDS as extra;
    the marker's task id where a lease's token prefix would be)."""
    act = ("unqueue", "enqueue marker", "task %s")
    _log(act, name, task_id, fence=None, by=by, reason=reason, outcome=outcome)


def echo_to_stderr() -> None:
    """Print audit lines on stderr when nothing else handles them (the command line)."""
    if not log.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)

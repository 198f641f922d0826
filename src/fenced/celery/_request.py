"""The worker-side request: when a pool child dies mid-run (lost, or terminated by
``revoke(terminate=True)``), release the claim it held."""

from __future__ import annotations

import logging
import sys
from typing import Any

try:
    from billiard.einfo import ExceptionWithTraceback  # type: ignore[attr-defined]
    from billiard.exceptions import Terminated, WorkerLostError
    from celery.worker.request import Request
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(f"fenced.celery needs Celery: pip install 'fenced[celery]' ({exc})") from exc

from ._task import ClaimedTask

__all__ = ["ClaimedRequest"]

log = logging.getLogger("fenced.celery")


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
        # claim free. Only this child's lease for this task id is touched. Terminated
        # comes only once the child has exited: revoked (its message acknowledged, never
        # run again) or cancelled as the broker connection was lost (delivered again).
        lost = isinstance(exc, WorkerLostError)
        if (
            (lost or isinstance(exc, Terminated))
            and self.worker_pid
            and isinstance(task, ClaimedTask)
        ):
            pid = self.worker_pid
            if lost:  # as Celery decides below: only then does the message come back
                why = f"worker process {pid} died mid-run: {exc}"
                requeued = bool(task.acks_late and task.reject_on_worker_lost)
            else:
                requeued = bool(getattr(self, "_already_cancelled", False))
                why = f"worker process {pid} {'cancelled' if requeued else 'revoked'} mid-run"
            try:
                task.release_dead_holder(
                    self.id, int(pid), self.args, self.kwargs, why, requeued=requeued
                )
            except Exception:
                log.exception("fenced: could not release the claim of %s[%s]", self.name, self.id)
            _count_out(int(self.worker_pid))
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )


def _count_out(pid: int) -> None:
    """fenced.metrics in multiprocess mode: the dead child held its claims no longer (its
    own exit hook, which would say so, never ran), and a new child given its pid must not
    start with them."""
    metrics = sys.modules.get("fenced.metrics")
    if metrics is not None:
        try:
            metrics.mark_process_dead(pid)
        except Exception:
            log.exception("fenced: could not take process %d out of the claim metrics", pid)

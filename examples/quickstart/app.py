"""A Celery app with one claimed task: the README's "Use it in your project".

From the repository's root (``examples`` must be importable)::

    celery -A examples.quickstart.app worker --concurrency 2 --loglevel INFO
    python examples/quickstart/app.py      # sends the task twice: one runs, one skips
    fenced doctor --app examples.quickstart.app

Copied into a project of one's own, this one file is enough: ``celery -A app worker``,
then ``python app.py``.

The broker (and results) in database 0, the claims in database 1: a claim must never be
evicted, and a broker's database is no place for it. In production give the claims a
Redis of their own, with ``maxmemory-policy noeviction``.
"""

import os
import time

from celery import Celery

from fenced.celery import ClaimedTask

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "redis://localhost:6379/0")

app = Celery("quickstart", broker=BROKER_URL, backend=BROKER_URL)
app.conf.update(
    # The claims' own database, never the broker's.
    fenced_redis_url=os.environ.get("FENCED_REDIS_URL", "redis://localhost:6379/1"),
    # A message comes back when its worker dies mid-run; the claim makes that safe.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_cancel_long_running_tasks_on_connection_loss=True,
    # A long task does not wait in a busy process's prefetch buffer.
    worker_prefetch_multiplier=1,
    # Time limits above the claim's ttl (60 s); the broker's visibility timeout above
    # them, or it hands a running task's message to a second worker.
    task_soft_time_limit=50 * 60,
    task_time_limit=60 * 60,
    broker_transport_options={"visibility_timeout": 2 * 60 * 60},
    broker_connection_retry_on_startup=True,
)


# The name is given, so a worker that imports this module by any name (``app``,
# ``examples.quickstart.app``) and ``python app.py`` agree on it.
@app.task(name="quickstart.build_report", base=ClaimedTask, bind=True,
          claim="report:{tenant}", claim_ttl=60)  # fmt: skip
def build_report(self, tenant, seconds=30.0):
    """Stands in for real work: ten steps, the claim checked before each."""
    for _step in self.claim.steps(range(10)):
        time.sleep(seconds / 10)
    return f"report for {tenant} built under fence {self.claim.fence}"


def send_twice():
    """Send ``build_report("acme")`` twice and print the result of the one that skipped;
    the other runs for 30 s (``fenced ls`` shows its claim meanwhile)."""
    sent = [build_report.delay("acme"), build_report.delay("acme")]
    print("sent twice:", ", ".join(s.id for s in sent))
    while not any(s.ready() for s in sent):
        time.sleep(0.1)
    done = next(s for s in sent if s.ready())
    print("one of them:", done.get())


if __name__ == "__main__":
    send_twice()

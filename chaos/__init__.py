"""Fault injection for fenced: many holders of one claim, a nemesis, and a checker.

``python -m chaos`` (``make chaos``) starts a lock Redis, a second Redis for the
stores, a broker Redis and, for a few minutes, has worker processes compete for one
claim name with a short ttl. Each holder works in steps, checking its claim, and
writes under its fence to a ``RedisPointer`` (on the store Redis), a ``FilePointer``
and a fenced ``upsert`` (PostgreSQL when ``FENCED_TEST_POSTGRES_URL`` is set, SQLite
otherwise). The front ends are ``Claim`` (explicit and ``with``), ``@exclusive`` and
``ClaimedTask`` in a real ``celery worker``; a separate lane runs ``fenced run``. A
baseline lane does the same work under redis-py's ``Lock`` with fence-less writes.
A dedup lane runs fenced's Celery options (enqueue dedup, cooldown, limit, a retry,
rerun, a chord, replace with until_started and with retries, debounce) in a second
``celery worker``, fed calls all through the run, with celery-once beside it, and a
debounce sender of its own; ``--sentinel`` puts its claims on a Sentinel group, and
``--cluster`` on a Redis Cluster, and adds their failovers to the faults. A beat lane
(``--no-beat`` leaves it out) runs three ``celery beat`` processes under fenced's
scheduler on a Redis of their own (one through a proxy, one with its clock ahead),
with a worker noting every tick: an interval entry and two uneven calendars.

A nemesis pauses holders, restarts the lock Redis empty, kills its clients, makes it
sleep or pause, black-holes one worker's connection, and kills workers and runners;
in the dedup lane it kills the debounce sender mid-publish; in the beat lane it kills
and pauses the leading beat, drops a ``BEAT_DISPATCH`` reply of the proxied beat, and
hands the lead to the beat whose clock runs ahead, then moves that clock further ahead.
Every process logs what it did (JSON lines); the checker reads the logs and the final
stores and says which invariant broke, after which fault.

Modules: ``config`` (one run's settings), ``events`` (the logs), ``stores`` (the
fenced and fence-less stores), ``worker`` (the worker processes), ``celery_app`` (the
Celery lane), ``runlane`` (the ``fenced run`` lane), ``dedup_app``, ``feeder`` and
``dedup_check`` (the dedup lane, its calls and its verdict), ``debounce_sender``,
``beat_schedule``, ``beat_app``, ``beat_main`` (a clock set ahead), ``beat_lane`` and
``beat_check`` (the beat lane, its ticks and its verdict), ``nemesis`` (the faults),
``checker`` (the verdict), ``harness`` (all of it together).
"""

from __future__ import annotations

from .config import Config

__all__ = ["Config"]

"""Settings of the djangofeeds example; everything that differs per machine is an env var."""

from __future__ import annotations

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "djangofeeds-example-key-not-for-production")
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS: list[str] = []

INSTALLED_APPS = ["feeds.apps.FeedsConfig"]

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DJANGOFEEDS_DB", str(BASE_DIR / "db.sqlite3")),
        # Two workers may write at once; wait for SQLite's write lock instead of failing.
        "OPTIONS": {"timeout": 30},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

USE_TZ = True
TIME_ZONE = "UTC"

# -- Celery (read by djangofeeds/celery.py with the CELERY_ namespace) --------------
CELERY_BROKER_URL = os.environ.get("DJANGOFEEDS_BROKER_URL", "redis://localhost:6379/0")
CELERY_RESULT_BACKEND = os.environ.get("DJANGOFEEDS_RESULT_BACKEND", CELERY_BROKER_URL)
# Acknowledge on completion, so a worker killed mid-import returns the message; the
# claim and the fenced upsert make the redelivered import safe.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SOFT_TIME_LIMIT = 5 * 60
CELERY_TASK_TIME_LIMIT = 6 * 60
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": 60 * 60}
# After a lost broker connection a running import could no longer acknowledge its
# message, which would come back and wait out the claim to import the feed again:
# cancel it instead (its message is redelivered and runs once).
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True

# -- fenced (read by Celery with the same CELERY_ namespace: CELERY_FENCED_<SETTING>) --
# The claim store: its own Redis database (or instance), with maxmemory-policy
# noeviction, separate from the broker.
CELERY_FENCED_REDIS_URL = os.environ.get("FENCED_REDIS_URL", "redis://localhost:6379/1")
# Every claimed task's options default from settings the same way: the import's lease.
CELERY_FENCED_CLAIM_TTL = 60

# -- feeds --------------------------------------------------------------------------
FEEDS_FETCH_TIMEOUT = float(os.environ.get("FEEDS_FETCH_TIMEOUT", "20"))
FEEDS_USER_AGENT = "djangofeeds/1.0 (fenced example)"

"""The Celery app of djangofeeds, configured from Django settings."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djangofeeds.settings")

app = Celery("djangofeeds")
# Every CELERY_* Django setting, fenced's included: CELERY_FENCED_REDIS_URL is read as
# fenced_redis_url (the claim store, never the broker: claims belong in a Redis that
# never evicts keys), CELERY_FENCED_CLAIM_TTL as fenced_claim_ttl, and so on.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

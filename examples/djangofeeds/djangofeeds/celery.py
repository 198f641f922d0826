"""The Celery app of djangofeeds, configured from Django settings."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "djangofeeds.settings")

from django.conf import settings  # after DJANGO_SETTINGS_MODULE is set

app = Celery("djangofeeds")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The claim store comes from settings.FENCED_REDIS_URL, not from the broker setting:
# claims belong in a Redis that never evicts keys.
app.conf.fenced_redis_url = settings.FENCED_REDIS_URL
app.autodiscover_tasks()

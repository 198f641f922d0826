"""``tests.celery_app`` as an operator would configure it: the claims' Redis URL (with
its password) and the secret key given as Celery settings, not in the environment.

``FENCED_REDIS_URL`` and ``FENCED_TEST_SECRET_KEY`` carry them from the test.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# The worker finds the tests as a package (``-A tests.celery_security_app``).
app: Any = importlib.import_module("tests.celery_app").app

app.conf.fenced_redis_url = os.environ["FENCED_REDIS_URL"]
app.conf.fenced_secret_key = os.environ["FENCED_TEST_SECRET_KEY"]

__all__ = ["app"]

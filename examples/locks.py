"""The claims' Redis client, made by a function: for what a URL cannot say.

A Celery app names it (``app.conf.fenced_redis_client = "examples.locks:make"``), or the
command line and the workers read ``FENCED_REDIS_CLIENT=examples.locks:make``; any
redis-py client works, a ``RedisCluster`` too. In your project: ``myproject/locks.py``.
"""

import os

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry


def make() -> redis.Redis:
    """The claims' client (myproject/locks.py): here a retry policy and a client name."""
    url = os.environ.get("FENCED_REDIS_URL", "redis://localhost:6379/1")
    return redis.Redis.from_url(url, client_name="claims", retry=Retry(ExponentialBackoff(), 3))

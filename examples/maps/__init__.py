"""The map rebuild example: a claimed Celery task that tiles into a content store."""

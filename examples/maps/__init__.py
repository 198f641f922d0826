"""Seed 000's map rebuild: a claimed Celery task that tiles into a content store."""

"""App configuration of the feeds app."""

from __future__ import annotations

from django.apps import AppConfig


class FeedsConfig(AppConfig):
    """The feeds app."""

    name = "feeds"
    default_auto_field = "django.db.models.BigAutoField"

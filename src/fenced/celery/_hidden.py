"""What Celery shows of fenced's settings: URLs without their passwords.

``celery inspect conf`` (and Flower, which asks the same) and ``celery report`` print
an app's settings through ``celery.app.utils.filter_hidden_settings``, which masks a
setting by its name (``KEY``, ``PASS``, ``TOKEN``...) and a URL only for the broker
and result backend. ``fenced_redis_url`` matches none of those names, so its password
would be shown in clear: every ``fenced_*`` setting that holds a URL (or a list of
them) is shown as :func:`fenced._client.redact` prints it. Installed once, when
``fenced.celery`` is imported, for every app of the process.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery.app import utils as celery_utils

from .._client import redact

__all__ = ["install", "shown"]

_Filter = Callable[[dict[str, Any]], dict[str, Any]]


def shown(key: Any, value: Any) -> Any:
    """A setting's value as Celery may show it: a fenced URL redacted."""
    if not (isinstance(key, str) and key.lower().startswith("fenced_")):
        return value
    if isinstance(value, str):
        return redact(value) if "://" in value else value
    if isinstance(value, (list, tuple)):
        return type(value)(shown(key, v) for v in value)
    return value


def install() -> None:
    """Wrap Celery's filter of the settings it shows (once: a second call keeps it)."""
    current: _Filter = celery_utils.filter_hidden_settings
    if getattr(current, "fenced", False):
        return

    @functools.wraps(current)
    def filter_hidden_settings(conf: dict[str, Any]) -> dict[str, Any]:
        return {k: shown(k, v) for k, v in current(conf).items()}

    filter_hidden_settings.fenced = True  # type: ignore[attr-defined]
    # Settings.table() looks the filter up in its module at each call.
    celery_utils.filter_hidden_settings = filter_hidden_settings


install()

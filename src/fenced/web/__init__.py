"""``fenced web``: a dashboard of the claims under one namespace, and its JSON API.

Needs the ``web`` extra (Starlette and uvicorn): ``pip install 'fenced[web]'``.
"""

from __future__ import annotations

__all__ = ["create_app"]

try:
    from .app import create_app
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    if exc.name not in ("starlette", "uvicorn"):
        raise
    raise ImportError("fenced web needs its extra: pip install 'fenced[web]'") from exc

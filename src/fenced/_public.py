"""Public classes report the package that exports them, not the private module that
defines them: ``fenced.ConfigError`` rather than ``fenced._errors.ConfigError``, in
tracebacks, ``help()``, pickles and the exception type Celery's result backends keep.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["publish"]


def publish(package: str, namespace: Mapping[str, Any], names: Iterable[str]) -> None:
    """Give each class of ``names`` that a private module of ``package`` defines the
    module ``package``, where pickle and the reader find it under the same name.

    A class whose annotations name something only its own module imports keeps that
    module: :func:`typing.get_type_hints` reads them in the module a class names.
    """
    for name in names:
        cls = namespace.get(name)
        if not isinstance(cls, type) or cls.__qualname__ != name:
            continue
        private = cls.__module__
        if not private.startswith(f"{package}._"):
            continue  # defined in the package itself, or exported from another
        hints = _hints(cls)
        cls.__module__ = package
        if _hints(cls) != hints:
            cls.__module__ = private


def _hints(cls: type) -> dict[str, Any] | None:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a name only the defining module has
        return None

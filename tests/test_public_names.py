"""Public classes report the name they are imported by (``fenced.ConfigError``, not
``fenced._errors.ConfigError``): in tracebacks, in pickles and in what Celery keeps of
an exception."""

from __future__ import annotations

import importlib
import inspect
import pickle
import subprocess
import sys
import traceback
import typing
from typing import Any

import pytest

import fenced
from fenced import _errors

PACKAGES = ("fenced", "fenced.aio", "fenced.store", "fenced.doctor")
ERRORS = [getattr(fenced, name) for name in _errors.__all__]


def public_classes() -> list[tuple[str, str, type]]:
    found = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found.append((package, name, obj))
    return found


def test_every_exception_reports_the_package() -> None:
    assert ERRORS and all(issubclass(cls, Exception) for cls in ERRORS)
    for cls in ERRORS:
        assert cls.__module__ == "fenced", cls
        assert f"{cls.__module__}.{cls.__qualname__}" == f"fenced.{cls.__name__}"


@pytest.mark.parametrize(
    ("package", "name", "cls"), public_classes(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_public_classes_resolve_by_the_module_they_report(
    package: str, name: str, cls: type
) -> None:
    # What pickle (and Celery's result backends) look the class up by.
    assert getattr(sys.modules[cls.__module__], cls.__qualname__) is cls
    # A class keeps its private module only when its annotations need that module.
    hints = typing.get_type_hints(cls)
    if cls.__module__ != package:
        try:
            there = typing.get_type_hints(cls, globalns=vars(sys.modules[package]))
        except NameError:
            there = None
        assert there != hints


def test_the_plain_classes_report_the_package_too() -> None:
    import fenced.aio
    import fenced.doctor
    import fenced.store

    plain: list[type] = [fenced.Holder, fenced.Lock, fenced.Skipped, fenced.aio.Lock]
    plain += [fenced.store.ContentStore, fenced.store.RedisPointer, fenced.doctor.Finding]
    assert [cls.__module__ for cls in plain] == [
        *["fenced"] * 3,
        "fenced.aio",
        "fenced.store",
        "fenced.store",
        "fenced.doctor",
    ]
    # Imported on first use (it needs SQLAlchemy), and named alike then.
    pytest.importorskip("sqlalchemy")
    assert fenced.store.UpsertResult.__module__ == "fenced.store"


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__name__)
def test_exceptions_pickle_by_their_public_name(cls: type[fenced.FencedError]) -> None:
    err = cls("what went wrong", name="job:1", token="ab12", fence=7)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert (back.message, back.name, back.token, back.fence) == (
        "what went wrong",
        "job:1",
        "ab12",
        7,
    )
    assert str(back) == "what went wrong"
    held = pickle.loads(pickle.dumps(fenced.ClaimHeld("busy", name="n", expires_in=1.5)))
    assert held.expires_in == 1.5


def test_tracebacks_name_the_public_class() -> None:
    with pytest.raises(fenced.ConfigError) as info:
        fenced.Claim("redis://localhost:6379/abc", "x")
    lines = traceback.format_exception_only(info.type, info.value)
    assert lines[-1].startswith("fenced.ConfigError: bad Redis URL"), lines
    # An uncaught one, as the interpreter prints it.
    done = subprocess.run(
        [sys.executable, "-c", "import fenced; fenced.Claim('redis:/localhost:6379/1', 'x')"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fenced.ConfigError: bad Redis URL"), done.stderr
    assert "_errors" not in done.stderr


def test_celery_keeps_the_public_name_of_an_exception() -> None:
    celery = pytest.importorskip("celery")
    app: Any = celery.Celery("names", backend="cache+memory://", result_serializer="json")
    kept = app.backend.prepare_exception(fenced.ConfigError("bad ttl", name="n"))
    assert (kept["exc_module"], kept["exc_type"]) == ("fenced", "ConfigError")
    back = app.backend.exception_to_python(kept)
    assert type(back) is fenced.ConfigError and str(back) == "bad ttl"

"""Claim names and Redis keys: templates, hashing of unsafe values, namespace, hash tags.

A claim is named for the *resource* two runs would collide on. Names come from
templates over chosen arguments, ``"rebuild:{tenant}:{layer}"``. Each value is
rendered canonically: short safe values appear as they are; long or unsafe ones are
replaced by a versioned digest (``h1-`` + 20 bytes of BLAKE2b, hex), so distinct
values always give distinct names and no value can smuggle a separator or a brace.

Every key of one claim shares one Redis Cluster hash tag, ``{name}``, so the
multi-key scripts run in one slot.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigError

__all__ = ["ClaimKeys", "claim_name", "hash_value", "template_fields", "validate_name"]

#: Version tag of the digest scheme; a new scheme gets a new prefix, never reuses one.
HASH_PREFIX = "h1-"
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.\-/@]{1,64}")
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.\-/@:=+]{1,200}")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_formatter = string.Formatter()


def hash_value(value: str | bytes) -> str:
    """Stable, versioned digest of a value: ``h1-`` + 40 hex characters."""
    data = value.encode() if isinstance(value, str) else value
    return HASH_PREFIX + hashlib.blake2b(data, digest_size=20).hexdigest()


def _render(value: Any) -> str:
    """Canonical text of one template value; hashed when long or unsafe."""
    if isinstance(value, bool) or value is None:
        text = repr(value)
    elif isinstance(value, (int, float, str)):
        text = str(value)
    elif isinstance(value, bytes):
        return hash_value(b"bytes:" + value)
    else:
        text = f"{type(value).__qualname__}:{value!r}"
        return hash_value(text)
    # A value that already looks like a digest is hashed too, so "h1-..." typed by a
    # user can never collide with the digest of some other value.
    if _SAFE_VALUE.fullmatch(text) and not text.startswith(HASH_PREFIX):
        return text
    return hash_value(text)


def template_fields(template: str) -> list[str]:
    """The plain field names of a claim template; rejects attribute/index access."""
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(
            "claim template is empty: name the resource two runs collide on, "
            "e.g. 'rebuild:{tenant}:{layer}'"
        )
    fields: list[str] = []
    try:
        parsed = list(_formatter.parse(template))
    except ValueError as exc:
        raise ConfigError(
            f"claim template {template!r} is not a valid format string ({exc}); "
            "write '{{' and '}}' for literal braces"
        ) from exc
    for _literal, field, spec, conversion in parsed:
        if field is None:
            continue
        if not _FIELD.fullmatch(field):
            raise ConfigError(
                f"claim template {template!r} uses field {{{field}}}: only plain argument "
                "names are allowed (no attribute or index access, no positional {}); "
                "compute the value in a callable claim name instead"
            )
        if spec or conversion:
            raise ConfigError(
                f"claim template {template!r} gives field {{{field}}} a format spec or "
                "conversion; remove it (values are rendered canonically)"
            )
        if field not in fields:
            fields.append(field)
    return fields


def claim_name(template: str, /, **values: Any) -> str:
    """Render a claim name from a template, hashing long or unsafe values."""
    fields = template_fields(template)
    missing = [f for f in fields if f not in values]
    if missing:
        raise ConfigError(
            f"claim template {template!r} needs {', '.join(missing)}: pass "
            + ", ".join(f"{m}=..." for m in missing)
        )
    rendered = {f: _render(values[f]) for f in fields}
    return validate_name(template.format(**rendered))


def validate_name(name: str) -> str:
    """Check a claim name; return it unchanged, or hashed if it carries unsafe characters."""
    if not isinstance(name, str) or not name:
        raise ConfigError("claim name is empty: name the resource, e.g. 'rebuild:incidents'")
    if _SAFE_NAME.fullmatch(name):
        return name
    # Braces would break the hash tag, spaces and control characters break tooling;
    # keep a readable head and make the whole name unambiguous with a digest.
    head = re.sub(r"[^A-Za-z0-9_.\-/@:=+]", "_", name)[:40]
    return f"{head}~{hash_value(name)}"


def check_fields(template: str, available: Iterable[str], where: str) -> list[str]:
    """Fail at definition time when a template names a field ``where`` does not have."""
    fields = template_fields(template)
    have = set(available)
    missing = [f for f in fields if f not in have]
    if missing:
        raise ConfigError(
            f"claim template {template!r} names {', '.join(missing)}, but {where} has no "
            f"argument of that name (it has: {', '.join(sorted(have)) or 'none'}); "
            "rename the field or add the argument"
        )
    return fields


@dataclass(frozen=True)
class ClaimKeys:
    """The Redis keys of one claim, all under one namespace and one hash tag."""

    namespace: str
    name: str

    @classmethod
    def of(cls, name: str, namespace: str = "fenced") -> ClaimKeys:
        """Keys for a validated name under a namespace."""
        if not namespace or "{" in namespace or "}" in namespace:
            raise ConfigError(
                f"namespace {namespace!r} is invalid: use a non-empty prefix without braces"
            )
        return cls(namespace, validate_name(name))

    def _key(self, part: str) -> str:
        return f"{self.namespace}:{{{self.name}}}:{part}"

    @property
    def lock(self) -> str:
        """The lease itself: value = owner token, PX = ttl."""
        return self._key("lock")

    @property
    def fence(self) -> str:
        """The fence counter; never expires, never decreases."""
        return self._key("fence")

    @property
    def runs(self) -> str:
        """The run-record stream, newest last, capped."""
        return self._key("runs")

    @property
    def skips(self) -> str:
        """Consecutive skips since the last successful run."""
        return self._key("skips")

    @property
    def rerun(self) -> str:
        """Set when a conflicting trigger asked for one more run."""
        return self._key("rerun")

    def all(self) -> list[str]:
        """The keys every claim script receives, in KEYS order."""
        return [self.lock, self.fence, self.runs, self.skips, self.rerun]

    @staticmethod
    def name_from_key(key: str | bytes, namespace: str = "fenced") -> str | None:
        """Recover the claim name from any of its keys (used by ``fenced ls``)."""
        text = key.decode() if isinstance(key, bytes) else key
        prefix = namespace + ":{"
        if not text.startswith(prefix):
            return None
        end = text.rfind("}:")
        if end < len(prefix):
            return None
        return text[len(prefix) : end]

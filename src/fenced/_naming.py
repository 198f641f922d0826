"""Claim names: a template or a callable, and one call's arguments, give one name.

A claim is named for the *resource* two runs would collide on. Names come from
templates over chosen arguments, ``"rebuild:{tenant}:{layer}"``, or from a callable.
Each template value is rendered canonically: short safe values (letters, digits and
``_ . - / @``) appear as they are; long or unsafe ones are replaced by a versioned digest
(``h1-`` + 20 bytes of BLAKE2b, hex), so distinct values always render distinct and no
value can smuggle a ``:`` or a brace.

Names render one-to-one: two calls with different values never get one name. Where the
text between every two fields holds a character no rendered value holds (``:`` in
``"rebuild:{tenant}:{layer}"``), values are written as they are. Where the text between
two fields is only value characters (``-`` in ``"export:{org}-{repo}"``), the template
escapes those separators in its values, ``-`` as ``=2d`` (``+2d`` where ``=`` is the only
separator between two fields); values without them are written as they are. A template
with nothing between two fields, or only letters and digits, is refused where it is
defined.

A field marked secret, ``"sync:{account}:{api_key:secret}"``, is never shown: its value
becomes a keyed digest (``k1-`` + 20 bytes of BLAKE2b keyed with the secret key, hex),
and run records keep only that digest. The key comes from ``secret_key=``, else the
``FENCED_SECRET_KEY`` environment variable (Celery tasks: the ``fenced_secret_key``
setting first). The unkeyed ``h1-`` digest is not a way to hide a value: anyone can hash
guesses and compare.

A name is a fixed point: checking a name that was already checked returns it
unchanged, so the name a ``Claim`` reports addresses the same keys wherever it is
passed back (``read_holder``, ``fenced release``, run records, pointers).
"""

from __future__ import annotations

import datetime
import decimal
import enum
import hashlib
import inspect
import os
import re
import string
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

from ._errors import ConfigError
from ._printable import printable

__all__ = [
    "SECRET_KEY_ENV",
    "Namer",
    "check_fields",
    "check_secret_key",
    "claim_name",
    "hash_value",
    "preview",
    "render",
    "secret_digest",
    "template_fields",
    "validate_name",
]

#: Version tag of the digest scheme; a new scheme gets a new prefix, never reuses one.
HASH_PREFIX = "h1-"
_SAFE_VALUE = re.compile(r"[A-Za-z0-9_.\-/@]{1,64}")
#: The longest name validate_name keeps as it is (a longer one is hashed).
NAME_MAX = 200
_SAFE_NAME = re.compile(rf"[A-Za-z0-9_.\-/@:=+]{{1,{NAME_MAX}}}")
# What validate_name makes of an unsafe name: a readable head, "~", and the digest.
_HASHED_NAME = re.compile(r"[A-Za-z0-9_.\-/@:=+]{0,40}~" + HASH_PREFIX + r"[0-9a-f]{40}")
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_formatter = string.Formatter()
#: Version tag of the keyed digest of a secret field's value.
KEYED_PREFIX = "k1-"
_KEYED = re.compile(re.escape(KEYED_PREFIX) + "[0-9a-f]{40}")
#: The format spec that marks a template field secret: ``{api_key:secret}``.
SECRET_SPEC = "secret"
#: Where the secret key of secret fields comes from when none is passed.
SECRET_KEY_ENV = "FENCED_SECRET_KEY"
#: The shortest secret key accepted, in bytes.
SECRET_KEY_MIN = 16
_KEY_HOW = "e.g. the output of: python -c 'import secrets; print(secrets.token_hex(32))'"
#: The characters of a rendered value: a safe value's (:data:`_SAFE_VALUE`) or a digest's.
_VALUE_CHARS = frozenset(string.ascii_letters + string.digits + "_.-/@")
#: Those of them that may separate two fields; a value's are escaped where one does.
_SEPARATORS = frozenset("_.-/@")
#: What a template escapes a separator character in its values with (``-`` as ``=2d``),
#: in order of preference: never in a rendered value, and kept in a name.
ESCAPES = ("=", "+")


def hash_value(value: str | bytes) -> str:
    """Stable, versioned digest of a value: ``h1-`` + 40 hex characters."""
    data = value.encode() if isinstance(value, str) else value
    return HASH_PREFIX + hashlib.blake2b(data, digest_size=20).hexdigest()


def check_secret_key(key: str | bytes | None = None, *, setting: str = "secret_key=") -> bytes:
    """The key of secret fields' digests: ``key``, else $FENCED_SECRET_KEY; checked.

    ``setting`` is where the caller's key comes from, as an error names it.
    """
    if key is None or key == "":
        key = os.environ.get(SECRET_KEY_ENV) or None
        if key is None:
            raise ConfigError(
                "a claim template has a secret field ({name:secret}) but no secret key is "
                f"set: set {setting} or the {SECRET_KEY_ENV} environment variable to a "
                f"random string of at least {SECRET_KEY_MIN} bytes, {_KEY_HOW}"
            )
        setting = SECRET_KEY_ENV
    if not isinstance(key, (str, bytes)):
        raise ConfigError(f"{setting} is a {type(key).__name__}: give a str or bytes key")
    data = key.encode() if isinstance(key, str) else key
    if len(data) < SECRET_KEY_MIN:
        raise ConfigError(
            f"{setting} is {len(data)} bytes long: a secret key needs at least "
            f"{SECRET_KEY_MIN} random bytes, {_KEY_HOW}"
        )
    # BLAKE2b takes keys of up to 64 bytes; a longer one is hashed down to that.
    return data if len(data) <= 64 else hashlib.blake2b(data).digest()


def secret_digest(value: Any, key: bytes, field: str | None = None) -> str:
    """Keyed, versioned digest of a secret template value: ``k1-`` + 40 hex characters."""
    text = _text(value, field)
    data = text.encode() if isinstance(text, str) else text
    return KEYED_PREFIX + hashlib.blake2b(data, digest_size=20, key=key).hexdigest()


#: What a template value may be; anything else has no text that is the same in every process.
PLAIN_VALUES = (
    "str, int, float, bool, None, bytes, an Enum member, a date, time, datetime, "
    "timedelta, UUID or Decimal, and lists, tuples and dicts of these"
)
_SCALARS = (
    str,
    int,
    float,
    bytes,
    type(None),
    datetime.date,
    datetime.time,
    datetime.timedelta,
    uuid.UUID,
    decimal.Decimal,
)


class _NotPlain(Exception):
    """A value that is not plain (its one argument)."""


def _hint(value: object) -> str:
    if isinstance(value, (set, frozenset)):
        return "pass sorted(...) of it"
    if isinstance(value, Mapping):
        return "pass dict(...) of it"
    if isinstance(value, (list, tuple)):
        return "pass list(...) or tuple(...) of it"
    return (
        "pass the plain values that name the resource (an id, a path), "
        "or name the claim with a callable"
    )


def _canonical(value: object) -> object:
    """The value with every dict's items in one order; _NotPlain when not a plain value."""
    if isinstance(value, enum.Enum):
        _canonical(value.value)  # its text shows its value
        return value
    if isinstance(value, _SCALARS):
        return value
    # Exact types only: a subclass's text is its own (a defaultdict shows its factory).
    if isinstance(value, list) and type(value) is list:
        return [_canonical(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_canonical(v) for v in value)
    if isinstance(value, dict) and type(value) is dict:
        items = [(_canonical(k), _canonical(v)) for k, v in value.items()]
        # Keys of mixed types do not compare; their type and text always do.
        items.sort(key=lambda kv: (type(kv[0]).__name__, repr(kv[0])))
        return dict(items)
    raise _NotPlain(value)


def _text(value: Any, field: str | None) -> str | bytes:
    """The canonical text of a template value: a str shown as is, or bytes to hash."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, bytes):
        return b"bytes:" + value
    try:
        canonical = _canonical(value)
    except _NotPlain as exc:
        bad = exc.args[0]
        where = f"{{{field}}}" if field else "a claim template value"
        inner = "" if bad is value else f" holding a {type(bad).__qualname__}"
        raise ConfigError(
            f"{where} is a {type(value).__qualname__}{inner}, which has no text that "
            f"stays the same from one process to the next, so it cannot name a claim; "
            f"template values may be {PLAIN_VALUES}: {_hint(bad)}"
        ) from None
    # Lists and tuples of plain values keep the digest they always had; a dict's
    # digest no longer depends on the order its items were inserted in.
    return f"{type(value).__qualname__}:{canonical!r}".encode()


def render_value(value: Any, field: str | None = None) -> str:
    """Canonical text of one template value; hashed when long or unsafe."""
    # A plain str or int inline (the common cases, on every call), the rest by _text.
    if type(value) is int:
        digits = str(value)  # digits and a sign: safe, unless too long to show
        return digits if len(digits) <= 64 else hash_value(digits)
    text = value if type(value) is str else _text(value, field)
    if isinstance(text, bytes):
        return hash_value(text)
    # A value that already looks like a digest is hashed too, so "h1-..." typed by a
    # user can never collide with the digest of some other value.
    looks_keyed = text.startswith(KEYED_PREFIX) and _KEYED.fullmatch(text)
    if _SAFE_VALUE.fullmatch(text) and not text.startswith(HASH_PREFIX) and not looks_keyed:
        return text
    return hash_value(text)


#: Longest readable form a run record keeps of a hashed value.
PREVIEW_CHARS = 40
# One long run of token characters, no spaces: an API key or a password looks like this.
_TOKEN = re.compile(r"[A-Za-z0-9+/=_\-.~]{20,}")


def _cut(text: str, limit: int = PREVIEW_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def preview(value: Any) -> str:
    """A short readable form of a value that a name shows only as a digest.

    Run records keep it beside the digest, so an operator sees what a run was about.
    It leaves out what may be secret: a URL keeps its scheme, host and path (no user,
    password, query or fragment); a string that is one long token is shown by its length
    only; bytes by their size; a mapping by its keys.
    """
    if isinstance(value, str):
        if "://" in value:
            try:
                parts = urlsplit(value)
                host = parts.hostname or ""
                port = f":{parts.port}" if parts.port else ""
            except ValueError:
                return f"<a URL, {len(value)} characters>"
            more = "?…" if parts.query or parts.fragment else ""
            return _cut(f"{parts.scheme}://{host}{port}{parts.path}{more}")
        if _TOKEN.fullmatch(value):
            return f"<a token, {len(value)} characters>"
        return _cut(value)
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, dict):
        return _cut(f"<dict of {', '.join(map(str, value))}>")
    if isinstance(value, (list, tuple)):
        return f"<{type(value).__name__} of {len(value)}>"
    return _cut(str(value))


def template_fields(template: str) -> list[str]:
    """The plain field names of a claim template; rejects attribute/index access."""
    return _parse(template)[0]


def _parse(template: str) -> tuple[list[str], list[str], str]:
    """A template's fields, its secret fields, and the template without format specs."""
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(
            "claim template is empty: name the resource two runs collide on, "
            "e.g. 'rebuild:{tenant}:{layer}'"
        )
    fields: list[str] = []
    secret: list[str] = []
    plain: list[str] = []
    try:
        parsed = list(_formatter.parse(template))
    except ValueError as exc:
        raise ConfigError(
            f"claim template {template!r} is not a valid format string ({exc}); "
            "write '{{' and '}}' for literal braces"
        ) from exc
    for literal, field, spec, conversion in parsed:
        plain.append(literal.replace("{", "{{").replace("}", "}}"))
        if field is None:
            continue
        if not _FIELD.fullmatch(field):
            raise ConfigError(
                f"claim template {template!r} uses field {{{field}}}: only plain argument "
                "names are allowed (no attribute or index access, no positional {}); "
                "compute the value in a callable claim name instead"
            )
        if conversion or (spec and spec != SECRET_SPEC):
            raise ConfigError(
                f"claim template {template!r} gives field {{{field}}} a format spec or "
                "conversion; remove it (values are rendered canonically), or write "
                f"{{{field}:{SECRET_SPEC}}} to keep a secret value out of names and records"
            )
        if (spec == SECRET_SPEC) != (field in secret) and field in fields:
            raise ConfigError(
                f"claim template {template!r} marks {{{field}}} secret in one place only: "
                f"write {{{field}:{SECRET_SPEC}}} everywhere it appears"
            )
        if field not in fields:
            fields.append(field)
            if spec == SECRET_SPEC:
                secret.append(field)
        plain.append(f"{{{field}}}")
    return fields, secret, "".join(plain)


def _escapes(template: str, plain: str) -> dict[int, str] | None:
    """How ``template`` writes its values so that its names render one-to-one.

    ``plain`` is the template without format specs. A rendered value is letters, digits
    and ``_.-/@`` (safe text, or a digest). None: values are written as they are, since
    the text between every two fields holds a character no rendered value holds.
    Otherwise a :meth:`str.translate` table escaping, in every value, the separators
    (``_.-/@``) of each text between fields made of value characters only (and the
    escape): ``-`` as ``=2d``, with ``=`` unless ``=`` is the only separator between two
    fields, then ``+``. No written value then holds any of these, and every text between
    fields holds one of them or a character no value holds: the first such character
    after a value ends it, so a name reads back into one tuple of values. A template with
    nothing, or only letters and digits, between two fields (or that needs both escapes)
    cannot be read back: a :class:`ConfigError`.
    """
    gaps: list[tuple[str, str, str]] = []  # field, text up to the next field, that field
    text, before = "", None
    for literal, field, _, _ in _formatter.parse(plain):
        text += literal
        if field is None:
            continue
        if before is not None:
            gaps.append((before, text, field))
        before, text = field, ""
    if all(not _VALUE_CHARS.issuperset(between) for _, between, _ in gaps):
        return None  # the common case: names as they always were
    for mark in ESCAPES:
        escaped: set[str] = set()
        for _, between, _ in gaps:
            if _VALUE_CHARS.issuperset(between.replace(mark, "")):
                found = _SEPARATORS.intersection(between)
                if not found:
                    break
                escaped |= found
        else:
            return {ord(c): f"{mark}{ord(c):02x}" for c in sorted(escaped)}
    first, between, then = next(
        gap
        for gap in gaps
        if _VALUE_CHARS.union(ESCAPES).issuperset(gap[1]) and not _SEPARATORS.intersection(gap[1])
    )
    what = f"only {between!r}, which a value may hold too," if between else "nothing"
    raise ConfigError(
        f"claim template {template!r} has {what} between {{{first}}} and {{{then}}}: "
        "nothing tells where one value ends and the next begins, so two calls with "
        "different values could get one name; put a separator between the fields, "
        f"e.g. ':' as in '{{{first}}}:{{{then}}}'"
    )


def claim_name(template: str, /, secret_key: str | bytes | None = None, **values: Any) -> str:
    """Render a claim name from a template, hashing long or unsafe values.

    A value's separators that the template also puts between fields are escaped (``-``
    as ``=2d`` in ``"export:{org}-{repo}"``), so distinct values give distinct names; a
    template with nothing, or only letters and digits, between two fields is refused.

    Fields marked secret (``{api_key:secret}``) become keyed digests, under
    ``secret_key`` or else the ``FENCED_SECRET_KEY`` environment variable.
    """
    fields, secret, plain = _parse(template)
    missing = [f for f in fields if f not in values]
    if missing:
        raise ConfigError(
            f"claim template {template!r} needs {', '.join(missing)}: pass "
            + ", ".join(f"{m}=..." for m in missing)
        )
    escape = _escapes(template, plain)
    key = check_secret_key(secret_key) if secret else None
    return render(plain, {f: values[f] for f in fields}, secret, key, escape=escape)[0]


def render(
    template: str,
    values: Mapping[str, Any],
    secret: Collection[str] = (),
    key: bytes | None = None,
    safe_between: bool = False,
    escape: Mapping[int, str] | None = None,
) -> tuple[str, dict[str, str]]:
    """The claim name for a template's values, and each value's rendered text.

    ``template`` has no format specs; the ``secret`` fields' values become keyed
    digests under ``key``. ``escape``: the table :func:`_escapes` made for the template,
    applied to each rendered value as the name is made (the texts returned are not
    escaped). ``safe_between``: the template's text between its fields is text
    :func:`validate_name` keeps, so a name made of it and rendered values (safe text,
    digests, escaped or not) is kept whenever it is short enough, without checking it
    again.
    """
    if secret:
        assert key is not None
        rendered = {
            f: secret_digest(v, key, f) if f in secret else render_value(v, f)
            for f, v in values.items()
        }
    else:
        rendered = {f: render_value(v, f) for f, v in values.items()}
    if escape is None:
        name = template.format(**rendered)
    else:
        name = template.format(**{f: v.translate(escape) for f, v in rendered.items()})
    if safe_between and 0 < len(name) <= NAME_MAX:
        return name, rendered  # what validate_name would return unchanged
    return validate_name(name), rendered


def validate_name(name: str) -> str:
    """Check a claim name; return it unchanged, or hashed if it carries unsafe characters."""
    if not isinstance(name, str):
        raise ConfigError(
            f"a claim name is a str, not {type(name).__name__} ({name!r}): name the resource, "
            f"e.g. 'rebuild:incidents', or build it with claim_name('job:{{id}}', id={name!r})"
        )
    if not name:
        raise ConfigError("claim name is empty: name the resource, e.g. 'rebuild:incidents'")
    if _SAFE_NAME.fullmatch(name) or _HASHED_NAME.fullmatch(name):
        return name
    # Braces would break the hash tag, spaces and control characters break tooling;
    # keep a readable head and make the whole name unambiguous with a digest.
    head = re.sub(r"[^A-Za-z0-9_.\-/@:=+]", "_", name)[:40]
    return f"{head}~{hash_value(name)}"


#: The longest label a claim may carry (``label=``, ``claim_label``, ``fenced run --label``).
LABEL_MAX = 200


def check_label(label: Any, option: str = "label") -> str:
    """Check a claim's label (a bounded name for metrics and logs); return it unchanged."""
    if not isinstance(label, str) or not label:
        raise ConfigError(
            f"{option}={label!r} must be a non-empty str naming the kind of claim, e.g. "
            "'rebuild:{tenant}' (the same for every claim of that kind: it becomes a "
            "metrics label)"
        )
    if len(label) > LABEL_MAX:
        raise ConfigError(
            f"{option} is {len(label)} characters long; at most {LABEL_MAX}: name the kind "
            "of claim, not one claim"
        )
    if not label.isprintable():
        raise ConfigError(
            f"{option}={label!r} holds characters that are not printable (control "
            "characters, line breaks): use plain text, e.g. 'rebuild:{tenant}'"
        )
    return label


def bounded_label(text: str) -> str:
    """A label fenced derives (a template, a callable's name) made fit for one: escaped,
    at most :data:`LABEL_MAX` characters."""
    return _cut(printable(text), LABEL_MAX)


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


NameSource = str | Callable[..., str]
#: How a callable name is called: with the call's own arguments (``fn(*args, **kwargs)``,
#: as ``@exclusive`` does) or with the pair (``fn(args, kwargs)``, as Celery tasks do).
CallStyle = Literal["spread", "pair"]


class Namer:
    """From a template or callable and one call's arguments to the claim name.

    Built once, when a function or task is defined: a template's fields are checked
    against the signature then, not at the first call.
    """

    _slots: tuple[tuple[str, int, Any], ...] | None = None

    def __init__(
        self,
        source: NameSource,
        signature: inspect.Signature | None,
        where: str,
        *,
        style: CallStyle = "spread",
        secret_key: str | bytes | None = None,
        key_setting: str = "secret_key=",
    ) -> None:
        self.where = where
        self.style = style
        self.signature = signature
        self.secret_key = secret_key
        self.key_setting = key_setting
        #: The fields marked secret; empty for most templates (and then no key is read).
        self.secret: tuple[str, ...] = ()
        if callable(source) and not isinstance(source, str):
            self.template: str | None = None
            self.func: Callable[..., str] | None = source
            self.fields: tuple[str, ...] = ()
            self.plain: str | None = None
            self._escape: dict[int, str] | None = None
            self.label = getattr(source, "__qualname__", None) or repr(source)
            return
        if not isinstance(source, str):
            raise ConfigError(
                f"{where}: claim name {source!r} must be a template over the arguments, "
                "e.g. 'rebuild:{tenant}:{layer}', or a callable returning the name"
            )
        try:
            fields, secret, plain = _parse(source)
            #: How values are escaped so that names render one-to-one; None for most.
            self._escape = _escapes(source, plain)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        params = list(signature.parameters.values()) if signature is not None else []
        kind = inspect.Parameter
        if signature is not None and all(p.kind is not kind.VAR_KEYWORD for p in params):
            # With **kwargs any field may arrive by keyword; a missing one fails at the call.
            named = [p.name for p in params if p.kind is not kind.VAR_POSITIONAL]
            check_fields(source, named, where)
        self.template, self.func, self.fields, self.label = source, None, tuple(fields), source
        self.plain, self.secret = plain, tuple(secret)
        # Text between the fields that validate_name keeps as it is: a name made of it and
        # of rendered values (safe text or digests) is then safe whenever it is short enough.
        between = "".join(literal for literal, *_ in _formatter.parse(plain))
        self._safe_between = not between or bool(_SAFE_NAME.fullmatch(between))
        # Where each field sits in a call (position or -1, default), for a signature with
        # no *args, **kwargs or positional-only parameters: a call that fits it is bound
        # without Signature.bind_partial (every run names its claim).
        self._positional: tuple[str, ...] = ()
        self._names: frozenset[str] = frozenset()
        either, keyword = kind.POSITIONAL_OR_KEYWORD, kind.KEYWORD_ONLY
        if signature is not None and all(p.kind in (either, keyword) for p in params):
            self._positional = tuple(p.name for p in params if p.kind is either)
            self._names = frozenset(p.name for p in params)
            where_is = {name: i for i, name in enumerate(self._positional)}
            self._slots = tuple(
                (f, where_is.get(f, -1), signature.parameters[f].default) for f in fields
            )

    def key(self, secret_key: str | bytes | None = None) -> bytes:
        """The checked key of this template's secret fields (``secret_key`` first)."""
        try:
            return check_secret_key(
                self.secret_key if secret_key is None else secret_key, setting=self.key_setting
            )
        except ConfigError as exc:
            raise ConfigError(f"{self.where}: {exc}") from None

    def __call__(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        secret_key: str | bytes | None = None,
    ) -> tuple[str, dict[str, str] | None]:
        """The claim name for one call, and the template values as the name shows them.

        ``secret_key`` is the key of secret fields for this call (else the Namer's own,
        else ``FENCED_SECRET_KEY``).
        """
        if self.func is not None:
            name = (
                self.func(*args, **kwargs)
                if self.style == "spread"
                else self.func(tuple(args), dict(kwargs))
            )
            return validate_name(name), None
        assert self.plain is not None
        if not self.secret:
            return render(
                self.plain,
                self.values(args, kwargs),
                safe_between=self._safe_between,
                escape=self._escape,
            )
        return render(
            self.plain,
            self.values(args, kwargs),
            self.secret,
            self.key(secret_key),
            escape=self._escape,
        )

    def readable(
        self, args: Sequence[Any], kwargs: Mapping[str, Any], shown: Mapping[str, str]
    ) -> dict[str, str]:
        """Beside each value ``shown`` as a digest, its :func:`preview` (for run records)."""
        hashed = [f for f, v in shown.items() if v.startswith(HASH_PREFIX)]
        if not hashed:
            return {}
        values = self.values(args, kwargs)
        return {f: preview(values[f]) for f in hashed}

    def values(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The template fields' values in one call's arguments (defaults applied)."""
        slots = self._slots
        if (
            slots is not None
            and len(args) <= len(self._positional)
            and self._names.issuperset(kwargs)
            and not (kwargs and any(n in kwargs for n in self._positional[: len(args)]))
        ):
            # The call binds: each field is its argument, its keyword, or its default.
            fast: dict[str, Any] = {}
            for field, position, default in slots:
                if 0 <= position < len(args):
                    fast[field] = args[position]
                elif field in kwargs:
                    fast[field] = kwargs[field]
                elif default is not inspect.Parameter.empty:
                    fast[field] = default
                else:
                    break  # missing: said below
            else:
                return fast
        values: dict[str, Any] = dict(kwargs)
        sig = self.signature
        if sig is not None:
            try:
                bound = sig.bind_partial(*args, **kwargs)
            except TypeError as exc:
                raise ConfigError(
                    f"{self.where} was called with arguments that do not fit its "
                    f"signature {sig} ({exc}): the claim name cannot be made"
                ) from None
            bound.apply_defaults()
            values = dict(bound.arguments)
            for p in sig.parameters.values():
                if p.kind is inspect.Parameter.VAR_KEYWORD:
                    values.update(values.pop(p.name, {}))
        missing = [f for f in self.fields if f not in values]
        if missing:
            raise ConfigError(
                f"{self.where} was called without {', '.join(missing)}: its claim template "
                f"{self.template!r} needs {', '.join(missing)}; pass "
                + ", ".join(f"{m}=..." for m in missing)
            )
        return {f: values[f] for f in self.fields}

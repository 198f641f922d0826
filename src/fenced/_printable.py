"""Data read from Redis as text that is safe to show.

Anything in Redis may have been written by someone else: names, tokens (their host
and task id) and run records reach a terminal. :func:`readable` turns any reply into
text (bytes that are not UTF-8 as ``\\x`` escapes, never an error), and
:func:`printable` escapes what a terminal would act on: control characters (C0,
DEL, C1: screen clearing, window titles, OSC 8 links), bidirectional overrides
(text that reads differently from what it is) and lone surrogates (which no
terminal encoding can write). Every human printer goes through :func:`printable`;
JSON output stays JSON (``json.dumps`` escapes these itself).
"""

from __future__ import annotations

from typing import Any

__all__ = ["printable", "readable"]

_CONTROLS = (*range(0x00, 0x20), *range(0x7F, 0xA0))
_BIDI = (*range(0x202A, 0x202F), *range(0x2066, 0x206A))
_SURROGATES = range(0xD800, 0xE000)
_ESCAPES: dict[int, str] = {
    **{c: f"\\x{c:02x}" for c in _CONTROLS},
    **{c: f"\\u{c:04x}" for c in (*_BIDI, *_SURROGATES)},
}


def readable(value: Any) -> str:
    """A Redis reply as text; bytes that are not UTF-8 come out as ``\\x`` escapes."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    return str(value)


def printable(text: Any) -> str:
    """Text with control characters, bidi overrides and lone surrogates escaped."""
    return readable(text).translate(_ESCAPES)

"""Text fenced keeps or prints about an error, with what looks secret left out.

Run records outlive the work and are read by anyone with access to Redis, so the
reason a run failed keeps the exception's type and a bounded message in which:

- every URL's password and secret query values are ``***`` (:func:`fenced._client.redact`);
- ``key=value`` and ``key: value`` pairs whose key looks secret (password, passwd, pwd,
  secret, token, api_key, apikey, auth, credential, private_key, access_key, session,
  cookie, signature) have ``***`` for a value, and so does such a key followed by a
  value with a digit in it or a long token (``password hunter2``);
- ``Bearer ...`` and ``Basic ...`` credentials are ``***``, and so is the credential of
  ``Authorization: <any scheme> ...``;
- the value after a secret-looking option of a command line is ``***``, as a shell or a
  Python argv list (``CalledProcessError``) shows it: ``--password S``,
  ``'--password', 'S'``.

It is a filter for the usual leaks, not a guarantee: a message made of nothing but a
secret is kept as it is. Work that handles secrets should not put them in exceptions.
"""

from __future__ import annotations

import re

from ._client import redact as redact_url

__all__ = ["REASON_MAX", "SHORT_MAX", "exception_text", "redact"]

#: The longest reason kept in a run record.
REASON_MAX = 500
#: The longest error text an event carries (``ClaimEvent.reason``).
SHORT_MAX = 200

# Matches start only where a word starts: a long word is then read once, not once per
# character (what a message of megabytes would otherwise cost).
_URL = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>`]+")
_KEYWORD = (
    r"(?:passw(?:or)?d|pwd|secret|token|api[_\-]?key|auth\w*|credential|"
    r"private[_\-]?key|access[_\-]?key|session|cookie|signature)"
)
# key=value, key: value, "key": "value", key='value'. Each key is read once, from where
# its word starts, and then asked whether it looks secret: a pattern with the secret
# words inside a key would backtrack through a long word once per word in it.
_KEY = re.compile(r"(?<![\w.\-])([\w.\-]+)([\"']?\s*[=:]\s*)")
# A quoted value may carry Python's prefix: {'password': b'S'} is a bytes value.
_VALUE = re.compile(r"[bBrRuU]{0,2}(?:\"[^\"]*\"|'[^']*')|[^\s,;&)}\]'\"]+")
_SECRET_KEY = re.compile(r"(?i)" + _KEYWORD)
# "password hunter2": a secret word, then a value that looks like one (a digit, or long).
_SPACED = re.compile(
    r"(?i)\b(?P<key>" + _KEYWORD + r"s?)(?P<sep>\s+)"
    r"(?P<value>(?=[^\s]*\d)[^\s,;]+|[A-Za-z0-9+/=_\-.~]{16,})"
)
_SCHEME = re.compile(r"(?i)\b(?P<key>bearer|basic)(?P<sep>\s+)(?P<value>[A-Za-z0-9._~+/=\-]+)")
# "Authorization: Token X" (any scheme): the credential after the scheme's word.
_AUTH_HEADER = re.compile(
    r"(?i)\b(?P<key>(?:proxy-)?authorization[\"']?\s*[=:]\s*[\"']?[A-Za-z][\w\-]*)"
    r"(?P<sep>\s+)(?P<value>[^\s'\",;]+)"
)
# A command line's option, as a shell or a Python argv list shows it: --password S,
# '--password', 'S'. Read once from where it starts, then asked whether it looks secret.
_FLAG = re.compile(r"(?<![\w\-])(--?[A-Za-z][\w\-]*)")
_FLAG_VALUE = re.compile(r"(?:[\"']?,\s*[bBrRuU]{0,2}[\"']|\s+)([^\s'\",;)\]]+)")


def _values(text: str, keys: re.Pattern[str], values: re.Pattern[str], group: int) -> str:
    """``text`` with the value after each secret-looking key as ``***``: ``keys`` finds
    the keys (their group 1), ``values`` the value right after one (its ``group``)."""
    out: list[str] = []
    done = 0
    for key in keys.finditer(text):
        if key.start() < done or not _SECRET_KEY.search(key.group(1)):
            continue
        value = values.match(text, key.end())
        if value is None:
            continue
        out += (text[done : value.start(group)], "***")
        done = value.end(group)
    return "".join(out) + text[done:] if out else text


def _mask(match: re.Match[str]) -> str:
    return f"{match['key']}{match['sep']}***"


def redact(text: str) -> str:
    """``text`` with URL passwords and secret-looking values as ``***``."""
    if "://" in text:
        text = _URL.sub(lambda m: redact_url(m.group(0)), text)
    # "Authorization: Bearer X": the scheme's value first, or the pair would take "Bearer".
    text = _SCHEME.sub(_mask, text)
    text = _AUTH_HEADER.sub(_mask, text)
    text = _values(text, _FLAG, _FLAG_VALUE, 1)  # --password S
    text = _values(text, _KEY, _VALUE, 0)  # password=S
    return _SPACED.sub(_mask, text)


def exception_text(exc: BaseException, limit: int = REASON_MAX) -> str:
    """How an exception is recorded: its type and its redacted message, at most ``limit``."""
    try:
        message = str(exc)
    except Exception:  # a broken __str__ must not hide the failure itself
        message = ""
    text = type(exc).__name__
    if message:
        text += f": {redact(message)}"
    return text if len(text) <= limit else text[: limit - 1] + "…"

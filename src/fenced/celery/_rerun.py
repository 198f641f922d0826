"""Rerun triggers (``claim_on_busy="rerun"``): what a skipped call leaves for the holder.

A call skipped under the rerun policy adds one trigger to its name's rerun set; the
holder takes the set as it releases and sends the task once more per distinct call.
Whoever can write the claims' Redis can write that set too, and the holder sends with
the worker's broker credentials, so it believes a trigger only as far as it can check it:

- a trigger is at most :data:`MAX_BYTES` long and nested at most :data:`MAX_DEPTH`
  deep, and the call it names must give the holder's own claim name;
- with a secret key (``fenced_secret_key``, else ``FENCED_SECRET_KEY``) each trigger
  carries an HMAC-SHA256 of the claim name and the call, under a key derived from the
  secret for this use alone (``m1:<hex>:<call>``); one without a valid MAC is dropped;
- without a key nothing can be verified: a trigger that passes the checks above is
  used, and the first one a process takes logs a warning saying so.

Equal calls still give equal triggers (the MAC is deterministic), so they coalesce.

A release keeps the triggers it takes in the name's sending set (each under a field,
``<the release's token's random part>:<SHA1>``) until their rerun is published; a
holder that dies before that leaves them to the name's next release, which publishes
them again. Each rerun's task id is derived from its field (:func:`task_id`) and its
message carries :data:`HEADER`, so a rerun published twice runs once: the second copy
finds the first's done marker and is ignored.
No I/O here: the task reads and sends.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._naming import SECRET_KEY_ENV, check_secret_key

__all__ = [
    "HEADER",
    "MAX_BYTES",
    "MAX_DEPTH",
    "OWN",
    "Refused",
    "checked",
    "decode",
    "encode",
    "rerun_key",
    "task_id",
    "why",
]

#: Longest trigger accepted, in bytes of its text; a longer call is sent as OWN.
MAX_BYTES = 1 << 20
#: Deepest nesting of lists and objects accepted in a trigger's call.
MAX_DEPTH = 64
#: The call of a trigger that names none: the holder reruns with its own arguments
#: (arguments JSON cannot carry; ``""`` is the counter fenced 0.1 left).
OWN = "*"
#: The message header of a rerun: its task id may have run already (sent twice).
HEADER = "fenced_rerun"
_SIGNED = "m1:"
_KEY_LABEL = b"fenced rerun trigger v1"
_MAC_HEX = 64
# A JSON string, or the rest of the text after an unclosed quote: it always matches,
# so removing them takes one pass (a pattern that can fail rescans from every quote).
_STRING = re.compile(r'"[^"\\]*(?:\\[\s\S]?[^"\\]*)*(?:"|\Z)')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class Refused(ValueError):
    """A trigger the holder does not act on; the message says why, in a few words."""


def rerun_key(secret: Any) -> bytes | None:
    """The MAC key of triggers, derived from the app's secret key (or the environment's);
    None when neither is set. A key too short or of the wrong type is a ConfigError."""
    if (secret is None or secret == "") and not os.environ.get(SECRET_KEY_ENV):
        return None
    base = check_secret_key(secret, setting="app.conf.fenced_secret_key")
    return hmac.new(base, _KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, name: str, call: str) -> str:
    data = name.encode("utf-8", "surrogatepass")
    # Length-prefixed: no name and call run into another pair's.
    message = len(data).to_bytes(8, "big") + data + call.encode("utf-8", "surrogatepass")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def call_text(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """A call as canonical JSON (equal calls, equal text), or OWN when JSON cannot carry
    it or it is larger than a trigger may be."""
    try:
        text = json.dumps([list(args), dict(kwargs)], sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return OWN
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES or _too_deep(text):
        return OWN
    return text


def encode(args: Sequence[Any], kwargs: Mapping[str, Any], name: str, key: bytes | None) -> str:
    """The trigger a call skipped on claim ``name`` leaves: signed when there is a key."""
    call = call_text(args, kwargs)
    return call if key is None else f"{_SIGNED}{_mac(key, name, call)}:{call}"


def decode(
    trigger: str, name: str, key: bytes | None
) -> tuple[tuple[Any, ...], dict[str, Any]] | str:
    """The call a trigger asks for on claim ``name``: (args, kwargs), or OWN.

    Raises :class:`Refused` for one too large, too deep, unreadable, or (with a key)
    without a valid MAC. Whether the call gives ``name`` is the task's to check.
    """
    if len(trigger) > MAX_BYTES + len(_SIGNED) + _MAC_HEX + 1:
        raise Refused(f"longer than {MAX_BYTES} bytes")
    if trigger.startswith(_SIGNED):
        mac, sep, call = trigger[len(_SIGNED) :].partition(":")
        if not sep or len(mac) != _MAC_HEX:
            raise Refused("a malformed signature")
        if key is not None and not hmac.compare_digest(mac, _mac(key, name, call)):
            raise Refused("a signature that does not match (another key, or another name)")
    elif key is not None:
        raise Refused("no signature, and fenced_secret_key is set")
    else:
        call = trigger
    if call in (OWN, ""):
        return OWN
    if _too_deep(call):
        raise Refused(f"nested deeper than {MAX_DEPTH}")
    try:
        args, kwargs = json.loads(call)
    except (TypeError, ValueError, RecursionError):
        raise Refused("not a call ([args, kwargs] in JSON)") from None
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise Refused("not a call ([args, kwargs] in JSON)")
    return tuple(args), kwargs


def checked(
    text: str,
    name: str,
    key: bytes | None,
    names: Callable[..., str],
    own: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call a trigger (or a burst's stored call) asks for on claim ``name``;
    ``own``: the call OWN stands for (None: refused). :class:`Refused` for one that
    :func:`decode` refuses, or whose arguments (``names(args, kwargs)``) name another claim.
    """
    call = decode(text, name, key)
    if isinstance(call, str):
        if own is None:
            raise Refused("a call fenced does not store")
        return own
    if names(*call) != name:
        raise Refused("a call that names another claim")
    return call


def why(exc: Exception) -> str:
    """What a dropped call's log line says of it: never its text (its arguments may be
    secret)."""
    return str(exc) if isinstance(exc, Refused) else type(exc).__name__


def task_id(field: str) -> str:
    """The task id of the rerun of the triggers kept under ``field`` (the smallest
    field of the release's triggers that ask for one call): the same every time it is
    published, whoever publishes it."""
    digest = hashlib.sha256(b"fenced rerun v1\0" + field.encode("utf-8", "surrogatepass"))
    return str(uuid.UUID(digest.hexdigest()[:32]))


def _too_deep(text: str) -> bool:
    """Whether JSON text nests lists and objects deeper than MAX_DEPTH (checked before
    parsing: a deep one would exhaust the recursion limit there or later)."""
    depth = 0
    for ch in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        if ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        else:
            depth -= 1
            if depth < 0:  # closes what it never opened: no JSON
                return True
    return False

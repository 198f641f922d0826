"""Rerun triggers (``claim_on_busy="rerun"``): what a skipped call leaves for the holder.

A call skipped under the rerun policy adds one trigger to its name's rerun set; the
holder takes the set as it releases and sends the task once more per distinct call.
Whoever can write the claims' Redis can write that set too, and the holder sends with
the worker's broker credentials, so it believes a trigger only as far as it can check it:

- a trigger is at most :data:`MAX_BYTES` long and nested at most :data:`MAX_DEPTH`
  deep, and the call it names must give the holder's own claim name;
- a trigger names the task that left it and its kind (a rerun, or a debounced call:
  :data:`RERUN`, :data:`DEBOUNCE`), so a call stored under a name several tasks share
  runs only as its own task (``<kind>:<length of the task name>:<task name><call>``);
- with a secret key (``fenced_secret_key``, else ``FENCED_SECRET_KEY``) each trigger
  carries an HMAC-SHA256 of the claim name, the kind, the task and the call, under a key
  derived from the secret for this use alone (``m2:<hex>:<kind>:...``); one without a
  valid MAC is dropped;
- without a key nothing can be verified: a trigger that passes the checks above is
  used (``t2:<kind>:...``), and the first one a process takes logs a warning saying so;
- what an older fenced stored (``m1:`` triggers and bare calls, which name no task) is
  dropped: it could be another task's call. Only the counter of fenced 0.1 (``""``)
  still asks for the holder's own call.

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
    "DEBOUNCE",
    "HEADER",
    "MAX_BYTES",
    "MAX_DEPTH",
    "OWN",
    "RERUN",
    "Refused",
    "checked",
    "decode",
    "encode",
    "is_own",
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
#: The kinds of stored call: a rerun trigger, a debounced burst's call.
RERUN, DEBOUNCE = "r", "d"
_SIGNED = "m2:"
_UNSIGNED = "t2:"
_OLD_SIGNED = "m1:"
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


def _mac(key: bytes, name: str, body: str) -> str:
    data = name.encode("utf-8", "surrogatepass")
    # Length-prefixed: no name and body run into another pair's (the body spells the
    # task's length before it, so no task and call do either).
    message = len(data).to_bytes(8, "big") + data + body.encode("utf-8", "surrogatepass")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _body(kind: str, task: str, call: str) -> str:
    return f"{kind}:{len(task)}:{task}{call}"


def _parse_body(body: str) -> tuple[str, str, str]:
    """(kind, task, call) of a trigger's body; Refused for one that is not."""
    kind, sep, rest = body.partition(":")
    length, sep2, rest = rest.partition(":")
    if not (sep and sep2) or kind not in (RERUN, DEBOUNCE) or not length.isdigit():
        raise Refused("not a stored call (kind, task, call)")
    n = int(length[:8])
    if len(length) > 8 or n > len(rest):
        raise Refused("not a stored call (kind, task, call)")
    return kind, rest[:n], rest[n:]


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


def encode(
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    name: str,
    key: bytes | None,
    task: str,
    kind: str = RERUN,
) -> str:
    """The trigger a call of ``task`` skipped on claim ``name`` leaves (``kind``: RERUN or
    DEBOUNCE): signed when there is a key."""
    body = _body(kind, task, call_text(args, kwargs))
    return f"{_UNSIGNED}{body}" if key is None else f"{_SIGNED}{_mac(key, name, body)}:{body}"


def is_own(trigger: str) -> bool:
    """Whether a trigger asks for its task's own call (arguments JSON cannot carry)."""
    return trigger.endswith(OWN)  # a call's JSON ends with "]"


def decode(
    trigger: str, name: str, key: bytes | None, kind: str = RERUN
) -> tuple[str, tuple[tuple[Any, ...], dict[str, Any]] | str]:
    """The task a trigger of ``kind`` names on claim ``name``, and the call it asks for:
    (task, (args, kwargs)) or (task, OWN); ("", OWN) for the counter of fenced 0.1.

    Raises :class:`Refused` for one too large, too deep, unreadable, of another kind,
    of an older fenced (it names no task), or (with a key) without a valid MAC. Whether
    the task is the caller's and the call gives ``name`` is the caller's to check.
    """
    if trigger == "":
        return "", OWN
    if len(trigger) > 2 * MAX_BYTES:
        raise Refused(f"longer than {MAX_BYTES} bytes")
    if trigger.startswith(_SIGNED):
        mac, sep, body = trigger[len(_SIGNED) :].partition(":")
        if not sep or len(mac) != _MAC_HEX:
            raise Refused("a malformed signature")
        if key is not None and not hmac.compare_digest(mac, _mac(key, name, body)):
            raise Refused("a signature that does not match (another key, or another name)")
    elif trigger.startswith((_OLD_SIGNED, "[", OWN)):
        raise Refused("stored by an older fenced, without its task")
    elif key is not None:
        raise Refused("no signature, and fenced_secret_key is set")
    elif trigger.startswith(_UNSIGNED):
        body = trigger[len(_UNSIGNED) :]
    else:
        raise Refused("not a stored call (kind, task, call)")
    found, task, call = _parse_body(body)
    if found != kind:
        raise Refused("a stored call of another kind")
    if len(call.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise Refused(f"longer than {MAX_BYTES} bytes")
    if call == OWN:
        return task, OWN
    if _too_deep(call):
        raise Refused(f"nested deeper than {MAX_DEPTH}")
    try:
        args, kwargs = json.loads(call)
    except (TypeError, ValueError, RecursionError):
        raise Refused("not a call ([args, kwargs] in JSON)") from None
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise Refused("not a call ([args, kwargs] in JSON)")
    return task, (tuple(args), kwargs)


def checked(
    text: str,
    name: str,
    key: bytes | None,
    names: Callable[..., str],
    own: tuple[tuple[Any, ...], dict[str, Any]] | None = None,
    task: str | None = None,
    kind: str = RERUN,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call a trigger (or a burst's stored call) of ``task`` asks for on claim
    ``name``; ``own``: the call OWN stands for (None: refused). :class:`Refused` for one
    that :func:`decode` refuses, that another task left (``task`` given), or whose
    arguments (``names(args, kwargs)``) name another claim.
    """
    left_by, call = decode(text, name, key, kind)
    if task is not None and left_by != task and not (left_by == "" and call == OWN):
        raise Refused("a call of another task")
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

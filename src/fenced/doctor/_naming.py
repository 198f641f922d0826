"""Naming checks from run records: claim names too fine to protect, or too coarse to share."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .._errors import ConfigError
from .._lease import ClaimKeys
from .._naming import template_fields
from .._nodes import scan_keys
from ..records import OUTCOMES, history
from ._finding import Finding, listed

__all__ = ["CONTENDED_OUTCOMES", "check_naming", "load_records", "name_shape"]

#: Run-record outcomes that mean a run found the claim held by another: ``skipped`` is
#: written whatever the caller does next (skip, retry later, ask for a rerun, raise).
#: A run that waits for the claim leaves no record of its wait, so this cannot see it.
CONTENDED_OUTCOMES = frozenset(OUTCOMES) & {"skipped"}


def _fields_of(template: str) -> list[str]:
    try:
        return template_fields(template)
    except ConfigError:
        return []


def _without(template: str, fields: Iterable[str]) -> str:
    for name in fields:
        template = re.sub(r"[:/\-_.]?\{" + re.escape(name) + r"(?::secret)?\}", "", template)
    return template


Record = Mapping[str, Any]


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _unique_share(values: list[str]) -> float:
    return len(set(values)) / len(values) if values else 0.0


@listed
def check_naming(
    records: Iterable[Record],
    *,
    min_runs: int = 20,
    unique_ratio: float = 0.9,
    min_arg_sets: int = 5,
) -> Iterator[Finding]:
    """Flag claim names too fine to protect anything, and too coarse to run in parallel.

    Each record has ``name``, ``template`` (or None), ``args`` (a dict of argument
    values, or a digest), ``outcome`` and, where known, ``source`` (the task, function
    or command). Too fine: a template with at least ``min_runs`` runs whose names are
    more than ``unique_ratio`` unique; for records without a template (``fenced run``,
    callable names), the names of one shape (:func:`name_shape`) alike. Too coarse: at
    least ``min_arg_sets`` different argument sets skipped on one name (a contended
    outcome, :data:`CONTENDED_OUTCOMES`), leaving out the template's fields and
    arguments that differ on nearly every one of ``min_runs`` or more runs (dates,
    request ids: parameters of a run, not resources).
    """
    by_template: dict[str, list[Record]] = defaultdict(list)
    by_shape: dict[str, list[Record]] = defaultdict(list)
    by_name: dict[str, list[Record]] = defaultdict(list)
    for rec in records:
        if rec.get("template"):
            by_template[str(rec["template"])].append(rec)
        elif rec.get("name"):
            # fenced run, @exclusive, a callable name: no template, but the name itself
            # shows a timestamp or a unique id in it.
            shape = name_shape(str(rec["name"]))
            if shape is not None:
                by_shape[shape].append(rec)
        if rec.get("name"):
            by_name[str(rec["name"])].append(rec)
    for template, runs in sorted(by_template.items()):
        yield from _too_fine(template, runs, min_runs, unique_ratio, shape=False)
    for shape, runs in sorted(by_shape.items()):
        yield from _too_fine(shape, runs, min_runs, unique_ratio, shape=True)
    for name, runs in sorted(by_name.items()):
        yield from _too_coarse(name, runs, min_runs, unique_ratio, min_arg_sets)


def _too_fine(
    key: str, runs: list[Record], min_runs: int, ratio: float, *, shape: bool
) -> Iterator[Finding]:
    """A finding for a template (or, with ``shape``, a name shape) whose runs all differ."""
    names = [str(r.get("name")) for r in runs]
    if len(runs) < min_runs or _unique_share(names) <= ratio:
        return
    gave = f"gave {len(set(names))} different names in {len(runs)} runs"
    if shape:
        # Every field of a shape is a timestamp or an id: they all vary.
        varying = _fields_of(key)
        sources = sorted({str(r["source"]) for r in runs if r.get("source")})
        by = f" (from {', '.join(sources[:3])}{', ...' if len(sources) > 3 else ''})"
        parts = "/".join("{" + f + "}" for f in varying)
        what = f"Claim names like {names[-1]!r}{by if sources else ''} {gave}; the "
        what += f"{parts} part of {key!r} changes on every run"
    else:
        args = [r["args"] for r in runs if isinstance(r.get("args"), Mapping)]
        varying = [
            f for f in _fields_of(key) if _unique_share([_dump(a.get(f)) for a in args]) > ratio
        ]
        what = f"Claim template {key!r} {gave}"
        if varying:
            what += "; " + ", ".join("{" + v + "}" for v in varying) + " changes on every run"
    fix = (
        "Name the claim for the resource two runs would collide on (usually the output "
        "path), without timestamps or unique ids"
    )
    better = _without(key, varying)
    if better and better != key and not (shape and _fields_of(better)):
        fix += f": e.g. {better!r}"
    why = (
        "A timestamp or unique id in the key protects nothing: every run gets a claim "
        "of its own, never contends with anything, and two runs on the same resource "
        "proceed together while it looks like locking works."
    )
    yield Finding("warning", "naming.too-fine", what, why, fix + ".", subject=key)


# A digest in a name (h1-..., a hashed value) is a value, not a time: left as it is.
_DIGEST_PART = re.compile(r"h1-[0-9a-f]{40}")
# Parts of a name that change on every run: a UUID, an ISO date (and time), a run of 8
# or more digits (a date as 20261201, epoch seconds, milli- or nanoseconds). Shorter
# numbers ("tile:12:34", "user:4711") name resources and are left alone.
_VOLATILE = re.compile(
    r"(?P<id>[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})"
    r"|(?P<date>\d{4}-\d{2}-\d{2}(?:[T_.]\d{2}[:.]?\d{2}(?:[:.]?\d{2}(?:[.,]\d+)?)?Z?)?)"
    r"|(?P<n>(?<![0-9A-Za-z])\d{8,}(?![0-9A-Za-z]))"
)


def name_shape(name: str) -> str | None:
    """A template-less name with its timestamps and unique ids as fields, else None.

    ``"nightly:1764558000123456789"`` has the shape ``"nightly:{n}"``; a name with no
    such part (``"backup:db"``) has none.
    """
    pieces: list[str] = []
    changed = False
    at = 0
    for digest in [*_DIGEST_PART.finditer(name), None]:
        end = digest.start() if digest is not None else len(name)
        part, n = _VOLATILE.subn(lambda m: "{" + str(m.lastgroup) + "}", name[at:end])
        pieces.append(part)
        changed = changed or n > 0
        if digest is not None:
            pieces.append(digest.group())
            at = digest.end()
    return "".join(pieces) if changed else None


def _too_coarse(
    name: str, runs: list[Record], min_runs: int, ratio: float, min_arg_sets: int
) -> Iterator[Finding]:
    contended = [r for r in runs if r.get("outcome") in CONTENDED_OUTCOMES]
    if len(contended) < min_arg_sets:
        return
    in_key = {f for r in runs if r.get("template") for f in _fields_of(str(r["template"]))}
    values: dict[str, list[str]] = defaultdict(list)
    for r in runs:
        args = r.get("args")
        if isinstance(args, Mapping):
            for key, value in args.items():
                values[str(key)].append(_dump(value))
    # An argument that differs on (nearly) every one of many runs, a date or a request
    # id, is a parameter of the run, not a resource that runs collide on.
    per_run = {k for k, v in values.items() if len(v) >= min_runs and _unique_share(v) > ratio}
    keep = set(values) - in_key - per_run
    sets: set[str] = set()
    for r in contended:
        args = r.get("args")
        if isinstance(args, Mapping):
            sets.add(_dump({k: v for k, v in args.items() if k in keep}))
        elif args is not None:
            sets.add(str(args))
    if len(sets) < min_arg_sets:
        return
    counts = {k: len(set(values[k])) for k in sorted(keep)}
    differing = [k for k, n in counts.items() if n > 1]
    listed = ", ".join(f"{k} ({counts[k]} values)" for k in differing)
    detail = f"; arguments that differ: {listed}" if differing else ""
    templates = [str(r["template"]) for r in runs if r.get("template")]
    base = max(sorted(set(templates)), key=templates.count) if templates else name
    better = base + "".join(":{" + k + "}" for k in differing)
    example = f": e.g. claim={better!r}" if differing else " (e.g. 'rebuild:{tenant}:{layer}')"
    fix = "Put the argument that names what a run writes in the claim template" + example
    yield Finding(
        "warning",
        "naming.too-coarse",
        f"{len(sets)} different argument sets were skipped behind the one claim {name!r}{detail}",
        "The claim name leaves out what tells the resources apart (a tenant, a "
        "layer): runs that write different outputs contend for one lock, so a "
        "pipeline meant to run in parallel runs one at a time, and skipped runs do "
        "not happen at all.",
        fix + ", so runs on different resources do not contend; leave out "
        "arguments that only parametrise a run (dates, request ids).",
        subject=name,
    )


def _escape_glob(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def load_records(
    client: Any, namespace: str = "fenced", per_claim: int = 200, max_claims: int = 1000
) -> list[dict[str, Any]]:
    """Run records of every claim in Redis, as dicts for :func:`check_naming`."""
    found: list[dict[str, Any]] = []
    names: set[str] = set()
    # The records list, and the stream an earlier version wrote instead.
    for part in ("records", "runs"):
        pattern = _escape_glob(namespace) + ":{*}:" + part
        for key in scan_keys(client, pattern, count=500):  # every primary of a cluster
            if len(names) >= max_claims:
                break
            name = ClaimKeys.name_from_key(key, namespace)
            if name is not None:
                names.add(name)
    for name in sorted(names):
        for rec in history(client, name, limit=per_claim, namespace=namespace):
            loaded: dict[str, Any] = {
                "name": name,
                "template": rec.extra.get("template"),
                "args": rec.extra.get("args"),
                "outcome": rec.outcome,
            }
            # Which front end ran it: a Celery task, an @exclusive function, a command.
            source = rec.extra.get("task") or rec.extra.get("function")
            command = rec.extra.get("command") or rec.extra.get("program")
            if not source and command:
                source = f"fenced run -- {command}"
            if source:
                loaded["source"] = str(source)[:80]
            found.append(loaded)
    return found

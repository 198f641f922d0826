"""A claim's options: each declared once, with its default, its check and its help.

:class:`ClaimOptions` is frozen and checked when it is made; every front end makes one
(``Claim(..., ttl=60)``, ``@exclusive(..., ttl=60)``, ``fenced run --ttl 60``, a
task's ``claim_ttl=60``) and every claim it builds shares it. The scripts' arguments
in milliseconds are worked out here, once.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Collection, Mapping
from dataclasses import InitVar, dataclass, field
from typing import Any, cast

from ._errors import ConfigError
from ._lease import (
    IDLE_TTL,
    MAX_RECORDS,
    check_cooldown,
    check_idle_ttl,
    check_limit,
    check_namespace,
    check_rate,
    check_replicas,
    check_timing,
    rate_window,
)
from ._naming import check_label

__all__ = ["DEFAULT", "ClaimOptions", "closest", "refuse_unknown"]


def _option(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ClaimOptions:
    """What a claim is made with. ``ClaimOptions.of(given)`` refuses unknown names."""

    ttl: float = _option(
        30.0,
        "seconds the lease lasts without renewal; a paused or dead holder loses the claim "
        "after this long",
    )
    refresh_every: float | None = _option(
        None, "seconds between renewals (default ttl/3); at most ttl/2"
    )
    namespace: str = _option("fenced", "prefix of every Redis key of the claim")
    records: bool = _option(
        False, "write run records (fenced.records) with each acquire and release"
    )
    max_records: int = _option(
        MAX_RECORDS,
        "run records kept for the name (an eighth more gather before the oldest are cut)",
    )
    idle_ttl: float | None = _option(
        IDLE_TTL,
        "seconds the name's lasting keys (fence, run records, skip count, rerun triggers) "
        "are kept after its last use (default a week; None: forever); the fence still "
        "increases after its key expired",
    )
    redelivery_window: float = _option(
        0.0,
        "seconds to remember that the run of a task id ended ok (Claim.finished_ok), so a "
        "redelivered message of it does not run again",
    )
    replicas: int = _option(
        0,
        "replicas that must acknowledge the acquire (and each renewal) within "
        "replica_timeout (Redis WAIT): an acquire they do not acknowledge removes its lease "
        "(the claim is unavailable); a renewal they do not acknowledge is not confirmed; "
        "a release or hand-over they do not acknowledge is logged",
    )
    replica_timeout: float = _option(1.0, "seconds to wait for the replicas (below ttl/2)")
    cooldown: float | None = _option(
        None,
        "seconds after a run that ended ok during which every acquire is a skip ('ran "
        "recently', whatever the busy policy), timed by Redis's own expiry; a failed or "
        "lost run, and an operator's release, start no window; no longer than the name's "
        "idle expiry",
    )
    limit: int = _option(
        1,
        "how many holders the name may have at once (1 to 64), each with a lease and a "
        "fence of its own (fences increase across every slot); busy when all are held",
    )
    rate: str | None = _option(
        None,
        "the most starts of the name per second, minute or hour, across every process "
        "and host: 'N/s', 'N/m' or 'N/h', e.g. '10/m': at most N in any window of one "
        "period (up to N at once), timed by Redis; a call over it is rate limited (as "
        "busy: skipped, waits for its start, or raises); None: no limit",
    )
    rate_spread: bool = _option(
        False,
        "spread the rate's starts evenly, one every period/N (10/m: one every 6 s, never "
        "two at once), instead of up to N at once",
    )
    label: str | None = _option(
        None,
        "the bounded name of this kind of claim in fenced.events and the fenced_label log "
        "field (printable, at most 200 characters), e.g. 'rebuild:{tenant}'; default: the "
        "claim's name",
    )
    #: How the user spells the options in errors: ``claim_`` for a Celery task, ``--``
    #: for the command line.
    prefix: InitVar[str] = ""

    # Worked out once: the renewal interval, and the scripts' milliseconds.
    refresh: float = field(init=False, repr=False, compare=False)
    ttl_ms: int = field(init=False, repr=False, compare=False)
    idle_ms: int = field(init=False, repr=False, compare=False)
    cooldown_ms: int = field(init=False, repr=False, compare=False)
    replica_ms: int = field(init=False, repr=False, compare=False)
    done_ms: int = field(init=False, repr=False, compare=False)
    rate_us: int = field(init=False, repr=False, compare=False)
    rate_per: int = field(init=False, repr=False, compare=False)
    rate_window_us: int = field(init=False, repr=False, compare=False)

    def __post_init__(self, prefix: str) -> None:
        def n(option: str) -> str:  # as the user spells it: claim_ttl, --replica-timeout
            return "--" + option.replace("_", "-") if prefix == "--" else prefix + option

        ttl, refresh = check_timing(
            self.ttl, self.refresh_every, names=(n("ttl"), n("refresh_every"))
        )
        idle_ms = check_idle_ttl(self.idle_ttl, ttl, n("idle_ttl"))
        replicas, replica_ms = check_replicas(
            self.replicas, self.replica_timeout, ttl, (n("replicas"), n("replica_timeout"))
        )
        window = self.redelivery_window
        if isinstance(window, bool) or not isinstance(window, (int, float)) or window < 0:
            raise ConfigError(
                f"{n('redelivery_window')}={window!r} must be seconds >= 0 (0 remembers "
                "nothing), e.g. 86400"
            )
        records = self.max_records
        if isinstance(records, bool) or not isinstance(records, int) or records < 1:
            raise ConfigError(f"{n('max_records')}={records!r} must be a whole number >= 1")
        derived = {
            "ttl": ttl,
            "refresh": refresh,
            "namespace": check_namespace(self.namespace),
            "records": bool(self.records),
            "limit": check_limit(self.limit, n("limit")),
            "label": None if self.label is None else check_label(self.label, n("label")),
            "ttl_ms": max(1, int(ttl * 1000)),
            "idle_ms": idle_ms,
            "cooldown_ms": check_cooldown(self.cooldown, idle_ms, n("cooldown")),
            "replicas": replicas,
            "replica_ms": replica_ms,
            "done_ms": int(window * 1000),
            "rate_us": check_rate(self.rate, n("rate")),
        }
        derived["rate_per"], derived["rate_window_us"] = rate_window(
            self.rate, self.rate_spread, (n("rate"), n("rate_spread"))
        )
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(
        cls,
        given: Mapping[str, Any],
        *,
        base: ClaimOptions | None = None,
        prefix: str = "",
        where: str = "",
    ) -> ClaimOptions:
        """``base`` (default: the defaults) with the options ``given``, checked; an
        unknown name is refused, naming the closest one."""
        if not given:
            return base or DEFAULT  # checked already: nothing to make
        if base is None and not prefix and not where:
            try:  # Claim(r, name, ttl=60) in a loop: the same options, made once
                return _made(tuple((k, type(v), v) for k, v in given.items()))
            except TypeError:  # a value that cannot be hashed: checked below, uncached
                pass
        refuse_unknown(given, NAMES, where, "option")
        values = {k: getattr(base, k) for k in NAMES} if base is not None else {}
        values.update(given)
        try:
            return cls(**values, prefix=prefix)
        except ConfigError as exc:
            if not where:
                raise
            raise ConfigError(f"{where}: {exc.message}") from None

    def replace(self, **changes: Any) -> ClaimOptions:
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def cooldown_seconds(self) -> float | None:
        """The cooldown window in seconds, None without one."""
        return self.cooldown_ms / 1000 if self.cooldown_ms else None


#: The options' names, in the order they are declared.
NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ClaimOptions) if f.init)
#: Each option's help (a CLI or an error shows it).
HELP: Mapping[str, str] = {
    f.name: f.metadata["help"] for f in dataclasses.fields(ClaimOptions) if f.init
}
DEFAULT = ClaimOptions()


@functools.lru_cache(maxsize=256)
def _made(given: tuple[tuple[str, type, Any], ...]) -> ClaimOptions:
    # Keyed by each value's type too: True == 1, but limit=True is refused.
    refuse_unknown((k for k, _, _ in given), NAMES, "", "option")
    return ClaimOptions(**{k: v for k, _, v in given})


ClaimOptions.__doc__ = "\n".join(
    [cast(str, ClaimOptions.__doc__), "", "Options:"]
    + [f"    {name}: {text}." for name, text in HELP.items()]
)


def closest(name: str, known: Collection[str]) -> str | None:
    """The known name ``name`` most likely meant, if one is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.8)
    return close[0] if close else None


def refuse_unknown(names: Any, known: Collection[str], where: str, kind: str) -> None:
    """ConfigError for the first of ``names`` not in ``known``, naming the closest one:
    an option given with a typo would otherwise be kept and do nothing."""
    for name in names:
        if name not in known:
            # fenced_ttl, claim_ttl and ttl name one option in different front ends.
            bare = name.removeprefix("fenced_").removeprefix("claim_")
            alike = [k for k in known if k.removeprefix("claim_") == bare]
            guess = alike[0] if alike else closest(name, known)
            fix = f"did you mean {guess}?" if guess else f"the {kind}s are: {', '.join(known)}"
            prefix = f"{where}: " if where else ""
            raise ConfigError(f"{prefix}unknown {kind} {name}; {fix}")

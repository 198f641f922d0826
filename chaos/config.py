"""One run's settings, and the part of them every worker process is handed."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

__all__ = [
    "BEAT_BROKEN",
    "BEAT_FAULTS",
    "BROKEN",
    "CLUSTER_FAULTS",
    "DEDUP_NAMES",
    "FAILOVER_FAULTS",
    "FAULTS",
    "LANES",
    "REPLACE_NAMES",
    "Config",
    "Shared",
]

#: Every fault the nemesis knows, in the order the report lists them.
FAULTS = (
    "pause_holder",
    "restart_lock_redis",
    "client_kill",
    "debug_sleep",
    "client_pause",
    "partition",
    "kill_worker",
    "kill_runner",
    "kill_debounce_sender",
    "failover_kill",
    "failover_pause",
    "cluster_failover_kill",
    "cluster_failover_pause",
    "beat_kill",
    "beat_pause",
    "beat_drop_reply",
    "beat_clock_ahead",
)
#: The faults of a Sentinel group (``--sentinel``): they need its master and replica.
FAILOVER_FAULTS = ("failover_kill", "failover_pause")
#: The faults of the beat lane (``--no-beat`` leaves them out).
BEAT_FAULTS = ("beat_kill", "beat_pause", "beat_drop_reply", "beat_clock_ahead")
#: The faults of a Redis Cluster (``--cluster``): they need a master with a replica.
CLUSTER_FAULTS = ("cluster_failover_kill", "cluster_failover_pause")
#: The dedup lane's fixed claim names (chaos/dedup_app.py; the chord members' vary).
DEDUP_NAMES = ("dd:started", "dd:finished", "dd:cooldown", "dd:limit", "dd:retry", "dd:rerun",
               "dd:replace_started", "dd:replace_retry", "dd:debounce")  # fmt: skip
#: The dedup lane's names under ``claim_on_busy="replace"`` (runs overlap while a
#: replaced one learns it: checked by dd-replace, not dd-limit).
REPLACE_NAMES = ("dd:replace_started", "dd:replace_retry")
#: Deliberate faults of the dedup lane (``--broken``) that its checker must catch.
BROKEN = ("limit", "cooldown", "rerun", "beat-sender", "beat-clock")
#: Those of them that break the beat lane (the others break the dedup lane).
BEAT_BROKEN = ("beat-sender", "beat-clock")
#: The lanes: fenced's front ends, and the same work under redis-py's Lock.
LANES = ("fenced", "lock")
#: The environment variable that carries :class:`Shared` to worker processes.
ENV = "CHAOS_SHARED"


@dataclass
class Config:
    """What ``python -m chaos`` was asked to do."""

    seconds: float = 300.0
    #: Worker processes in the fenced lane (front ends alternate: Claim, @exclusive).
    workers: int = 6
    #: Worker processes in the redis-py Lock lane (default: as many as ``workers``).
    baseline_workers: int | None = None
    ttl: float = 1.0
    steps: int = 4
    step_min: float = 0.1
    step_max: float = 0.3
    celery: bool = True
    #: Prefork children of the one Celery worker (the machine may have few cores).
    celery_children: int = 2
    run_lane: bool = True
    runners: int = 2
    baseline: bool = True
    seed: int | None = None
    #: SQLAlchemy URL for the upserts; None: FENCED_TEST_POSTGRES_URL, else SQLite.
    sql_url: str | None = None
    #: Directory for this run's logs and files; None: chaos/runs/<time>.
    out: str | None = None
    faults: tuple[str, ...] = FAULTS
    #: Quiet time between two faults, in multiples of the ttl.
    gap: tuple[float, float] = (1.5, 3.0)
    keep_tables: bool = False
    #: The dedup lane (chaos/dedup_app.py, chaos/feeder.py): fenced's Celery options.
    dedup: bool = True
    #: Prefork children of the dedup lane's Celery worker (more than its limit of 2).
    dedup_children: int = 5
    #: Lease of the dedup lane's claims, and its cooldown, in seconds.
    dedup_ttl: float = 3.0
    dedup_cooldown: float = 1.5
    #: Deliberate faults in the dedup lane, from BROKEN (the checker must fail the run).
    broken: tuple[str, ...] = ()
    #: The dedup lane's claims on a Sentinel group (master, replica, three sentinels),
    #: which the failover faults kill or pause.
    sentinel: bool = False
    #: The dedup lane's claims on a Redis Cluster (three masters, a replica each), whose
    #: masters the cluster failover faults kill or pause.
    cluster: bool = False
    #: claim_replicas of the dedup lane's tasks (replicas that must acknowledge each
    #: acquire and renewal); None: 1 on Sentinel or Cluster, else 0.
    replicas: int | None = None
    #: The beat lane (chaos/beat_app.py): ``beats`` celery beat processes under fenced's
    #: scheduler, on a Redis of their own, and a worker noting each tick.
    beat: bool = True
    beats: int = 3
    #: The object-store pointer among the stores (an ObjectPointer on Azurite): True
    #: needs Azurite, False leaves it out, None has it where Azurite is installed.
    objects: bool | None = None

    def check(self) -> None:
        """Raise ValueError for settings that cannot work, naming the fix."""
        unknown = [f for f in self.faults if f not in FAULTS]
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}: choose from {', '.join(FAULTS)}")
        if self.workers < 2:
            raise ValueError(f"--workers {self.workers}: at least 2, so that holders compete")
        if self.ttl < 0.3:
            raise ValueError(f"--ttl {self.ttl}: at least 0.3 s (the heartbeat renews at ttl/3)")
        if self.seconds <= 0:
            raise ValueError(f"--seconds {self.seconds}: a positive duration")
        wrong = [b for b in self.broken if b not in BROKEN]
        if wrong:
            raise ValueError(f"--broken {','.join(wrong)}: choose from {', '.join(BROKEN)}")
        if self.replicas is not None and self.replicas < 0:
            raise ValueError(f"--replicas {self.replicas}: 0 or more")
        if self.sentinel and self.cluster:
            raise ValueError(
                "--sentinel and --cluster both move the dedup lane's claims: choose one of them"
            )
        if self.cluster and not self.dedup:
            raise ValueError("--cluster puts the dedup lane on a Redis Cluster: drop --no-dedup")
        if self.sentinel and not self.dedup:
            raise ValueError("--sentinel puts the dedup lane on Sentinel: drop --no-dedup")
        if any(b not in BEAT_BROKEN for b in self.broken) and not self.dedup:
            raise ValueError("--broken breaks the dedup lane: drop --no-dedup")
        if any(b in BEAT_BROKEN for b in self.broken) and not self.beat:
            raise ValueError("--broken beat-* breaks the beat lane: drop --no-beat")
        if self.dedup and self.dedup_children < 3:
            raise ValueError(
                f"--dedup-children {self.dedup_children}: at least 3, so that a limit of 2 "
                "can be exceeded"
            )
        if self.beat and not 2 <= self.beats <= 5:
            raise ValueError(f"--beats {self.beats}: 2 to 5 beat processes")
        if not 0 < self.step_min <= self.step_max:
            raise ValueError("step times: 0 < step_min <= step_max")

    @property
    def dedup_replicas(self) -> int:
        """claim_replicas of the dedup lane: as asked, else 1 on Sentinel or Cluster."""
        if self.replicas is not None:
            return self.replicas
        return int(self.sentinel or self.cluster)

    @property
    def n_baseline(self) -> int:
        """Worker processes in the Lock lane."""
        if not self.baseline:
            return 0
        return self.workers if self.baseline_workers is None else self.baseline_workers


@dataclass
class Shared:
    """What a worker process needs to know, passed in the environment as JSON."""

    name: str
    ttl: float
    steps: int
    step_min: float
    step_max: float
    lock_url: str
    store_url: str
    sql_url: str
    sql_prefix: str
    files_dir: str
    log_dir: str
    lock_name: str = "chaos:lock"
    extra: dict[str, str] = field(default_factory=dict)

    def to_env(self) -> str:
        """The JSON form carried by CHAOS_SHARED."""
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> Shared:
        """Read CHAOS_SHARED; a clear error outside a chaos run."""
        raw = os.environ.get(ENV)
        if not raw:
            raise SystemExit(f"{ENV} is not set: worker processes are started by python -m chaos")
        return cls(**json.loads(raw))

"""What a simulation is of: the job, the failure record it draws from, its checkpoints and the time each stage of a
recovery takes at scale (configs/sim/*.yaml, loaded into these dataclasses; unknown keys are errors).

Every stage time and checkpoint parameter is a stated number with a `sources:` entry saying where it comes from (a
measurement of this project's, a public figure, or a plain assumption): the loader refuses a config that leaves one
unsourced. Detection times are not parameters: they come from the rule set's detectors (sim/detection.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from ground.typedconfig import ConfigError, apply_overrides, from_mapping, load_yaml
from healer.decide.save_interval import IntervalBounds

KINDS = ("crash", "hang", "gpu_fault", "host_lost", "nonfinite", "sdc")
"""The fault kinds a failure can show as (the healer's detectors of the same name). `sdc`: a host whose arithmetic
goes wrong; the trainer's re-run of the anomalous step (train/rerun.py) judges it, and the `sdc` detector convicts the
host (at once on a persistent verdict, after `convict_after` transient ones); without a re-run (restart: replica,
where the trainer runs none) it shows as `nonfinite`."""
RESTART_MODES = ("warm", "cold", "replica")


def _positive(owner: object, *names: str) -> None:
    for name in names:
        if getattr(owner, name) <= timedelta(0):
            raise ValueError(f"{name} must be > 0, got {getattr(owner, name)}")


@dataclass(kw_only=True, slots=True)
class Category:
    """One line of the failure record: how often it happened and what megaheal would see of it."""

    name: str
    count: float
    """Interruptions of this category in the reference run."""
    sees: str
    """The fault kind the healer's detectors see it as: crash, hang, gpu_fault, host_lost or nonfinite."""
    host_at_fault: bool = True
    """The host itself is broken: as long as it stays in the job it fails again (after `recur_after`)."""
    found: float = 1.0
    """For a kind whose suspect host is diagnosed first (crash, hang): the chance node-health fails that host. For
    `sdc`: the chance a re-run's verdict is persistent (the fault reproduced on the host: convicted at once) rather
    than transient (the step mended in place, a strike against the host)."""
    found_live: float | None = None
    """The same for node-health-live, the checks before a warm restart (it exercises no GPU); None: `found`."""
    repair: timedelta = timedelta(days=1)
    """How long a host taken out for this stays out before it joins the spares again."""

    def __post_init__(self) -> None:
        if self.sees not in KINDS:
            raise ValueError(f"sees must be one of {', '.join(KINDS)}, got {self.sees!r}")
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")
        for name in ("found", "found_live"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        _positive(self, "repair")

    @property
    def live_found(self) -> float:
        return self.found if self.found_live is None else self.found_live


@dataclass(kw_only=True, slots=True)
class Failures:
    """A failure record (counts over a reference run) turned into per-host rates."""

    reference_nodes: int
    """Hosts of the reference run the counts were seen on."""
    reference_days: float
    categories: list[Category]
    planned: float = 0.0
    """Planned interruptions in the reference run (maintenance): the job stops cleanly, waits, restarts cold."""
    scale: float = 1.0
    """Every rate times this (the failure-rate sweep)."""
    lemon_fraction: float = 0.0
    """Hosts that fail `lemon_factor` times as often as the others (the counts stay the reference's)."""
    lemon_factor: float = 1.0
    recur_after: timedelta = timedelta(hours=1)
    """A broken host kept in the job (its diagnosis passed) fails again after this long on average."""
    change_at: timedelta | None = None
    """From this far into the run, every rate is `change_scale` times the record's (a fleet that ages, a bad batch
    of parts): what a save interval tuned from the failures seen must follow."""
    change_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.reference_nodes < 1 or self.reference_days <= 0:
            raise ValueError("reference_nodes must be >= 1 and reference_days > 0")
        if not self.categories:
            raise ValueError("categories must name at least one failure category")
        if sum(c.count for c in self.categories) <= 0:
            raise ValueError("categories must have a count > 0 in all")
        names = [c.name for c in self.categories]
        if len(set(names)) != len(names):
            raise ValueError(f"categories must have distinct names, got {names}")
        if self.planned < 0 or self.scale <= 0 or self.lemon_factor < 1 or not 0 <= self.lemon_fraction < 1:
            raise ValueError("planned must be >= 0, scale > 0, lemon_factor >= 1 and lemon_fraction in [0, 1)")
        _positive(self, "recur_after")
        if self.change_scale <= 0 or (self.change_at is not None and self.change_at < timedelta(0)):
            raise ValueError("change_scale must be > 0 and change_at >= 0")

    def per_node_rate(self, category: Category) -> float:
        """Failures per host-second of `category` (scaled)."""
        return self.scale * category.count / (self.reference_nodes * self.reference_days * 86400.0)

    @property
    def rate_per_node(self) -> float:
        """Failures per host-second, all categories."""
        return sum(self.per_node_rate(c) for c in self.categories)


@dataclass(kw_only=True, slots=True)
class Job:
    nodes: int
    """Hosts the job trains on."""
    gpus_per_node: int = 8
    spares: int = 0
    """Idle healthy hosts the job may take when one leaves."""
    hosts_per_replica: int = 1
    """Hosts of one data-parallel replica (pp x tp GPUs over a host's GPUs): the job shrinks by whole replicas."""
    step_time: timedelta = timedelta(seconds=10)
    step_time_p99: timedelta | None = None
    """What the hang detector learns (its timeout is max(floor, k x p99)); None: step_time."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.spares < 0 or self.hosts_per_replica < 1:
            raise ValueError("nodes, gpus_per_node and hosts_per_replica must be >= 1 and spares >= 0")
        if self.nodes % self.hosts_per_replica:
            raise ValueError(f"nodes ({self.nodes}) must be a multiple of hosts_per_replica "
                             f"({self.hosts_per_replica})")
        _positive(self, "step_time")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.nodes // self.hosts_per_replica

    @property
    def p99(self) -> timedelta:
        return self.step_time_p99 or self.step_time


@dataclass(kw_only=True, slots=True)
class Checkpoint:
    interval: timedelta
    """Training time between two saves."""
    stall: timedelta
    """How long each save holds the training up (the blocking part of an async save)."""
    persist: timedelta
    """After the stall, until the save is on durable storage (a cold restart can only use durable ones; a warm one
    also those still in memory)."""
    load: timedelta
    """Reading a checkpoint back on a cold restart."""
    snapshot_interval: timedelta | None = None
    """restart: warm. Training time between two in-memory snapshots (train/warm/: each rank's state in host memory,
    a replica on a peer host; `snapshot_every_steps`): a warm restart resumes from the newest, a lost host's part
    taken from its peer's replica. Every save is also a snapshot; None: the saves are the only snapshots."""
    snapshot_stall: timedelta = timedelta(0)
    """How long a snapshot that is not also a save holds the training up (the device-to-host copy)."""

    def __post_init__(self) -> None:
        _positive(self, "interval")
        if min(self.stall, self.persist, self.load, self.snapshot_stall) < timedelta(0):
            raise ValueError("stall, persist, load and snapshot_stall must be >= 0")
        if self.snapshot_interval is not None and self.snapshot_interval <= timedelta(0):
            raise ValueError(f"snapshot_interval must be > 0, got {self.snapshot_interval}")


@dataclass(kw_only=True, slots=True)
class Stages:
    """How long each stage of a recovery takes at the simulated scale."""

    crash_detection: timedelta
    """A rank's exit to the crash incident."""
    gpu_fault_detection: timedelta
    """An Xid or ECC error to the gpu_fault incident (the sidecars read NVML on every batch)."""
    heartbeat: timedelta
    """Added to the timeouts of the detectors that watch heartbeats (hang, host_lost, nonfinite): a batch's interval
    and the healer's tick."""
    node_health: timedelta
    node_health_live: timedelta
    stop: timedelta
    """Stopping what is left of an attempt before a cold restart (SIGTERM, then SIGKILL)."""
    cold_start: timedelta
    """New processes to their first step: scheduling, imports, rendezvous, communicators (the checkpoint load is
    Checkpoint.load, added to it)."""
    warm_restart: timedelta
    """A warm restart's decision to its first step: the survivors' new group, a standby's state from a peer."""
    person: timedelta
    """A page to the job training again: someone answers, replaces or removes the host, restarts the job."""
    ft_timeout: timedelta = timedelta(seconds=5)
    """restart: replica. A replica group lost to the others going on without it: their collective with it times out
    and the next quorum forms without it (every GPU waits this long, and the step is tried again)."""
    group_join: timedelta = timedelta(seconds=60)
    """restart: replica. A group started in a lost one's place to its first step with the others: new processes,
    and its state from a live peer group (no checkpoint read)."""
    planned_downtime: timedelta
    """restart: cold. A planned interruption's stop to its restart (the maintenance itself)."""
    planned_restart: timedelta = timedelta(seconds=20)
    """restart: warm or replica. A planned interruption taken at a snapshot boundary without a cold start: the hosts
    to maintain swapped for spares, or a new config applied, in one warm restart (replica: a rolling restart, one
    group at a time, the job's GPU-time the same as this pause); nothing is lost."""
    rerun: timedelta = timedelta(seconds=12)
    """The trainer's re-run of an anomalous step (on its ranks, then moved) before it judges it (train/rerun.py):
    the job waits this long at each sdc fault."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < timedelta(0):
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")


@dataclass(kw_only=True, slots=True)
class Sweeps:
    """The parameters `megaheal simulate --sweeps` varies, one at a time around the config."""

    checkpoint_interval: list[timedelta] = field(default_factory=list)
    failure_scale: list[float] = field(default_factory=list)
    gpus: list[int] = field(default_factory=list)
    """Job sizes; hosts, spares and replicas scale with it (spares in the config's proportion)."""
    cold_start: list[timedelta] = field(default_factory=list)
    """The MTTR sweep: cold restarts of these startup times, against the warm restart."""
    seeds: int = 3
    """Runs per point (seeds seed, seed+1, ...); the point is their mean."""

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise ValueError(f"seeds must be >= 1, got {self.seeds}")
        if any(s <= 0 for s in self.failure_scale) or any(g < 1 for g in self.gpus):
            raise ValueError("failure_scale values must be > 0 and gpus >= 1")
        if any(t <= timedelta(0) for t in self.checkpoint_interval):
            raise ValueError("checkpoint_interval values must be > 0")


@dataclass(kw_only=True, slots=True)
class Tuning:
    """The healer's self-tuning save interval (healer/decide/save_interval.py), as the simulated job runs it: the
    interval restarts resume from (the snapshots' where the job runs warm with snapshots, else the saves') moved
    toward Daly's optimum for the failures seen, at each attempt's start."""

    enabled: bool = False
    least: timedelta = timedelta(seconds=30)
    most: timedelta = timedelta(hours=2)
    window: timedelta = timedelta(days=7)

    def __post_init__(self) -> None:
        self.bounds()  # its own checks, named

    def bounds(self) -> IntervalBounds:
        return IntervalBounds(least=self.least, most=self.most, window=self.window)


@dataclass(kw_only=True, slots=True)
class SimConfig:
    days: float
    seed: int = 0
    restart: str = "warm"
    """warm: the job runs warm (a crash or a rollback restarts warm where the policy allows); cold: every restart
    is cold; replica: each data-parallel replica is a replica group of its own (train/ft/): a fault of one host
    replaces its group while the others train on (a rollback still stops them all, and restarts cold)."""
    rules: list[str] = field(default_factory=list)
    """Rule files or directories the policy runs with (their budgets and lemon limits); empty: the shipped rules."""
    policy: bool = True
    """False: the analytic baseline (every failure costs a fixed restart, detection and diagnosis included, and
    takes a fresh host; no budget, no lemons, no planned stops), to check against the closed forms."""
    job: Job
    failures: Failures
    checkpoint: Checkpoint
    stages: Stages
    sources: dict[str, str] = field(default_factory=dict)
    """Where each stage time and checkpoint parameter comes from (`stages.cold_start: "..."`)."""
    sweeps: Sweeps = field(default_factory=Sweeps)
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        if self.days <= 0:
            raise ValueError(f"days must be > 0, got {self.days}")
        if self.restart not in RESTART_MODES:
            raise ValueError(f"restart must be warm, cold or replica, got {self.restart!r}")
        needed = {f"{section}.{f.name}" for section, obj in (("stages", self.stages), ("checkpoint", self.checkpoint))
                  for f in dataclasses.fields(obj)}
        missing = sorted(needed - set(self.sources))
        if missing:
            raise ValueError(f"sources must say where each stated parameter comes from; missing: {', '.join(missing)}")
        unknown = sorted(set(self.sources) - needed)
        if unknown:
            raise ValueError(f"sources names parameters that do not exist: {', '.join(unknown)}")


def load_config(path: str | Path, overrides: list[str] | None = None) -> SimConfig:
    """The config at `path` with `--set KEY=VALUE` overrides applied; ConfigError naming the file and key."""
    data = apply_overrides(load_yaml(path), list(overrides or []))
    try:
        return from_mapping(SimConfig, data, str(path))
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc

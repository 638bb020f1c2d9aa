"""Putting `megaheal run` together: the store, the rules, the sinks, the node agents (local, or on the hosts of a
Slurm allocation) and the coordinator that orders them, the endpoint their batches come to, the remediator, the healer and its loop. One place, so the command and the tests build the same thing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from ground.typedconfig import from_mapping
from healer.compose import compose
from healer.decide.rules import DEFAULT_RULES, DetectorCondition, RuleSet, load_rule_set
from healer.detect.nonfinite import PROGRAM_SETTLE, NonFinite
from healer.detect.registry import default_registry
from healer.incidents import epochs
from healer.incidents.db import ensure_schema, make_engine
from healer.incidents.store import IncidentStore
from healer.launchers.coordinator import Coordinator
from healer.launchers.coordinator_base import GroupSettings
from healer.launchers.drain import Drainer
from healer.launchers.job_diagnosis import JobDiagnosis
from healer.launchers.launchers import LauncherConfig, launch
from healer.launchers.local_agents import LocalAgents
from healer.launchers.remediator import AgentRemediator
from healer.launchers.run_authority import RunAuthority
from healer.launchers.run_token import read_token, write_token
from healer.launchers.warm_control import WarmSettings
from healer.ledger.store import LedgerWriter
from healer.observe.heartbeats import HeartbeatTable
from healer.oncall.sinks import AlertmanagerSink, Sink, Sinks
from healer.runner.lighthouse import Lighthouse
from healer.runner.loop import LoopConfig, SelfHealingJob
from healer.runner.reports import ReportServer
from healer.launchers.save_tuning import Intervals
from train.config import TrainConfig, load_config
from train.ft.config import FtConfig
from train.layout import LayoutError, validate_layout
from wire.orders import UserProgram
from wire.run_paths import RunPaths


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """One self-healing job on this machine."""

    job: str
    """Its name (its ranks report it; incidents, restarts and the ledger are filed under it)."""
    config: str | None
    """megaheal's trainer: its config's path; None with `program`."""
    program: UserProgram | None = None
    """A user's program (megaheal run SCRIPT.py | -m MODULE) instead of megaheal's trainer."""
    nproc_per_node: int = 1
    """A program's ranks per host (the trainer's follow from its config)."""
    min_nodes: int | None = None
    """A program's fewest hosts: below its hosts and spares it may come back smaller, down to this [default: as
    many as `nodes`: never smaller]."""
    run_dir: Path
    nodes: tuple[str, ...] = ("n1", "n2")
    """The hosts it starts on (local torchrun agents)."""
    spares: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    """`--set` items for every attempt."""
    rules: RuleSet | None = None
    """Default: the shipped rule set (configs/rules/), which enables every detector."""
    db_url: str | None = None
    """The healer's database; default: SQLite in the run directory."""
    db_password: str | None = None
    """The database's password (megaheal run --db-password-file): given to the driver, never in a URL, an
    environment or a command line."""
    alertmanager_url: str | None = None
    """Where incidents page from; none by default."""
    public_url: str = "http://127.0.0.1:8470"
    """Links in the alerts (the healer service on the same database, if one runs)."""
    grace: timedelta = timedelta(seconds=30)
    """A graceful stop's SIGTERM to SIGKILL (time for the final checkpoint)."""
    loop: LoopConfig = field(default_factory=LoopConfig)
    launcher: LauncherConfig = field(default_factory=LocalAgents.Config)
    """Which launcher starts the hosts' agents, by its Config (healer/launchers/launchers.py): local agents on this
    machine (the default), or an agent per host of the Slurm allocation this runs in, started with srun."""
    drain: bool = False
    """Drain in the scheduler the hosts a restart leaves out because they failed diagnosis or are lemons."""
    preflight: bool = False
    """Screen every host and spare before the first attempt; those that fail are left out (and drained where the
    run drains): healer/launchers/preflight.py."""
    rescreen_every: timedelta | None = timedelta(minutes=10)
    """With `preflight`, how often the idle spares are screened again while the job runs (None: never)."""
    warm: WarmSettings | None = None
    """Run the attempts as generations of warm workers, so a crash of a rank or a rollback restarts warm (the
    survivors keep their processes and state, a standby takes a lost rank); None: a torchrun agent per attempt."""
    tune_saves: bool = False
    """megaheal's trainer: move its save (and under `warm`, snapshot) interval toward the optimum for the failures
    the job has, at each restart that loses work (healer/launchers/save_tuning.py); off: as configured."""


def valid_dp(cfg: TrainConfig) -> tuple[int, ...]:
    """The data-parallel degrees, up to the configured one, that the training layout accepts."""
    out = []
    for dp in range(1, cfg.parallel.dp + 1):
        par = replace(cfg.parallel, dp=dp)
        try:
            validate_layout(par, cfg.model, cfg.global_batch, par.world_size)
        except LayoutError:
            continue
        out.append(dp)
    return tuple(out)


def shipped_rules(*, max_restarts: int | None = None, lemon_incidents: int | None = None,
                  skip_steps: int | None = None, **detectors: dict[str, Any]) -> RuleSet:
    """The shipped rule set (configs/rules/) with a few knobs turned (benchmarks and tests): a detector's `when:`
    parameters (e.g. hang={"floor": "6s"}) and the policy's limits."""
    shipped = load_rule_set([DEFAULT_RULES])
    rules = []
    for rule in shipped.rules:
        cond = rule.condition
        if isinstance(cond, DetectorCondition) and cond.detector in detectors:
            cls = default_registry().resolve(cond.detector)
            params = from_mapping(cls.Config, detectors.pop(cond.detector), f"{rule.name}.when")
            rule = replace(rule, when=DetectorCondition(detector=cond.detector, params=params))
        rules.append(rule)
    if detectors:
        raise ValueError(f"no shipped rule for detector(s) {sorted(detectors)}")
    limits = shipped.limits
    budget = limits.budget if max_restarts is None else replace(limits.budget, max_restarts=max_restarts)
    limits = replace(limits, budget=budget,
                     lemon_incidents=limits.lemon_incidents if lemon_incidents is None else lemon_incidents,
                     skip_steps=limits.skip_steps if skip_steps is None else skip_steps)
    return RuleSet(rules, limits)


def _settled_nonfinite(rules: RuleSet) -> RuleSet:
    """`rules` with each nonfinite rule left at settle 0 waiting PROGRAM_SETTLE: a program's first bad step is known
    only from the heartbeats, each host's in its own batch (healer/detect/nonfinite.py)."""
    out = []
    for rule in rules.rules:
        cond = rule.condition
        if isinstance(cond, DetectorCondition) and cond.detector == "nonfinite" and \
                isinstance(cond.params, NonFinite.Config) and cond.params.settle == timedelta(0):
            rule = replace(rule, when=DetectorCondition(detector="nonfinite",
                                                        params=replace(cond.params, settle=PROGRAM_SETTLE)))
        out.append(rule)
    return RuleSet(out, rules.limits)


def shared_config(config: str | None, run_dir: Path) -> str | None:
    """The trainer's config as the agents are told it: as given when it is under the run directory or this checkout
    (the agents' directory of work: configs/), else a copy of it in the run directory, which every host shares. NOTE:
    an agent takes a config from nowhere else (healer/agent/confine.py); the copy is made at each start of a healer,
    so its restarts all run the config it started with."""
    if config is None:
        return None
    real = Path(os.path.realpath(config))
    if real.is_relative_to(os.path.realpath(run_dir)) or real.is_relative_to(os.path.realpath(Path.cwd())):
        return config
    copy = RunPaths(run_dir).launcher / "config.yaml"
    copy.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(real, copy)
    return str(copy.absolute())


DB_TIMEOUT = timedelta(seconds=10)
"""The longest a statement or a lock wait of the run's healer may take on PostgreSQL (the service's default too)."""


def db_url_of(spec: JobSpec) -> str:
    return spec.db_url or RunPaths(spec.run_dir).database_url


def _layout(spec: JobSpec) -> tuple[int, int, tuple[int, ...], int | None]:
    """Ranks per host, the data-parallel degree, the degrees the job accepts and its steps in all (None: a program's,
    not known). A program is taken to be data-parallel across its hosts (one replica a host; torchrun's WORLD_SIZE
    tells it how many), shrinking no lower than `min_nodes`; the trainer's config says its own. A trainer of replica
    groups (ft.enabled) runs one group a host: its degree is the number of groups, down to ft.min_groups."""
    if spec.program is not None:
        n = len(spec.nodes)
        low = n if spec.min_nodes is None else spec.min_nodes
        if not 1 <= low <= n:
            raise ValueError(f"the fewest hosts must be between 1 and {n}, got {low}")
        return spec.nproc_per_node, n, tuple(range(low, n + 1)), None
    assert spec.config is not None
    cfg = load_config(spec.config, list(spec.overrides))
    if cfg.ft.enabled:
        n = len(spec.nodes)
        if n > cfg.ft.groups:
            raise ValueError(f"ft.groups ({cfg.ft.groups}) is fewer than the job's {n} hosts: each host runs one "
                             "replica group")
        return cfg.parallel.world_size, n, tuple(range(min(cfg.ft.min_groups, n), n + 1)), cfg.steps
    world = cfg.parallel.world_size
    if world % len(spec.nodes):
        raise ValueError(f"{world} ranks do not split over {len(spec.nodes)} hosts")
    return world // len(spec.nodes), cfg.parallel.dp, valid_dp(cfg), cfg.steps


def _save_intervals(spec: JobSpec) -> Intervals | None:
    """The trainer's configured save and snapshot intervals, where the healer tunes them (spec.tune_saves): a program
    saves on its own terms, and a job that never saves has nothing to tune."""
    if not spec.tune_saves or spec.program is not None or spec.config is None:
        return None
    cfg = load_config(spec.config, list(spec.overrides))
    every = cfg.checkpoint.every_steps
    if every <= 0:
        return None
    # NOTE: only a warm worker keeps snapshots (train/trainer.py _maybe_snapshot); 0 there means at the saves
    return Intervals(every_steps=every,
                     snapshot_every_steps=(cfg.snapshot_every_steps or every) if spec.warm is not None else None)


def _answers(coordinator: Coordinator, node: str) -> bool:
    """Whether the agent of `node` answers the healer's own call (a drain's first witness, healer/launchers/drain.py)."""
    client = coordinator.agents.get(node)
    return client is not None and client.answers(timeout_s=2.0)


def build_job(spec: JobSpec, token: str | None = None) -> SelfHealingJob:
    """Everything `megaheal run` runs, wired; nothing started (the agents, and the endpoint their batches come to,
    start with the job). Raises ConfigError, DatabaseError, ValueError."""
    nproc, dp, accepted, total_steps = _layout(spec)
    rules = spec.rules or load_rule_set([DEFAULT_RULES])
    if spec.program is not None:
        rules = _settled_nonfinite(rules)
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: the schema under no time limit (a take-over's migration may rewrite big tables), then every statement and
    # lock wait bounded: a database that stops answering fails the healer's write, it does not hang the loop.
    migrating = make_engine(db_url_of(spec), password=spec.db_password)
    try:
        ensure_schema(migrating)
    finally:
        migrating.dispose()
    engine = make_engine(db_url_of(spec), DB_TIMEOUT, spec.db_password)
    # The run's own token, in a file only this user reads: only this healer and its agents may kill or restart the
    # job. A healer that takes the run over reads it from there.
    token_file = RunPaths(spec.run_dir).token
    if token is None and token_file.exists():
        token = read_token(token_file)
    token = write_token(token_file, token)
    owner = f"megaheal-run:{socket.gethostname()}:{os.getpid()}"
    store = IncidentStore(engine, owner, handler=f"run:{spec.job}")
    # NOTE: before any order (the launcher's own to its agents included): from its first order on, an older healer
    # of the job that still runs is refused by every agent this one reaches.
    epoch = epochs.claim(engine, spec.job, owner)
    resend = timedelta(seconds=30)
    sinks: list[Sink] = [AlertmanagerSink(spec.alertmanager_url, spec.public_url, resend)] if spec.alertmanager_url else []
    launched = launch(spec.launcher, spec.run_dir, token_file)
    agents = launched.fleet
    agents.epoch = epoch
    ft = _replica_groups(spec)
    lighthouse = (Lighthouse(_advertise_host(launched.listen), ft.min_groups,
                             RunPaths(spec.run_dir).launcher / "lighthouse.log") if ft is not None else None)

    def hands(store: IncidentStore, table: HeartbeatTable) -> AgentRemediator:
        coordinator = Coordinator(Coordinator.Config(job=spec.job, config=shared_config(spec.config, spec.run_dir),
                                                     run_dir=spec.run_dir,
                                                     nproc_per_node=nproc, overrides=spec.overrides,
                                                     grace=spec.grace, hosts_are_local=agents.hosts_are_local,
                                                     warm=_advertised(spec.warm, launched.listen),
                                                     program=spec.program,
                                                     groups=GroupSettings(lighthouse.url) if lighthouse else None),
                                  table.processes, token, env=launched.rank_env, epoch=epoch)
        across = JobDiagnosis(python=sys.executable, cwd=Path.cwd(), env=launched.across_env)
        return AgentRemediator(AgentRemediator.Config(nodes=spec.nodes, spares=spec.spares, dp=dp,
                                                      valid_dp=accepted, total_steps=total_steps,
                                                      preflight=spec.preflight,
                                                      rescreen_every=spec.rescreen_every,
                                                      replica_groups=ft.groups if ft is not None else 0,
                                                      save_intervals=_save_intervals(spec)),
                               coordinator, token,
                               drainer=Drainer(agents, store, spec.job, drain=spec.drain,
                                               agent_answers=lambda node: _answers(coordinator, node)),
                               across=across,
                               saved=table)

    core = compose(db=engine, store=store, rules=rules, token=token, sinks=Sinks(sinks), hands=hands, resend=resend,
                   max_body=4 << 20)
    core.readiness.probe()
    remediator = core.healer.remediator
    assert isinstance(remediator, AgentRemediator)
    # The healer's one HTTP API, on the launcher's address: the agents' batches, and the incidents for who asks.
    # NOTE: CERT_OPTIONAL: a host must show its certificate to report (api.py), a person with the token and the
    # run's ca.pem may read the incidents without one.
    tls = RunAuthority.of_run(RunPaths(spec.run_dir).launcher).healer().server(require_peer=False)
    reports = ReportServer(core.app, listen=launched.listen, tls=tls)
    ledger = LedgerWriter(spec.run_dir, engine, spec.job)
    return SelfHealingJob(core.healer, remediator, agents, reports, core.table, spec.loop, background=[ledger.write],
                          closing=[lighthouse.stop] if lighthouse is not None else [])


def _replica_groups(spec: JobSpec) -> FtConfig | None:
    """The trainer's `ft` section where it trains as replica groups (one per host, joined by the healer's
    Lighthouse), else None."""
    if spec.config is None:
        return None
    ft = load_config(spec.config, list(spec.overrides)).ft
    return ft if ft.enabled else None


def _advertise_host(listen: str) -> str:
    host = listen.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


def _advertised(warm: WarmSettings | None, listen: str) -> WarmSettings | None:
    """The warm pool's store on the address the healer listens on towards its hosts (the loopback for the local
    launcher, the allocation's address of the healer's host under Slurm): the workers of every host reach it there."""
    return dataclasses.replace(warm, advertise=_advertise_host(listen)) if warm is not None else None

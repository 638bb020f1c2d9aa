"""`megaheal run`: one supervised, self-healing training job on this machine, with a live view.

The job runs on two hosts (local torchrun agents, a sidecar each) plus a spare, under the one healer embedded with
the local launcher (healer.runner.build): every detector the rules enable (the shipped rule set enables all of
them), diagnostics on the suspect hosts after a crash or a hang, the remediation policy, the restart budget. With
`--chaos FILE` the schedule's faults are injected into the real processes. Incidents live in the healer's
database (`--db`, SQLite in the run directory by default) and page through Alertmanager (`--alertmanager`). At the
end it prints the incident table and the goodput ledger (ETTR, against the job's objective), writes them to
`<run_dir>/report.json`, and writes the run's pages as one file, `<run_dir>/report.html` (healer/pages/), whose path it
prints last. While it runs, the same ledger is served as Prometheus metrics (healer/ledger/metrics.py) on
127.0.0.1:`--metrics-port`. The objective is recorded in the run directory as the run starts
(healer/ledger/objective.py), for the report, the pages and a healer that takes the run over.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ground.names import derive_name
from healer.decide.plans import CRASH_LOOP_EXIT
from healer.decide.rules import RuleSet, load_rule_set
from healer.launchers.agent_client import Fenced
from healer.launchers.allocation import Allocation
from healer.launchers.launchers import LauncherConfig
from healer.launchers.local_agents import LocalAgents
from healer.launchers.slurm_agents import SlurmAgents
from healer.launchers.warm_control import WarmSettings
from healer.ledger.metrics import GoodputCollector, GoodputServer
from healer.ledger.objective import RECORDED, Objective, read_objective, write_objective
from healer.runner.build import JobSpec, build_job
from healer.runner.chaos import Chaos, Schedule, load_schedule
from healer.runner.hosts import record_states
from healer.runner.liveview import LiveView
from healer.runner.loop import SelfHealingJob
from healer.runner.report import report, run_job_name, write_html
from healer.runner.shutdown import Interrupts, RunDirLock
from train.config import TrainConfig, load_config
from wire.orders import UserProgram
from wire.run_paths import RunPaths

NODES = ("n1", "n2")
SPARES = ("n3",)
LAUNCHERS = ("local", "slurm")
log = logging.getLogger(__name__)
NO_TIMEOUT = timedelta(days=365 * 100)
"""What the loop is given for "no timeout" (SelfHealingJob.run takes a duration): longer than any job runs."""


def _serve_goodput(run_dir: Path, job: str, incidents: Callable[[], list[dict[str, Any]]],
                   port: int | None, ettr: GoodputCollector.Config | None = None) -> GoodputServer | None:
    if port is None:
        return None
    server = GoodputServer(run_dir, job, incidents, port=port, cfg=ettr)
    try:
        bound = server.start()
    except OSError as exc:  # the job matters more than its metrics: say so and go on without them
        log.warning("goodput metrics not served on 127.0.0.1:%d: %s", port, exc)
        return None
    print(f"goodput metrics: http://127.0.0.1:{bound}/metrics")
    return server


def job_name(cfg_job: str | None, run_dir: Path, resume: bool) -> str:
    """The job's name: the config's `job` (or `--set job=...`), else one made from the run directory's name (a
    directory named "my run" gives "my-run"; see ground/names.py). A take-over goes on under the name the
    journal of the run recorded, whatever the directory is called now."""
    if resume:
        recorded = run_job_name(run_dir)
        if cfg_job is not None and cfg_job != recorded:
            raise ValueError(f"--take-over: {run_dir} ran job {recorded!r}, not {cfg_job!r} (the config's job)")
        return recorded
    if cfg_job is not None:
        return cfg_job
    name = derive_name(run_dir.resolve().name)
    if name != run_dir.resolve().name:
        print(f"job name: {name} (made from the run directory's name; set `job:` in the config or --set job=NAME "
              "to choose it)")
    return name


def run_job(config: str, run_dir: Path | None, chaos_path: str | None, timeout: timedelta | None = None,
            metrics_port: int | None = None, overrides: tuple[str, ...] = (), resume: bool = False,
            db_url: str | None = None, alertmanager_url: str | None = None,
            rules: tuple[str, ...] = (), launcher: str = "local", spares: int = 1, drain: bool | None = None,
            standbys: int | None = None, program: ProgramLaunch | None = None, db_password: str | None = None,
            dcgm_url: str | None = None, preflight: bool = True,
            rescreen: timedelta | None = timedelta(minutes=10), ettr: GoodputCollector.Config | None = None,
            tune_saves: bool = False) -> int:
    """`timeout`: stop the job after this long (None: it runs until it finishes, escalates or is stopped, as under
    torchrun or Slurm, whose own time limit still holds). `resume`: take over `run_dir` from a healer that died (its
    incidents, budgets and hosts go on).
    `db_url`: the healer's database [default: SQLite in the run dir], `db_password` its password (from a file, never
    in the URL); `alertmanager_url`: where incidents page
    from; `rules`: rule files or directories [default: configs/rules/]. `launcher`: local (hosts are agents on
    this machine) or slurm (the hosts of the allocation this runs in, the last `spares` of them kept as spares);
    `drain`: drain hosts proven bad in the scheduler [default: under slurm]; `preflight`: screen every host and spare
    before the first attempt (healer/launchers/preflight.py); `rescreen`: how often the idle spares and the hosts left
    out are screened again (one that passes is a spare again, and a job that came back smaller grows back onto it;
    None: never). `standbys`: run warm with that many standby workers per host (healer/launchers/warm_control.py);
    None: every restart is cold. `dcgm_url`: under slurm, each host's agent reads its GPUs from the dcgm-exporter at
    that URL (as the host sees it) instead of NVML. `ettr`: the job's ETTR objective, served with the goodput ledger
    and recorded in the run directory [default: a take-over's, the one its run recorded; else
    GoodputCollector.Config's]. `tune_saves`: megaheal's trainer's save (and warm, snapshot) interval moved at each
    restart toward the optimum for the failures the job has (healer/launchers/save_tuning.py). Returns FENCED_EXIT when a newer healer took the job over (it is
    left running as it is), CRASH_LOOP_EXIT when it stopped the job in a crash loop (do not run it again as it is).
    Raises RunDirBusy
    when another runner holds `run_dir`, ValueError (NotInAllocation) for slurm outside an allocation, ConfigError
    for a bad config, rule file, chaos schedule or, taking over, objective file (before anything is written)."""
    if resume and (run_dir is None or not RunPaths(run_dir).journal.exists()):
        raise ValueError(f"--take-over needs the --run-dir of a supervised run (no attempts' journal in {run_dir})")
    if resume and chaos_path:
        raise ValueError("--take-over takes over a run as it is: it cannot be combined with --chaos")
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if dcgm_url is not None and launcher != "slurm":
        raise ValueError("--dcgm-url is for --launcher slurm (each host reads its own dcgm-exporter); a local run's "
                         "hosts share this machine's GPUs")
    # NOTE: read before the run directory is made: a broken rule file leaves nothing behind.
    rule_set = load_rule_set(list(rules)) if rules else None
    run_dir = run_dir or Path(time.strftime("runs/run-%Y%m%d-%H%M%S"))
    # NOTE: read before anything is written, as the rules are: a take-over goes on under the objective its run had.
    ettr = ettr or (read_objective(run_dir).cfg if resume else GoodputCollector.Config())
    if program is not None:
        if chaos_path or overrides:
            raise ValueError("a script or module takes its own arguments: --chaos and --set are for megaheal's own "
                             "trainer (--config)")
        placement = _program_placement(program, launcher, spares, drain, dcgm_url)
        warm = WarmSettings(standbys=standbys) if standbys is not None else None
        with RunDirLock(run_dir, resume):
            return _run_locked(None, program, run_dir, None, timeout, metrics_port, (), resume, db_url,
                               alertmanager_url, rule_set, placement, warm, db_password, preflight, rescreen, ettr)
    cfg = load_config(config, list(overrides))
    schedule = load_schedule(chaos_path) if chaos_path else None
    placement = _placement(cfg, launcher, spares, drain, dcgm_url)
    if placement.overrides:  # the allocation sets the data-parallel degree: the job's world is the config's so changed
        cfg = load_config(config, [*placement.overrides, *overrides])
    if schedule is not None and chaos_path is not None:
        schedule.check_ranks(cfg.parallel.world_size, chaos_path)
    warm = WarmSettings(standbys=standbys) if standbys is not None else None
    with RunDirLock(run_dir, resume):
        return _run_locked(cfg, config, run_dir, schedule, timeout, metrics_port, (*placement.overrides, *overrides),
                           resume, db_url, alertmanager_url, rule_set, placement, warm, db_password, preflight,
                           rescreen, ettr, tune_saves)


FENCED_EXIT = 3
"""`megaheal run`'s exit status when a newer healer took its job over (an agent refused its epoch)."""


def _leave_fenced(job: SelfHealingJob, exc: Fenced) -> int:
    """A newer healer drives the job (an agent refused this one's epoch): leave without touching it. Its attempt,
    its agents and its journal are the newer healer's; only what is this process's own is closed."""
    log.critical("megaheal run: %s", exc)
    job.keeper.stop()
    job.sup.close()
    job.reports.stop()
    job.healer.store.engine.dispose()
    print(f"megaheal run: stopped acting on job {job.job}: a newer healer drives it (an agent refused this one's "
          f"epoch {job.sup.epoch}: {exc}). Nothing of the job was stopped; see the newer healer's run for how it goes.")
    return FENCED_EXIT


@dataclass(frozen=True, slots=True)
class ProgramLaunch:
    """A user's program in torchrun's shape: `megaheal run [--nnodes N|MIN:MAX] [--nproc-per-node K] SCRIPT ARGS`."""

    program: UserProgram
    nproc_per_node: int | None = None
    """Ranks per host [default: local 1; slurm: the allocation's tasks per node]."""
    nnodes: int | None = None
    """Hosts it starts on [default: local 1; slurm: the allocation's hosts less the spares]."""
    min_nodes: int | None = None
    """It may come back on fewer hosts, down to this, when no spare is left [default: never fewer]."""

    @classmethod
    def parse_nnodes(cls, text: str) -> tuple[int | None, int | None]:
        """torchrun's --nnodes: N, or MIN:MAX (it may shrink to MIN). ValueError naming the option."""
        low, sep, high = text.partition(":")
        try:
            n, m = int(high if sep else low), int(low) if sep else None
        except ValueError:
            raise ValueError(f"--nnodes must be N or MIN:MAX, got {text!r}") from None
        if n < 1 or (m is not None and not 1 <= m <= n):
            raise ValueError(f"--nnodes must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
        return n, m


def _program_placement(launch: ProgramLaunch, launcher: str, spares: int, drain: bool | None,
                       dcgm_url: str | None = None) -> Placement:
    """local: `nnodes` agents on this machine (n1..) and `spares` more; slurm: the allocation's hosts, the last
    `spares` as spares."""
    if spares < 0:
        raise ValueError(f"--spares must be >= 0, got {spares}")
    if launcher == "local":
        n = launch.nnodes or 1
        names = tuple(f"n{i}" for i in range(1, n + spares + 1))
        return Placement(nodes=names[:n], spares=names[n:], drain=bool(drain), nproc=launch.nproc_per_node or 1)
    allocation = Allocation.from_environment()
    nodes, spare_hosts = allocation.split(spares)
    if launch.nnodes is not None and launch.nnodes != len(nodes):
        raise ValueError(f"--nnodes {launch.nnodes}: the allocation has {len(nodes)} host(s) beside "
                         f"{len(spare_hosts)} spare(s)")
    nproc = launch.nproc_per_node or allocation.ranks_per_node
    print(f"slurm job {allocation.job_id}: {len(nodes)} host(s) x {nproc} ranks "
          f"({', '.join(nodes)}), spare(s): {', '.join(spare_hosts) or 'none'}")
    return Placement(nodes=nodes, spares=spare_hosts, launcher=SlurmAgents.Config(allocation=allocation, dcgm_url=dcgm_url),
                     drain=True if drain is None else drain, nproc=nproc)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the job runs: its hosts and spares, and what that changes in its config."""

    nodes: tuple[str, ...] = NODES
    spares: tuple[str, ...] = SPARES
    overrides: tuple[str, ...] = ()
    launcher: LauncherConfig = field(default_factory=LocalAgents.Config)
    drain: bool = False
    nproc: int = 1
    """A program's ranks per host (megaheal's trainer: its config says)."""


def _placement(cfg: TrainConfig, launcher: str, spares: int, drain: bool | None,
               dcgm_url: str | None = None) -> Placement:
    """local: two hosts and a spare, the config's layout as it is. slurm: the allocation's hosts, the last `spares`
    as spares, `ranks_per_node` ranks on each; the data-parallel degree follows from them."""
    if launcher == "local":
        return Placement(drain=bool(drain))
    allocation = Allocation.from_environment()
    nodes, spare_hosts = allocation.split(spares)
    # NOTE: replica groups (ft.enabled) are one a host: the data-parallel degree is each group's own
    dp = allocation.dp(cfg, 1 if cfg.ft.enabled else len(nodes))
    layout = f"replica groups, one a host, dp {dp} in each" if cfg.ft.enabled else f"dp {dp}"
    print(f"slurm job {allocation.job_id}: {len(nodes)} host(s) x {allocation.ranks_per_node} ranks "
          f"({', '.join(nodes)}; {layout}), spare(s): {', '.join(spare_hosts) or 'none'}")
    return Placement(nodes=nodes, spares=spare_hosts, overrides=(f"parallel.dp={dp}",),
                     launcher=SlurmAgents.Config(allocation=allocation, dcgm_url=dcgm_url), drain=True if drain is None else drain)


def _run_locked(cfg: TrainConfig | None, what: str | ProgramLaunch, run_dir: Path, schedule: Schedule | None,
                timeout: timedelta | None, metrics_port: int | None, overrides: tuple[str, ...], resume: bool,
                db_url: str | None, alertmanager_url: str | None, rules: RuleSet | None, placement: Placement,
                warm: WarmSettings | None, db_password: str | None = None, preflight: bool = False,
                rescreen: timedelta | None = timedelta(minutes=10),
                ettr: GoodputCollector.Config | None = None, tune_saves: bool = False) -> int:
    """`cfg` and `what` (its path) for megaheal's trainer; None and the program's launch for a user's program."""
    # NOTE: a host holds world // hosts consecutive ranks (the launchers' placement), which a bit-flip fault names.
    per_host = cfg.parallel.world_size // max(1, len(placement.nodes)) if cfg else 1
    start_overrides = schedule.start_overrides(
        cfg.global_batch, lambda rank: placement.nodes[min(rank // per_host, len(placement.nodes) - 1)]
    ) if schedule and cfg else ()
    common = dict(run_dir=run_dir, nodes=placement.nodes, spares=placement.spares,
                  rules=rules, db_url=db_url, db_password=db_password,
                  alertmanager_url=alertmanager_url, launcher=placement.launcher, drain=placement.drain,
                  preflight=preflight, rescreen_every=rescreen)
    if isinstance(what, ProgramLaunch):
        spec = JobSpec(job=job_name(None, run_dir, resume), config=None, program=what.program,
                       nproc_per_node=placement.nproc, min_nodes=what.min_nodes, warm=warm, **common)
        world = len(placement.nodes) * placement.nproc
    else:
        assert cfg is not None
        spec = JobSpec(job=job_name(cfg.job, run_dir, resume), config=what,
                       overrides=("checkpoint.every_steps=5", *start_overrides, *overrides), warm=warm,
                       tune_saves=tune_saves, **common)
        world = cfg.parallel.world_size
    objective = Objective(ettr or GoodputCollector.Config(), RECORDED)
    write_objective(run_dir, objective.cfg)  # NOTE: once the job's name is checked, before anything of the job starts
    job = build_job(spec)
    sup = job.sup
    # NOTE: a break-node fault breaks the host's local disk from here: only where the hosts are this machine's.
    scratch_of = (lambda rank: LocalAgents.scratch_dir(run_dir, sup.node_of_rank(rank))) \
        if isinstance(placement.launcher, LocalAgents.Config) else None
    chaos = Chaos(schedule, job.remediator.signal_rank, RunPaths(run_dir).checkpoints, scratch_of=scratch_of,
                  world_size=world) if schedule else None

    def incidents() -> list[dict[str, Any]]:
        return [t.to_payload() for t in job.incidents()]

    metrics = _serve_goodput(run_dir, spec.job, incidents, metrics_port, objective.cfg)
    view = LiveView(job, chaos)
    with view.live(), Interrupts() as interrupts:
        def on_tick(j: SelfHealingJob) -> None:
            a = j.sup.attempt
            steps = [b.step for b in j.table.ranks() if a and b.pid in a.ranks and b.step is not None]
            if chaos is not None and a is not None and len(steps) == len(a.ranks) == world:
                chaos.tick(min(steps))
            view.refresh()

        looping = False
        try:
            if resume:
                job.take_over()
            else:
                job.start()
            looping = True
            # NOTE: the loop stops the job on its way out, whatever the way (Ctrl-C, SIGTERM, an error).
            outcome = job.run(timeout if timeout is not None else NO_TIMEOUT, on_tick=on_tick,
                              interrupted=interrupts.requested, hurry=interrupts.hurried)
        except Fenced as exc:
            return _leave_fenced(job, exc)
        except BaseException:
            # NOTE: BaseException: a second Ctrl-C (KeyboardInterrupt) must stop the agents as well; then re-raised.
            log.error("megaheal run: stopping the job's node agents after an error", exc_info=True)
            if not looping:  # it failed while starting: nothing else stops what did start
                job.remediator.shutdown(hurry=interrupts.hurried)
            job.keeper.stop()
            job.agents.stop()  # the job is stopped by now: its agents (their own processes) go too
            raise
        finally:
            if chaos is not None:
                chaos.close()  # a frozen rank dies only once thawed
            if metrics is not None:
                metrics.stop()
    record_states(run_dir, job.agents, [*spec.nodes, *spec.spares])  # Slurm's say on each host, for the report
    ledger = report(run_dir, incidents(), chaos=chaos.summary() if chaos is not None else None, objective=objective)
    job.close()
    html = write_html(run_dir, RunPaths(run_dir).report, db_url, db_password)
    if outcome == "interrupted":
        print(f"outcome: interrupted by {signal.Signals(interrupts.signum or signal.SIGINT).name}: the job was "
              f"stopped; go on with it: megaheal run --run-dir {run_dir} --take-over")
        print(f"html report: {html}")
        return interrupts.exit_code
    loop = job.healer.responder.crash_loop if outcome == "escalated" else None
    said = f" (crash loop: {loop['signature']}; exit {CRASH_LOOP_EXIT}, do not requeue)" if loop else ""
    print(f"outcome: {outcome}{said}; run dir {run_dir}; report {run_dir / 'report.json'}")
    print(f"html report: {html}")  # NOTE: the last line, so `make demo` ends with the page to open
    if loop is not None:
        return CRASH_LOOP_EXIT
    return 0 if outcome == "finished" and all(i["state"] == "resolved" for i in ledger.incidents) else 1

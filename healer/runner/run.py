"""`megaheal run`: one supervised, self-healing training job on this machine, with a live view.

The job runs on two "nodes" (torchrun agents, a sidecar each) plus a spare, under SelfHealLoop (crash, hang,
straggler, NaN and loss-spike detectors; node diagnostics after a crash or hang; the remediation policy; the
restart budget). With `--chaos FILE` the schedule's faults are injected into the real processes. Every incident
is journalled in the run dir and mirrored to the healer's database (`--db`, SQLite in the run dir by default)
and Alertmanager (`--alertmanager`). At the end it prints the incident table and the goodput ledger (ETTR) and
writes them to `<run_dir>/report.json`. While it runs, the same ledger is served as
Prometheus metrics (healer/runner/goodput_metrics.py) on 127.0.0.1:`--metrics-port`.
"""

from __future__ import annotations

import logging
import secrets
import time
from datetime import timedelta
from pathlib import Path

from healer.core.detectors.hang import Hang
from healer.core.detectors.nonfinite import NonFinite
from healer.core.detectors.straggler import Straggler
from healer.runner.goodput_metrics import GoodputServer
from healer.runner.report import report
from healer.core.heartbeats import HeartbeatTable
from healer.core.remediation import Budgets
from healer.core.remediation_history import NodeHistory
from healer.runner.chaos import Chaos, load_schedule
from healer.runner.incident_mirror import IncidentMirror, MirrorWorker
from healer.launchers.local import LocalLauncher
from healer.runner.selfheal import SelfHealLoop
from healer.launchers.sidecars import NodeSidecars
from healer.launchers.supervisor import Supervisor
from train.config import load_config

NODES = ("n1", "n2")
SPARES = ("n3",)


def _view(loop: SelfHealLoop, chaos: Chaos | None) -> object:
    from rich.console import Group
    from rich.table import Table

    a = loop.sup.attempt
    ranks = Table(title=f"attempt {a.number if a else '-'} on {', '.join(loop.nodes)} (dp {loop.dp})")
    for col in ("rank", "node", "step", "loss", "step s", "state"):
        ranks.add_column(col)
    states = {s.rank: s.state for s in loop.table.processes.states()}
    pids = set(a.ranks) if a else set()
    for b in sorted(loop.table.ranks(), key=lambda b: b.rank):
        if b.entry.pid not in pids:
            continue
        loss, secs = b.entry.loss, b.entry.step_seconds
        ranks.add_row(str(b.rank), b.node, str(b.step), f"{loss:.4f}" if isinstance(loss, float) else "nan",
                      f"{secs:.2f}" if isinstance(secs, float) else "-", states.get(b.rank, "?"))
    incidents = Table(title="incidents")
    for col in ("#", "kind", "suspect", "verdict", "action", "state", "summary"):
        incidents.add_column(col)
    for inc in loop.incidents[-8:]:
        suspect = ", ".join([*(f"rank {r}" for r in inc.suspect_ranks), *inc.suspect_nodes]) or "-"
        incidents.add_row(str(inc.id), inc.kind, suspect, inc.verdict or "-", inc.action or "-", inc.state,
                          inc.summary[:70])
    pending = f"chaos: {len(chaos.pending)} fault(s) to come" if chaos else "chaos: off"
    return Group(ranks, incidents, pending)


def _serve_goodput(run_dir: Path, job: str, port: int | None) -> GoodputServer | None:
    if port is None:
        return None
    server = GoodputServer(run_dir, job, port=port)
    try:
        bound = server.start()
    except OSError as exc:  # the job matters more than its metrics: say so and go on without them
        logging.getLogger(__name__).warning("goodput metrics not served on 127.0.0.1:%d: %s", port, exc)
        return None
    print(f"goodput metrics: http://127.0.0.1:{bound}/metrics")
    return server


def run_job(config: str, run_dir: Path | None, chaos_path: str | None, timeout: timedelta,
            metrics_port: int | None = None, overrides: tuple[str, ...] = (), resume: bool = False,
            db_url: str | None = None, alertmanager_url: str | None = None) -> int:
    """`resume`: take over `run_dir` from a healer that died (its incidents, budgets and nodes go on).
    `db_url`: the healer database the incidents are mirrored to [default: SQLite in the run dir];
    `alertmanager_url`: where they page from."""
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if resume and (run_dir is None or not (run_dir / "supervisor" / "attempts.jsonl").exists()):
        raise ValueError(f"--resume needs the --run-dir of a supervised run (no supervisor/attempts.jsonl in {run_dir})")
    if resume and chaos_path:
        raise ValueError("--resume takes over a run as it is: it cannot be combined with --chaos")
    cfg = load_config(config, list(overrides))
    world = cfg.parallel.world_size
    if world % len(NODES):
        raise ValueError(f"{world} ranks do not split over {len(NODES)} nodes")
    run_dir = run_dir or Path(time.strftime("runs/run-%Y%m%d-%H%M%S"))
    schedule = load_schedule(chaos_path) if chaos_path else None
    nan_overrides = schedule.start_overrides(cfg.global_batch) if schedule else ()
    token = secrets.token_hex(16)  # this run's own token: only this process may kill or restart its job
    sidecars = NodeSidecars([*NODES, *SPARES])
    table = HeartbeatTable()
    launcher = LocalLauncher(extra_env={"GLOO_SOCKET_IFNAME": "lo"})
    sup = Supervisor(Supervisor.Config(job=run_dir.resolve().name, config=config, run_dir=run_dir,
                                       nproc_per_node=world // len(NODES),
                                       overrides=("checkpoint.every_steps=5", *nan_overrides, *overrides)),
                     launcher, table.processes, token, sockets=sidecars.sockets)
    chaos = Chaos(schedule, lambda rank, sig: sup.kill_rank(token, rank, sig), run_dir / "checkpoints",
                  scratch_of=lambda rank: launcher.scratch_dir(run_dir, sup.node_of_rank(rank))) \
        if schedule else None
    run_dir.mkdir(parents=True, exist_ok=True)
    mirror = IncidentMirror.open(db_url or f"sqlite:///{(run_dir / 'healer.db').absolute()}", sup.cfg.job,
                                 alertmanager_url)
    worker = MirrorWorker(mirror, run_dir)  # the database and Alertmanager never hold up the healing
    loop = SelfHealLoop(
        SelfHealLoop.Config(nodes=NODES, spares=SPARES, dp=cfg.parallel.dp, budgets=Budgets(max_restarts=8),
                            hang=Hang.Config(floor=timedelta(seconds=10))),
        sup, sidecars, table, token, history=NodeHistory(run_dir / "node-history.json"),
        extra_detectors=[Straggler(Straggler.Config()), NonFinite(NonFinite.Config())], on_event=worker.record)
    from rich.live import Live

    metrics = _serve_goodput(run_dir, sup.cfg.job, metrics_port)
    with Live(_view(loop, chaos), refresh_per_second=2) as live:  # type: ignore[arg-type]
        def on_tick(lp: SelfHealLoop) -> None:
            a = lp.sup.attempt
            steps = [b.step for b in lp.table.ranks() if a and b.entry.pid in a.ranks and b.step is not None]
            if chaos is not None and a is not None and len(steps) == len(a.ranks) == world:
                chaos.tick(min(steps))
            live.update(_view(lp, chaos))  # type: ignore[arg-type]

        worker.start()
        try:
            if resume:
                loop.take_over()
            else:
                loop.start()
            outcome = loop.run(timeout, on_tick=on_tick)
        finally:
            if metrics is not None:
                metrics.stop()
            worker.stop()
            mirror.close()
    ledger = report(run_dir)
    print(f"outcome: {outcome}; run dir {run_dir}; report {run_dir / 'report.json'}")
    return 0 if outcome == "finished" and all(i["state"] == "resolved" for i in ledger.incidents) else 1

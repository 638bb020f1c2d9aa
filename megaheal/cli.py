"""The `megaheal` command. Subcommands grow with the project: `train` launches a training job."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional, TypeVar

import typer

from ground.typedconfig import ConfigError

if TYPE_CHECKING:  # NOTE: the CLI imports what each command needs when it runs
    from pathlib import Path

    from healer.ledger.metrics import GoodputCollector
    from healer.runner.run import ProgramLaunch

# NOTE: rich_markup_mode=None: with rich markup, Typer read the help's "[default: hostname]" notes as markup tags and
# dropped them; plain help also keeps every default on the option's own line, where grep finds it.
app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                  help="Keep large distributed training jobs healthy.")

T = TypeVar("T")
LogLevel = Annotated[str, typer.Option("--log-level", help="debug, info, warning, error or critical")]
LogFormat = Annotated[str, typer.Option("--log-format", help="text, or json: one JSON object a line (time, level, "
                                        "logger, message, exception)")]


def _logging(level: str, fmt: str) -> None:
    """Set up the process's logging (ground/logsetup.py); a bad --log-level or --log-format exits 2."""
    from ground.logsetup import configure

    try:
        configure(level, fmt)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


def _renamed(old: str, new: str, old_value: T, new_value: T) -> T:
    """The value of an option given under its old name (a warning says the new one); exits 2 when both are given."""
    if old_value is None or old_value is False:
        return new_value
    if new_value is not None and new_value is not False:
        typer.echo(f"error: {old} is the old name of {new}: give {new} only", err=True)
        raise typer.Exit(2)
    typer.echo(f"warning: {old} is deprecated and goes in a later release: use {new}", err=True)
    return old_value


def _register_subapps() -> None:
    from train.checkpoint.inspect import app as ckpt_app  # typer and the stdlib only: cheap to import

    app.add_typer(ckpt_app, name="ckpt")
    from healer.service.cli import db_app  # typer only at import: cheap

    app.add_typer(db_app, name="db")
    from dashboards.cli import app as dashboards_app  # typer only at import; the SDK and grafana-client load lazily

    app.add_typer(dashboards_app, name="dashboards")
    from testbed.cli import app as testbed_app  # typer and the stdlib only: cheap to import

    app.add_typer(testbed_app, name="testbed")
    from healer.service.incidents_cli import app as incidents_app  # typer and the stdlib only at import

    app.add_typer(incidents_app, name="incidents")


_register_subapps()


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"megaheal {version('megaheal')}")
        except PackageNotFoundError as exc:  # imported from a source tree that was never installed
            typer.echo("error: megaheal is not installed here (pip install megaheal, or -e . in a checkout)", err=True)
            raise typer.Exit(2) from exc
        raise typer.Exit()


@app.callback()
def _root(
    _version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True, help="print megaheal's version and exit")] = False,
) -> None:
    """Keep large distributed training jobs healthy."""


@app.command()
def train(
    config: Annotated[str, typer.Option("--config", help="training config YAML (see configs/)")],
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="output directory [default: runs/<timestamp>]")] = None,
    overrides: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a config key, e.g. steps=6 (repeatable)")
    ] = None,
    resume: Annotated[
        Optional[str], typer.Option("--resume", help="auto: the newest good checkpoint; or a checkpoint path")
    ] = None,
) -> None:
    """Train on this machine: one torchrun process per rank (pp x dp x tp of the config)."""
    from train.launch import launch  # imports torch: keep `megaheal --help` fast

    sets = list(overrides or []) + ([f"checkpoint.resume={resume}"] if resume else [])
    try:
        code = launch(config, sets, run_dir)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


@app.command()
def sidecar(
    node: Annotated[Optional[str], typer.Option("--node", help="node name in metrics and heartbeats [default: hostname]")] = None,
    socket_path: Annotated[Optional[str], typer.Option("--socket", help="rank socket; ranks get it as MEGAHEAL_SIDECAR_SOCKET [default: $TMPDIR/megaheal-UID/sidecar.sock]")] = None,
    metrics_addr: Annotated[str, typer.Option("--metrics-addr", help="HOST:PORT of /metrics (loopback unless told otherwise)")] = "127.0.0.1:9471",
    healer_url: Annotated[Optional[str], typer.Option("--healer-url", help="healer base URL for heartbeat batches")] = None,
    relay_url: Annotated[Optional[str], typer.Option("--relay-url", help="this node group's relay (megaheal relay); the healer while it is down")] = None,
    token_file: Annotated[Optional[str], typer.Option("--token-file", help="file with the healer's bearer token [default: MEGAHEAL_TOKEN]")] = None,
    otlp_endpoint: Annotated[Optional[str], typer.Option("--otlp-endpoint", help="OTLP/HTTP collector URL for step traces [default: none: no traces]")] = None,
    dcgm_url: Annotated[Optional[str], typer.Option("--dcgm-url", help="read GPUs from this dcgm-exporter /metrics instead of NVML [default: none: NVML]")] = None,
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
    old_token_file: Annotated[Optional[str], typer.Option("--healer-token-file", hidden=True, help="the old name of --token-file")] = None,
) -> None:
    """Run this node's telemetry sidecar: rank records in, /metrics, heartbeats and traces out."""
    import socket

    from exporters.dcgm_scrape import DcgmScrape
    from exporters.receiver import SocketInUseError
    from exporters.sidecar import Sidecar, default_socket_path  # prometheus/otel: imported only here
    from ground.secretfile import forbid_inspection

    _logging(log_level, log_format)
    token_file = _renamed("--healer-token-file", "--token-file", old_token_file, token_file)
    # NOTE: the ranks run under the sidecar's uid: keep them out of its memory and mounts (the token) in /proc.
    forbid_inspection()
    try:
        cfg = Sidecar.Config(node=node or socket.gethostname(), socket_path=socket_path or default_socket_path(),
                             metrics_addr=metrics_addr, healer_url=healer_url, relay_url=relay_url,
                             healer_token_file=token_file,
                             otlp_endpoint=otlp_endpoint,
                             dcgm=DcgmScrape.Config(url=dcgm_url) if dcgm_url else None)
        service = Sidecar(cfg)
    except (ValueError, SocketInUseError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    try:
        service.serve_forever()
    except OSError as exc:  # e.g. the metrics port is taken
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


@app.command()
def relay(
    healer_url: Annotated[str, typer.Option("--healer-url", help="the healer's base URL (batches go to its /v1/heartbeats/relayed)")],
    token_file: Annotated[str, typer.Option("--token-file", help="file with the healer's bearer token (the nodes send it too)")],
    name: Annotated[Optional[str], typer.Option("--name", help="the relay's name in the healer's view [default: hostname]")] = None,
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT the nodes post to (loopback unless told otherwise)")] = "127.0.0.1:9410",
    interval: Annotated[float, typer.Option("--interval", help="seconds between two posts to the healer")] = 1.0,
    max_nodes: Annotated[int, typer.Option("--max-nodes", help="nodes held at most")] = 1024,
    tls_dir: Annotated[Optional[str], typer.Option("--tls-dir", help="the relay's ca.pem, cert.pem and key.pem from the run's authority (megaheal run's RUN_DIR/launcher/tls/relays/NAME): hosts' batches in and the relayed batch out over mutual TLS [default: none: plain HTTP]")] = None,
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
) -> None:
    """Pass a node group's heartbeat batches on to the healer, one request per interval (jobs of thousands of nodes)."""
    import socket
    from pathlib import Path

    from exporters.relay import HeartbeatRelay
    from exporters.relay_service import serve
    from ground.secretfile import forbid_inspection, read_secret
    from ground.tls import TlsFiles

    _logging(log_level, log_format)
    forbid_inspection()
    try:
        files = TlsFiles(Path(tls_dir)).check() if tls_dir else None
        relay_ = HeartbeatRelay(name or socket.gethostname(), healer_url, read_secret(token_file, "healer token"),
                                interval_s=interval, max_nodes=max_nodes, tls=files.client() if files else None)
        serve(relay_, listen, files.server(require_peer=True) if files else None)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command("relay-cert")
def relay_cert(
    run_dir: Annotated[str, typer.Option("--run-dir", help="the run of `megaheal run` whose authority issues it")],
    name: Annotated[str, typer.Option("--name", help="the relay's name (its --name)")],
) -> None:
    """Issue a relay a certificate from a run's authority; prints the directory to give `megaheal relay --tls-dir`."""
    from pathlib import Path

    from healer.launchers.run_authority import RunAuthority
    from wire.run_paths import RunPaths

    launcher = RunPaths(Path(run_dir)).launcher
    if not (launcher / "tls" / "ca.key").is_file():
        typer.echo(f"error: {launcher / 'tls'} holds no authority: is {run_dir} a run of `megaheal run`?", err=True)
        raise typer.Exit(2)
    try:
        typer.echo(str(RunAuthority.of_run(launcher).relay(name).directory))
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def watch(
    run_dir: Annotated[str, typer.Option("--run-dir", help="the run of `megaheal run` whose healer it watches (on a filesystem this host shares)")],
    batch_host: Annotated[str, typer.Option("--batch-host", help="the host the healer runs on (the batch script's, $SLURMD_NODENAME there)")],
    after_s: Annotated[float, typer.Option("--after-s", help="seconds without an answer from the healer before its host is asked about")] = 10.0,
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
) -> None:
    """Under Slurm, on another host of the allocation: hand the job to a successor job when the healer's host is lost
    (deploy/slurm/megaheal.sbatch starts it; healer/runner/watch.py says how)."""
    from datetime import timedelta
    from pathlib import Path

    from ground.slurm import SlurmError
    from healer.runner.watch import watch as run_watch

    _logging(log_level, log_format)
    try:
        code = run_watch(Path(run_dir), batch_host, after=timedelta(seconds=after_s))
    except (ValueError, SlurmError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


@app.command()
def agent(
    token_file: Annotated[str, typer.Option("--token-file", help="file holding the job's token (orders need it; batches carry it)")],
    work_dir: Annotated[str, typer.Option("--work-dir", help="the agent's own directory (each attempt's logs of this host)")],
    node: Annotated[Optional[str], typer.Option("--node", help="this host's name [default: hostname]")] = None,
    listen: Annotated[str, typer.Option("--listen", help="HOST:PORT of the orders API (loopback unless told otherwise; port 0: any)")] = "127.0.0.1:0",
    advertise: Annotated[Optional[str], typer.Option("--advertise", help="HOST:PORT the healer reaches the API at, when not --listen's")] = None,
    healer_url: Annotated[Optional[str], typer.Option("--healer-url", help="the healer's base URL for the batches")] = None,
    relay_url: Annotated[Optional[str], typer.Option("--relay-url", help="this host's node-group relay (megaheal relay); the healer while it is down")] = None,
    socket_path: Annotated[Optional[str], typer.Option("--socket", help="the ranks' datagram socket [default: one per node and work directory under $TMPDIR, the same for an agent started again]")] = None,
    scratch_dir: Annotated[Optional[str], typer.Option("--scratch-dir", help="the host's local disk: the ranks' TMPDIR [default: WORK_DIR/tmp]")] = None,
    metrics_addr: Annotated[str, typer.Option("--metrics-addr", help="HOST:PORT of /metrics")] = "127.0.0.1:0",
    dcgm_url: Annotated[Optional[str], typer.Option("--dcgm-url", help="read GPUs from this dcgm-exporter /metrics instead of NVML [default: none: NVML]")] = None,
    url_file: Annotated[Optional[str], typer.Option("--url-file", help="write the orders API's URL here once it serves")] = None,
    orphan_exit_s: Annotated[float, typer.Option("--orphan-exit-s", help="exit after this long with nothing heard from the healer while no rank runs here (0: never)")] = 300.0,
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="the run directory this agent serves: a start order's run dir, config and resume path must be inside it (or the checkout, for a config)")] = None,
    tls_dir: Annotated[Optional[str], typer.Option("--tls-dir", help="this host's ca.pem, cert.pem and key.pem from the run's authority: orders and batches over mutual TLS [default: none: plain HTTP]")] = None,
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
) -> None:
    """Run this host's node agent: the sidecar, the host's rank processes, and the healer's orders."""
    import socket
    from pathlib import Path

    from exporters.dcgm_scrape import DcgmScrape
    from ground.secretfile import check_token, read_secret, replace_private
    from healer.agent.node import NodeAgent, agent_socket_path
    from healer.compose_agent import node_agent as compose_node_agent

    _logging(log_level, log_format)
    try:
        token = check_token(read_secret(token_file, "job token"), token_file)
        work = Path(work_dir)
        scratch = Path(scratch_dir) if scratch_dir else work / "tmp"
        name = node or socket.gethostname()
        cfg = NodeAgent.Config(node=name, listen=listen, advertise=advertise, healer_url=healer_url,
                               relay_url=relay_url, token=token,
                               work_dir=work, scratch_dir=scratch,
                               socket_path=socket_path or agent_socket_path(name, work), metrics_addr=metrics_addr,
                               orphan_exit_s=orphan_exit_s, tls_dir=Path(tls_dir) if tls_dir else None,
                               run_dir=Path(run_dir) if run_dir else None)
        node_agent = compose_node_agent(cfg, dcgm=DcgmScrape.Config(url=dcgm_url) if dcgm_url else None)
    except (OSError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if url_file:
        import threading

        def write_url() -> None:
            while not node_agent.url:
                threading.Event().wait(0.02)
            # Whole or not at all: the launcher may read it from another host (a shared filesystem) at any moment.
            replace_private(Path(url_file), node_agent.url + "\n")

        threading.Thread(target=write_url, daemon=True).start()
    node_agent.serve_forever()


@app.command()
def timeline(
    run_dir: Annotated[str, typer.Argument(help="run directory (with ranks/*.jsonl)")],
    out: Annotated[str, typer.Option("-o", "--out", help="trace file to write (Chrome/Perfetto JSON)")] = "trace.json",
    first_step: Annotated[int, typer.Option("--first-step", help="first step to include")] = 0,
    last_step: Annotated[Optional[int], typer.Option("--last-step", help="last step to include [default: all]")] = None,
) -> None:
    """Write a Chrome/Perfetto timeline of every rank's steps and phases, ranks ordered by (pp, dp, tp)."""
    from pathlib import Path

    from exporters.timeline import write_timeline

    try:
        counts = write_timeline(Path(run_dir), Path(out), first_step, last_step)
    except (FileNotFoundError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"wrote {out}: {counts['ranks']} ranks, {counts['events']} events"
               + (f", {counts['skipped_lines']} unreadable lines skipped" if counts["skipped_lines"] else ""))


@app.command()
def diagnose(
    runbook: Annotated[Optional[str], typer.Argument(help="a shipped runbook (collectives-quick, network-triage, gpu-triage, hang-triage, straggler-triage, node-health, node-health-live) or a runbook .yaml")] = None,
    nodes: Annotated[Optional[list[str]], typer.Option("--nodes", help="nodes under test, comma-separated or repeated; inside a Slurm allocation the ranks run on them through srun, elsewhere each is simulated by local ranks")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON on stdout")] = False,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="override a step parameter, e.g. host.checkpoint_dir=/ckpt (repeatable)")] = None,
    baselines: Annotated[Optional[str], typer.Option("--baselines", help="baseline file [default: $XDG_STATE_HOME/megaheal/baselines.json]")] = None,
    calibrate: Annotated[bool, typer.Option("--calibrate", help="measure and store baselines (RUNBOOK, or collectives-quick and network-triage)")] = False,
    repeats: Annotated[int, typer.Option("--repeats", help="runs per runbook when calibrating; the median is stored")] = 3,
) -> None:
    """Run a diagnostic runbook on this machine; exit 0 pass, 1 degraded or fail, 2 error."""
    from runbooks.cli import diagnose as run_diagnose  # keep `megaheal --help` fast

    raise typer.Exit(run_diagnose(runbook, nodes or [], as_json, overrides or [], baselines, calibrate, repeats))


@app.command(context_settings={"allow_interspersed_args": False})
def run(
    program: Annotated[Optional[list[str]], typer.Argument(help="SCRIPT.py [ARGS...], or with -m MODULE [ARGS...]: your own training program, started on every rank as torchrun starts it (docs/your-trainer.md); without it, megaheal's own trainer with --config", show_default=False)] = None,
    module: Annotated[bool, typer.Option("-m", "--module", help="the program is a module (python -m), as torchrun's -m")] = False,
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", help="a program's ranks per host [default: local 1; slurm: the allocation's tasks per node]")] = None,
    nnodes: Annotated[Optional[str], typer.Option("--nnodes", help="a program's hosts: N, or MIN:MAX to come back on as few as MIN when no spare is left [default: local 1; slurm: the allocation's less the spares]")] = None,
    config: Annotated[Optional[str], typer.Option("--config", help="megaheal's own trainer: its training config YAML [default: the shipped configs/demo.yaml]")] = None,
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="run directory [default: runs/run-<time>]")] = None,
    chaos: Annotated[Optional[str], typer.Option("--chaos", help="fault schedule YAML (configs/chaos-*.yaml)")] = None,
    timeout_min: Annotated[Optional[float], typer.Option("--timeout-min", help="stop the job after this many minutes [default: none: it runs until it finishes, escalates or is stopped]")] = None,
    metrics_port: Annotated[int, typer.Option("--metrics-port", help="serve the goodput ledger as Prometheus metrics on 127.0.0.1:PORT (0: any free port, -1: off)")] = 9472,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="training config override KEY=VALUE (repeatable), e.g. steps=20")] = None,
    take_over: Annotated[bool, typer.Option("--take-over", help="take over --run-dir from a `megaheal run` that died: stop what it left running and finish its incidents (a checkpoint to resume from: --set checkpoint.resume=auto|PATH)")] = False,
    db: Annotated[Optional[str], typer.Option("--db", help="the healer's database (incidents, host history, restarts, goodput): sqlite:///PATH or postgresql+psycopg://... [default: RUN_DIR/healer.db]")] = None,
    db_password_file: Annotated[Optional[str], typer.Option("--db-password-file", help="file holding the database's password (kept out of the URL, the environment and every command line)")] = None,
    alertmanager: Annotated[Optional[str], typer.Option("--alertmanager", help="Alertmanager URL; an escalated incident pages from there [default: none]")] = None,
    rules: Annotated[Optional[list[str]], typer.Option("--rules", help="rule file or directory (repeatable) [default: configs/rules/, every detector]")] = None,
    launcher: Annotated[str, typer.Option("--launcher", help="local: the hosts are agents on this machine; slurm: the hosts of the Slurm allocation this runs in (sbatch, salloc), an agent per host via srun")] = "local",
    spares: Annotated[int, typer.Option("--spares", help="slurm: keep the allocation's last N hosts as spares")] = 1,
    drain: Annotated[Optional[bool], typer.Option("--drain/--no-drain", help="drain in the scheduler a host left out because it failed diagnosis or is a lemon [default: on under slurm]")] = None,
    preflight: Annotated[bool, typer.Option("--preflight/--no-preflight", help="screen every host and spare (the preflight runbook, ~1 s a host here, bounded at ~15 s) before the first attempt: a host that fails is left out, a spare that passed takes its place, and it is drained where the run drains")] = True,
    rescreen_min: Annotated[float, typer.Option("--rescreen-min", help="screen the idle spares and the hosts left out again every this many minutes: one that passes is a spare again (resumed in the scheduler where megaheal drained it), and a job that came back smaller grows back onto it (0: never)")] = 10.0,
    warm: Annotated[bool, typer.Option("--warm/--cold", help="warm: the ranks are workers that outlive an attempt, and every host (spares too) keeps standbys, so a crashed or hung rank, a rollback, or a lost host replaced by a spare restarts from the state held in memory (a lost host's from its replicas on the next host) in seconds; cold: every restart starts new processes from the newest checkpoint; under both launchers; a take-over (--take-over) of a warm run restarts it cold")] = False,
    standbys: Annotated[int, typer.Option("--standbys", help="warm: idle workers each host keeps ready to take a crashed rank's place")] = 1,
    dcgm_url: Annotated[Optional[str], typer.Option("--dcgm-url", help="slurm: each host's agent reads its GPUs from the dcgm-exporter at this URL as that host sees it, e.g. http://127.0.0.1:9400/metrics [default: none: NVML]")] = None,
    ettr_target: Annotated[Optional[float], typer.Option("--ettr-target", help="the job's ETTR objective (productive / wall time, a fraction > 0 and < 1), served with the goodput ledger and recorded in the run directory for its report: Prometheus pages on-call when the job spends its error budget (1 - target) too fast, not for each healed incident (docs/operations.md, \"The job's ETTR objective\") [default: 0.95; --take-over: the run's own]")] = None,
    ettr_window: Annotated[Optional[str], typer.Option("--ettr-window", help="the rolling window the ETTR objective is judged over, e.g. 7d or 36h [default: 7d; --take-over: the run's own]")] = None,
    tune_saves: Annotated[bool, typer.Option("--tune-saves/--fixed-saves", help="megaheal's trainer: at each restart that loses work, move its save interval (and with --warm its snapshot interval) toward the optimum for the failures the job has had and the stall each save measured, within 30 s to 2 h of training, each move journalled (docs/operations.md, \"Save intervals that follow the failures\")")] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error or critical (the live view holds the terminal: warning and up by default)")] = "warning",
    log_format: LogFormat = "text",
    old_resume: Annotated[bool, typer.Option("--resume", hidden=True, help="the old name of --take-over")] = False,
) -> None:
    """Run a self-healing training job: node agents, launcher, detectors, remediation, live view, report."""
    from datetime import timedelta
    from pathlib import Path

    from ground.shipped import shipped_config
    from ground.slurm import SlurmError
    from healer.errors import DatabaseError
    from healer.launchers.preflight import PreflightError
    from healer.runner.run import run_job  # torch, rich: imported only here
    from healer.runner.shutdown import RunDirBusy
    from healer.service.config import read_db_password

    _logging(log_level, log_format)
    take_over = _renamed("--resume", "--take-over", old_resume, take_over)
    try:
        if timeout_min is not None and not timeout_min > 0:
            raise ValueError(f"--timeout-min must be > 0, got {timeout_min}")
        if not rescreen_min >= 0:
            raise ValueError(f"--rescreen-min must be >= 0, got {rescreen_min}")
        launch = _program_launch(program or [], module, nproc_per_node, nnodes, config)
        ettr = _ettr_objective(ettr_target, ettr_window, Path(run_dir) if take_over and run_dir else None)
        password = read_db_password(db_password_file)
        code = run_job(config or str(shipped_config("demo.yaml")), Path(run_dir) if run_dir else None, chaos,
                       timedelta(minutes=timeout_min) if timeout_min is not None else None,
                       metrics_port=None if metrics_port < 0 else metrics_port, overrides=tuple(overrides or ()),
                       resume=take_over, db_url=db, alertmanager_url=alertmanager, rules=tuple(rules or ()),
                       launcher=launcher, spares=spares, drain=drain,
                       standbys=standbys if warm else None, program=launch, db_password=password,
                       dcgm_url=dcgm_url, preflight=preflight,
                       rescreen=timedelta(minutes=rescreen_min) if rescreen_min > 0 else None, ettr=ettr,
                       tune_saves=tune_saves)
    except (ConfigError, ValueError, DatabaseError, RunDirBusy, SlurmError, PreflightError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)


def _ettr_objective(target: float | None, window: str | None,
                    taken_over: Path | None) -> GoodputCollector.Config | None:
    """The objective `megaheal run` was given: None where neither option was (a new run's defaults, a take-over's
    recorded one); one given alone is set on those. ValueError naming the option that is wrong; ConfigError naming
    the file where a taken-over run's objective file is not one."""
    from dataclasses import replace

    from ground.typedconfig import parse_duration
    from healer.ledger.metrics import GoodputCollector
    from healer.ledger.objective import read_objective

    if target is None and window is None:
        return None
    given: dict[str, Any] = {"ettr_target": target} if target is not None else {}
    if window is not None:
        given["ettr_window"] = parse_duration(window, "--ettr-window")
    base = read_objective(taken_over).cfg if taken_over is not None else GoodputCollector.Config()
    try:
        return replace(base, **given)
    except ValueError as exc:  # NOTE: its messages start with the field's name, the option's: --ettr-target
        raise ValueError("--" + str(exc).replace("_", "-", 1)) from exc


def _program_launch(words: list[str], module: bool, nproc_per_node: int | None, nnodes: str | None,
                    config: str | None) -> ProgramLaunch | None:
    """`megaheal run`'s program in torchrun's shape, or None for megaheal's own trainer. ValueError naming the
    option or the argument that is wrong."""
    from pathlib import Path

    from healer.runner.run import ProgramLaunch
    from wire.orders import UserProgram

    if not words:
        if module or nnodes is not None or nproc_per_node is not None:
            raise ValueError("-m, --nnodes and --nproc-per-node describe a program: give SCRIPT.py or -m MODULE")
        return None
    if config is not None:
        raise ValueError("--config is megaheal's own trainer; a script or module takes its own arguments")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    target = words[0]
    if not module:
        script = Path(target).absolute()
        if not script.is_file():
            raise ValueError(f"no script at {target} (to run a module, give -m MODULE)")
        target = str(script)
    n, low = ProgramLaunch.parse_nnodes(nnodes) if nnodes is not None else (None, None)
    program = UserProgram(module=module, target=target, args=list(words[1:]), cwd=str(Path.cwd()))
    return ProgramLaunch(program=program, nproc_per_node=nproc_per_node, nnodes=n, min_nodes=low)


@app.command()
def report(
    run_dir: Annotated[str, typer.Argument(help="run directory of a supervised run")],
    db: Annotated[Optional[str], typer.Option("--db", help="the healer's database the run used [default: RUN_DIR/healer.db]")] = None,
    db_password_file: Annotated[Optional[str], typer.Option("--db-password-file", help="file holding the database's password")] = None,
    html: Annotated[Optional[str], typer.Option("--html", help="also write the run's pages as one self-contained HTML file here")] = None,
) -> None:
    """Print a supervised run's incidents and goodput ledger (ETTR); write them to RUN_DIR/report.json."""
    from pathlib import Path

    from healer.errors import DatabaseError
    from healer.runner.report import load_incidents, write_html
    from healer.runner.report import report as make_report
    from healer.service.config import read_db_password

    try:
        password = read_db_password(db_password_file)
        make_report(Path(run_dir), load_incidents(Path(run_dir), db, password))
        if html:
            typer.echo(f"html report: {write_html(Path(run_dir), Path(html), db, password)}")
    except (FileNotFoundError, ValueError, DatabaseError, ConfigError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc


@app.command()
def simulate(
    config: Annotated[Optional[str], typer.Option("--config", help="simulation config YAML (configs/sim/) [default: the shipped configs/sim/llama3-16k.yaml]")] = None,
    overrides: Annotated[Optional[list[str]], typer.Option("--set", help="override a config key, e.g. job.spares=64 or restart=cold (repeatable)")] = None,
    sweeps: Annotated[bool, typer.Option("--sweeps", help="also the sweeps (checkpoint interval, failure rate, job size, restart time), the analytic check and the plots")] = False,
    out: Annotated[str, typer.Option("--out", help="where simulation.json (and the plots) go")] = "runs/sim",
) -> None:
    """Simulate a long job on a large cluster, its failures healed by megaheal's own policy: ETTR, lost GPU-hours, pages."""
    from pathlib import Path

    from ground.shipped import shipped_config
    from sim.report import simulate as run_simulation
    from sim.report import summary

    try:
        config = config or str(shipped_config("sim/llama3-16k.yaml"))
        result = run_simulation(config, list(overrides or []), Path(out), sweeps)
    except (ConfigError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(summary(result))
    typer.echo(f"written: {Path(out) / 'simulation.json'}" + (f" and {len(result['plots'])} plot(s)"
                                                               if isinstance(result.get("plots"), list) else ""))
    if isinstance(result.get("plots"), str):
        typer.echo(f"plots: {result['plots']}", err=True)


@app.command()
def healer(
    config: Annotated[Optional[str], typer.Option("--config", help="healer config YAML [default: built-in defaults, rules from configs/rules/]")] = None,
    listen: Annotated[Optional[str], typer.Option("--listen", help="HOST:PORT of the API [default: 127.0.0.1:8470]")] = None,
    db: Annotated[Optional[str], typer.Option("--db", help="database URL: sqlite:///PATH or postgresql+psycopg://... [default: MEGAHEAL_DB, else SQLite in the state dir]")] = None,
    token_file: Annotated[Optional[str], typer.Option("--token-file", help="file with the API bearer token; it wins over the config's token_file, which wins over MEGAHEAL_TOKEN [default: the config's token_file, else MEGAHEAL_TOKEN, else one generated into $XDG_STATE_HOME/megaheal/token]")] = None,
    log_level: LogLevel = "info",
    log_format: LogFormat = "text",
) -> None:
    """Run the healer: heartbeats and Alertmanager in, incidents out (API on 127.0.0.1:8470)."""
    from healer.service.cli import healer as run_healer  # SQLAlchemy, Starlette, APScheduler: imported only here

    _logging(log_level, log_format)
    run_healer(config, listen, db, token_file)

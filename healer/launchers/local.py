"""Launchers: how a job's nodes are started. The supervisor asks for "this attempt of the job on these nodes"
and gets one handle per node back; a Slurm backend (`srun --nodelist ... --exclude ...`) fits the same
interface. `LocalLauncher` runs each "node" as one torchrun agent on this machine (c10d rendezvous on
loopback), which is what tests and the demo use.

Everything is an argument list (no shell); nothing from a heartbeat or an alert reaches it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from megaheal.names import check_name

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class LaunchSpec:
    """One attempt of a job on a set of nodes."""

    job: str
    """The job's name (what its ranks report as `job`)."""
    attempt: int
    """0 for the first start, +1 per restart."""
    nodes: tuple[str, ...]
    """The nodes to run on, in node-rank order."""
    nproc_per_node: int
    """Ranks per node."""
    config: str
    """Training config path."""
    overrides: tuple[str, ...] = ()
    """`--set KEY=VALUE` items (the dp degree of a smaller job goes here)."""
    run_dir: Path
    """The run directory every attempt shares (checkpoints, per-rank JSON lines)."""
    resume: str | None = "auto"
    """`--resume` for the ranks: auto (the newest good checkpoint), a checkpoint path, or None."""
    sockets: dict[str, str] = field(default_factory=dict)
    """Per node, its sidecar's socket (the ranks' MEGAHEAL_SIDECAR_SOCKET)."""

    def __post_init__(self) -> None:
        check_name(self.job, "job")
        if not self.nodes:
            raise ValueError("nodes must name at least one node")
        for node in self.nodes:
            check_name(node, "node")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"nodes must be distinct, got {list(self.nodes)}")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {self.attempt}")

    @property
    def run_id(self) -> str:
        """torchrun's rendezvous id of this attempt, which every worker carries (TORCHELASTIC_RUN_ID)."""
        return f"{self.job}-{self.attempt}"

    @property
    def attempt_dir(self) -> Path:
        return self.run_dir / "supervisor" / f"attempt-{self.attempt:03d}"


@dataclass(slots=True)
class NodeHandle:
    """A started node: its agent process and where its logs go."""

    node: str
    node_rank: int
    process: subprocess.Popen[bytes]
    log_path: Path
    """The agent's own output (its failure report included)."""
    rank_log_dir: Path
    """torchrun's --log-dir: one stdout/stderr file per local rank."""
    _log: IO[bytes] | None = None

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class Launcher(ABC):
    @abstractmethod
    def start(self, spec: LaunchSpec) -> list[NodeHandle]:
        """Start every node of `spec`; the handles are in node-rank order."""

    @abstractmethod
    def run_on(self, node: str, run_dir: Path, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        """Run the megaheal command `args` (e.g. a runbook) on `node`, in the environment its ranks get.
        Past `timeout_s` the command and everything it started are killed and TimeoutError is raised."""


def free_port(host: str = "127.0.0.1") -> int:
    # NOTE: a small race (another process may take the port before the agent binds it); a failed rendezvous
    # shows as a failed start, which the supervisor reports like any other.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass(kw_only=True, slots=True)
class LocalLauncher(Launcher):
    """Each node is a torchrun agent on this machine; they meet in a c10d rendezvous on loopback."""

    host: str = "127.0.0.1"
    """Rendezvous address."""
    python: str = sys.executable
    """The interpreter that runs torchrun and the ranks."""
    cwd: Path = field(default_factory=Path.cwd)
    """Where the agents run (the repository, so `-m train` imports)."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to every rank's environment (e.g. GLOO_SOCKET_IFNAME=lo)."""
    shutdown_timeout_s: int = 1
    """torchrun's SIGTERM-to-SIGKILL grace for the surviving ranks when one fails."""

    @staticmethod
    def scratch_dir(run_dir: Path, node: str) -> Path:
        """The node's local disk: its ranks' TMPDIR (what a node-local NVMe is on a cluster)."""
        return run_dir / "nodes" / node / "tmp"

    def node_env(self, run_dir: Path, node: str) -> dict[str, str]:
        env = dict(os.environ) | self.extra_env
        env.setdefault("OMP_NUM_THREADS", "1")
        env["MEGAHEAL_NODE"] = node
        env["TMPDIR"] = str(self.scratch_dir(run_dir, node).absolute())
        return env

    def run_on(self, node: str, run_dir: Path, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        argv = [self.python, "-m", "megaheal", *args]
        with subprocess.Popen(argv, cwd=self.cwd, env=self.node_env(run_dir, node), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) as proc:
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                # The command is its own process group (start_new_session): take down whatever it forked too.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.communicate()
                raise TimeoutError(f"{' '.join(args[:2])} on {node} ran past {timeout_s:g} s") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def argv(self, spec: LaunchSpec, node_rank: int, port: int, rank_log_dir: Path) -> list[str]:
        argv = [self.python, "-m", "torch.distributed.run",
                "--nnodes", str(len(spec.nodes)), "--node-rank", str(node_rank),
                "--nproc-per-node", str(spec.nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.host}:{port}",
                "--rdzv-id", spec.run_id,
                # The first node hosts the rendezvous store; the others only connect to it.
                "--rdzv-conf", f"is_host={'true' if node_rank == 0 else 'false'},join_timeout=120",
                # NOTE: no restarts inside torchrun: the supervisor decides (and may change the node set).
                "--max-restarts", "0", "--monitor-interval", "0.2",
                # NOTE: when a rank dies the agent stops the others (they are stuck in a collective with the dead
                # one) and only then reports every rank's exit status: a short grace makes that report, which says
                # how the rank died, arrive within a second or two.
                "--shutdown-timeout", str(self.shutdown_timeout_s),
                "--log-dir", str(rank_log_dir), "--redirects", "3", "--tee", "3",
                "-m", "train", "--config", spec.config, "--run-dir", str(spec.run_dir)]
        if spec.resume:
            argv += ["--resume", spec.resume]
        for item in spec.overrides:
            argv += ["--set", item]
        return argv

    def start(self, spec: LaunchSpec) -> list[NodeHandle]:
        port = free_port(self.host)
        spec.attempt_dir.mkdir(parents=True, exist_ok=True)
        handles = []
        for node_rank, node in enumerate(spec.nodes):
            try:
                self.scratch_dir(spec.run_dir, node).mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # a broken local disk: the ranks start anyway; diagnostics will say why
                log.warning("scratch directory of %s unusable: %s", node, exc)
            env = self.node_env(spec.run_dir, node)
            if node in spec.sockets:
                env["MEGAHEAL_SIDECAR_SOCKET"] = spec.sockets[node]
            log_path = spec.attempt_dir / f"{node}.log"
            rank_logs = spec.attempt_dir / f"{node}-ranks"
            agent_log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the agent; closed on its exit
            process = subprocess.Popen(self.argv(spec, node_rank, port, rank_logs), cwd=self.cwd, env=env,
                                       stdin=subprocess.DEVNULL, stdout=agent_log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            handles.append(NodeHandle(node=node, node_rank=node_rank, process=process, log_path=log_path,
                                      rank_log_dir=rank_logs, _log=agent_log))
        return handles

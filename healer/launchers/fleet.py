"""What a launcher is to `megaheal run`: the set of node agents of a job (one per host, healer/agent/), started,
found again and ended by some means of the cluster's. Everything else (attempts, orders, signals, runbooks) goes
through the agents themselves (healer/launchers/coordinator.py), so the healer's code is the same everywhere.

- local (healer/launchers/local_agents.py): every host is an agent process on this machine;
- slurm (healer/launchers/slurm_agents.py): one agent per host of the allocation, started with srun; a host can be
  drained so that the scheduler keeps other jobs off it too.

Each is chosen by its own nested Config in the run's spec (healer/launchers/launchers.py holds which Config is whose);
a new launcher is a module with an AgentFleet, its Config and `for_run`, and one line there.
"""

from __future__ import annotations

import ssl
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ground.names import name_path
from healer.launchers.run_authority import RunAuthority
from wire.run_paths import RunPaths


class AgentFleet(Protocol):
    healer_url: str
    """Where the agents post their batches (the runner's report endpoint); set before `start` or `adopt`."""
    epoch: int
    """The healer's epoch (healer/incidents/epochs.py), in the orders the launcher sends itself (report, shutdown);
    set before `start` or `adopt`."""

    @property
    def hosts_are_local(self) -> bool:
        """Whether every host's processes are this machine's (what a dead agent left can be killed from here)."""
        ...

    def start(self, nodes: list[str]) -> dict[str, str]:
        """Start an agent on each of `nodes` and wait until each serves; their orders URLs by host."""
        ...

    def adopt(self, nodes: list[str]) -> dict[str, str]:
        """After a healer died: keep the agents of `nodes` that still answer (told to report here), start new ones
        where they are gone; their URLs by host."""
        ...

    def gone(self, node: str) -> bool:
        """True when the agent of `node` is known to have ended (its process, or its srun step's client, exited);
        False while it runs, or where this launcher cannot tell (an agent adopted from a healer that died)."""
        ...

    def restart(self, node: str) -> str:
        """A new agent on `node`, whose agent died or stopped answering (its ranks, if still running, are left as they
        are: the new agent does not know them); its URL."""
        ...

    def drain(self, node: str, reason: str) -> bool:
        """Keep other work off `node` (the scheduler's drain); False where the launcher has no scheduler to tell."""
        ...

    def resume(self, node: str) -> bool:
        """Give a drained `node` back to the scheduler; False where the launcher has no scheduler to tell."""
        ...

    def host_states(self, nodes: list[str]) -> dict[str, dict[str, str | None]]:
        """What the scheduler says of each of `nodes` now: {"state": ..., "reason": ...} (Slurm: IDLE, MIXED,
        IDLE+DRAIN, DOWN*, ... and the drain reason); empty where the launcher has no scheduler to ask or it did not
        answer (the evidence then holds none: this is never worth failing an incident's handling for)."""
        ...

    def scheduler_reaches(self, node: str) -> bool | None:
        """Whether the scheduler can still run work on `node` now (Slurm: a step starts there); None where the
        launcher has no scheduler to ask. The second witness, beside the host's agent, before a silent host is
        drained (healer/launchers/drain.py)."""
        ...

    def stop(self) -> None:
        """End every agent (the job's ranks must already be stopped); twice is once."""
        ...

    def healer_tls(self) -> ssl.SSLContext:
        """The healer's client context toward the agents: every order goes over mutual TLS (ground/tls.py)."""
        ...


@dataclass(frozen=True, slots=True)
class Launch:
    """What a launcher gives one run of `megaheal run` (healer/launchers/launchers.py chooses the launcher)."""

    fleet: AgentFleet
    listen: str
    """Where the run's endpoint for the agents' batches binds: loopback when every host is this machine."""
    rank_env: dict[str, str]
    """GLOO_/NCCL_... settings every rank gets."""
    across_env: dict[str, str]
    """The environment a runbook across the job's hosts runs in, from the healer's machine."""


@dataclass(kw_only=True, slots=True)
class AgentSettings:
    """What every launcher's agents are started with."""

    run_dir: Path
    """The run directory, on a filesystem every host shares: each agent's directory and URL file are under it."""
    healer_url: str
    epoch: int = 0
    """The healer's epoch, in the orders the launcher sends (AgentFleet.epoch)."""
    token_file: Path
    """The run's token, as a file: it never goes into an agent's command line or environment."""
    python: str = field(default_factory=lambda: sys.executable)
    """The interpreter the agents run (on a cluster: a path every host has, the checkout's venv)."""
    cwd: Path = field(default_factory=Path.cwd)
    extra_env: dict[str, str] = field(default_factory=dict)
    """Added to the environment of every agent (and so of its ranks)."""

    def host_tls(self, node: str) -> Path:
        """A new certificate for the agent of `node` from the run's authority: the directory it gets as --tls-dir."""
        return RunAuthority.of_run(RunPaths(self.run_dir).launcher).host(node).directory

    def healer_tls(self) -> ssl.SSLContext:
        """The healer's client context toward its agents (ground/tls.py)."""
        return RunAuthority.of_run(RunPaths(self.run_dir).launcher).healer().client()

    def work_dir(self, node: str) -> Path:
        """The agent's own directory: its log, its URL file, each attempt's logs of its host."""
        return (name_path(self.run_dir / "nodes", node) / "agent").absolute()

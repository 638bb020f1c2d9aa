"""What a launcher is to `megaheal run`: the set of node agents of a job (one per host, healer/agent/), started,
found again and ended by some means of the cluster's. Everything else (attempts, orders, signals, runbooks) goes
through the agents themselves (healer/launchers/coordinator.py), so the healer's code is the same everywhere.

- local (healer/launchers/local_agents.py): every host is an agent process on this machine;
- slurm (healer/launchers/slurm_agents.py): one agent per host of the allocation, started with srun; a host can be
  drained so that the scheduler keeps other jobs off it too.
"""

from __future__ import annotations

from typing import Protocol


class AgentFleet(Protocol):
    healer_url: str
    """Where the agents post their batches (the runner's report endpoint); set before `start` or `adopt`."""

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

    def restart(self, node: str) -> str:
        """A new agent on `node`, whose agent died or stopped answering (its ranks, if still running, are left as they
        are: the new agent does not know them); its URL."""
        ...

    def drain(self, node: str, reason: str) -> bool:
        """Keep other work off `node` (the scheduler's drain); False where the launcher has no scheduler to tell."""
        ...

    def stop(self) -> None:
        """End every agent (the job's ranks must already be stopped); twice is once."""
        ...

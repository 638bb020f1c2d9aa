"""Which launcher runs a job: the one whose Config the run's spec holds (as torchtitan chooses a component by its
Config). A new launcher is its module (an AgentFleet with a nested Config and `for_run`) and one line here."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from healer.launchers.fleet import Launch
from healer.launchers.local_agents import LocalAgents
from healer.launchers.slurm_agents import SlurmAgents

LauncherConfig = LocalAgents.Config | SlurmAgents.Config
LAUNCHERS: dict[type, Callable[[Any, Path, Path], Launch]] = {
    LocalAgents.Config: LocalAgents.for_run,
    SlurmAgents.Config: SlurmAgents.for_run,
}


def launch(cfg: LauncherConfig, run_dir: Path, token_file: Path) -> Launch:
    """The fleet and settings of the launcher `cfg` configures, for one run."""
    try:
        for_run = LAUNCHERS[type(cfg)]
    except KeyError:
        raise ValueError(f"no launcher takes a {type(cfg).__qualname__}; known: "
                         f"{', '.join(t.__qualname__ for t in LAUNCHERS)}") from None
    return for_run(cfg, run_dir, token_file)

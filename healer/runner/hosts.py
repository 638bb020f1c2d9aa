"""What the scheduler says of the run's hosts as it ends, kept in the run directory for the report and the job page
(healer/pages/hosts.py reads it)."""

from __future__ import annotations

import json
from pathlib import Path

from healer.launchers.fleet import AgentFleet
from healer.pages.hosts import states_path


def record_states(run_dir: Path, fleet: AgentFleet, hosts: list[str]) -> dict[str, dict[str, str | None]]:
    """`fleet.host_states` of `hosts`, written to launcher/hosts.json (wire/run_paths.py); nothing where no
    scheduler answered."""
    states = fleet.host_states(sorted(set(hosts)))
    if states:
        states_path(run_dir).write_text(json.dumps(states, indent=2) + "\n")
    return states

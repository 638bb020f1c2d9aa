"""The run's hosts, for the report: what each host was in each attempt (trained, spare, left out), the incidents
that named it, whether it was drained and why, what Slurm said of it at the end, and what network-triage measured
on its links. Read from the supervisor's journal, the agents' registry, the incidents' evidence and the states the
run recorded on its way out (`supervisor/hosts.json`); nothing here asks a host or the scheduler anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from healer.jsonl import read_jsonl
from healer.launchers import agent_registry, journal
from healer.launchers.fleet import AgentFleet


def states_path(run_dir: Path) -> Path:
    return run_dir / "supervisor" / "hosts.json"


def record_states(run_dir: Path, fleet: AgentFleet, hosts: list[str]) -> dict[str, dict[str, str | None]]:
    """What the scheduler says of `hosts` as the run ends, kept for the report (nothing where there is none)."""
    states = fleet.host_states(sorted(set(hosts)))
    if states:
        states_path(run_dir).write_text(json.dumps(states, indent=2) + "\n")
    return states


def host_table(run_dir: Path, incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per host the run knew, in name order."""
    starts = [e for e in read_jsonl(journal.path(run_dir)) if e.get("event") == "start"]
    final = _read_states(run_dir)
    hosts = set(agent_registry.load(run_dir)) | {n for e in starts for n in e.get("nodes", [])} | set(final)
    hosts |= {n for i in incidents for n in i.get("suspect_nodes", [])}
    return [_row(host, starts, incidents, final.get(host)) for host in sorted(hosts)]


def _row(host: str, starts: list[dict[str, Any]], incidents: list[dict[str, Any]],
         final: dict[str, Any] | None) -> dict[str, Any]:
    roles, trained_before = {}, False
    for start in starts:
        here = host in start.get("nodes", [])
        roles[str(start.get("attempt"))] = "trained" if here else "left out" if trained_before or _excluded(
            host, incidents) else "spare"
        trained_before |= here
    named = [i for i in incidents if host in i.get("suspect_nodes", []) or host in _named_by(i)]
    drain = next((d[host] for i in reversed(incidents) if host in (d := i["evidence"].get("drain") or {})), None)
    slurm = final or next((s[host] for i in reversed(incidents) if host in (s := i["evidence"].get("slurm") or {})),
                          None)
    links = [f"{_named_by(i)[host].get('summary', '')}" for i in named if host in _named_by(i)]
    return {"host": host, "roles": roles, "incidents": [{"id": i["id"], "kind": i["kind"], "state": i["state"]}
                                                       for i in named],
            "drain": drain, "slurm": slurm, "network": links,
            "pairs_gbps": {k: v for i in named for k, v in (_named_by(i).get(host, {}).get("pairs_gbps") or {}).items()}}


def _named_by(incident: dict[str, Any]) -> dict[str, Any]:
    """Hosts a runbook across the job's hosts named in the incident (healer/core/respond.py `named_by`)."""
    hosts = (incident["evidence"].get("named_by") or {}).get("hosts")
    return hosts if isinstance(hosts, dict) else {}


def _excluded(host: str, incidents: list[dict[str, Any]]) -> bool:
    return any(host in ((i.get("plan") or {}).get("exclude") or []) for i in incidents)


def _read_states(run_dir: Path) -> dict[str, dict[str, Any]]:
    try:
        found = json.loads(states_path(run_dir).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return found if isinstance(found, dict) else {}


"""The run's hosts, for the report and the job page: what each host was in each attempt (trained, spare, left
out), how it fared in screening (preflight), the incidents that named it, whether it was drained and why, what Slurm said of it at the end, and what
network-triage measured on its links. Read from the attempts' journal, the agents' registry, the incidents'
evidence and the states `megaheal run` recorded on its way out (healer/runner/run.py); nothing here asks a host or
the scheduler anything.

    <run_dir>/launcher/attempts.jsonl     each attempt's hosts (wire/journal.py)
    <run_dir>/launcher/agents.json        every host with an agent, spares included (healer/launchers/agent_registry.py)
    <run_dir>/launcher/hosts.json         {host: {"state": ..., "reason": ...}} from Slurm as the run ended
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wire.journal import Journal, Screened, Start
from wire.run_paths import RunPaths


def states_path(run_dir: Path) -> Path:
    return RunPaths(run_dir).host_states


def host_table(run_dir: Path, incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per host the run knew, in name order."""
    paths = RunPaths(run_dir)
    journal = Journal.of(paths.journal)
    starts = journal.starts
    screened = [e for e in journal.events if isinstance(e, Screened)]
    final = _read_json(paths.host_states)
    hosts = set(_read_json(paths.agents)) | set(final) | {e.node for e in screened}
    hosts |= {n for s in starts for n in s.nodes} | {n for i in incidents for n in i.get("suspect_nodes", [])}
    return [_row(host, starts, incidents, final.get(host), [e for e in screened if e.node == host])
            for host in sorted(hosts)]


def _row(host: str, starts: list[Start], incidents: list[dict[str, Any]],
         final: dict[str, Any] | None, screened: list[Screened]) -> dict[str, Any]:
    roles, trained_before = {}, False
    failed_at = min((e.attempt for e in screened if e.status == "fail"), default=None)
    for start in starts:
        here = host in start.nodes
        out = trained_before or _excluded(host, incidents) or (failed_at is not None and start.attempt >= failed_at)
        roles[str(start.attempt)] = "trained" if here else "left out" if out else "spare"
        trained_before |= here
    named = [i for i in incidents if host in i.get("suspect_nodes", []) or host in _named_by(i)]
    drain = next((d[host] for i in reversed(incidents) if host in (d := _evidence(i).get("drain") or {})), None) or \
        next((e.drain for e in reversed(screened) if e.drain is not None), None)
    slurm = final or next((s[host] for i in reversed(incidents) if host in (s := _evidence(i).get("slurm") or {})),
                          None)
    links = [f"{_named_by(i)[host].get('summary', '')}" for i in named if host in _named_by(i)]
    return {"host": host, "roles": roles,
            "screening": [{"attempt": e.attempt, "status": e.status, "summary": e.summary, "seconds": e.seconds}
                          for e in screened],
            "incidents": [{"id": i.get("id"), "kind": i.get("kind"), "state": i.get("state")} for i in named],
            "drain": drain, "slurm": slurm, "network": links,
            "pairs_gbps": {k: v for i in named for k, v in (_named_by(i).get(host, {}).get("pairs_gbps") or {}).items()}}


def _named_by(incident: dict[str, Any]) -> dict[str, Any]:
    """Hosts a runbook across the job's hosts named in the incident (healer/engine/respond.py `named_by`)."""
    hosts = (_evidence(incident).get("named_by") or {}).get("hosts")
    return hosts if isinstance(hosts, dict) else {}


def _evidence(incident: dict[str, Any]) -> dict[str, Any]:
    """The incident's evidence; none in a payload that carries only the ledger's fields."""
    ev = incident.get("evidence")
    return ev if isinstance(ev, dict) else {}


def _excluded(host: str, incidents: list[dict[str, Any]]) -> bool:
    return any(host in ((i.get("plan") or {}).get("exclude") or []) for i in incidents)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return found if isinstance(found, dict) else {}

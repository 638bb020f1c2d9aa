"""A runbook of scope `job` (network-triage) run once for an incident, from the healer's machine, across the job's
current hosts, while the job trains on: its pairwise step needs every host at once, so no single host's agent can
run it. Inside a Slurm allocation its checks start their ranks on the hosts as `srun --overlap` steps beside the
training step (runbooks/checks/collective_srun.py); with local agents every host is this machine and the checks
simulate them with local ranks.

The runbook's one verdict becomes a verdict per host: a host it names (a suspect of kind node) fails, with the
runbook's reason and its pairs' bandwidth; the others pass when it named someone or passed; when it found a problem
it could pin on no host, every host is `degraded` (that blames nobody: the policy leaves out only hosts that fail).
A link it names is kept on both of its hosts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from healer.launchers.node_diagnosis import RunRunbook, run_parsed
from healer.ports import HostVerdict
from wire.verdict import Status

KILL_GRACE_S = 10.0
"""SIGTERM to SIGKILL for a runbook past its timeout: srun passes SIGTERM on and ends its steps on every host."""


@dataclass(kw_only=True, slots=True)
class JobDiagnosis:
    """Runs `megaheal diagnose RUNBOOK --nodes HOSTS --json` on this machine (an argument list: no shell)."""

    python: str
    cwd: Path
    env: Mapping[str, str]
    """Its environment: the healer's own inside an allocation (srun finds the job from it); see `local_env`."""
    timeout: timedelta = timedelta(minutes=4)
    """The whole runbook (network-triage's steps may take 60 s + 120 s); past it the run is an `error`."""
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _running: subprocess.Popen[str] | None = field(default=None, init=False, repr=False)

    def __call__(self, nodes: list[str], runbook: str) -> list[HostVerdict]:
        # NOTE: one at a time: two bandwidth tests over the same links at once would each measure the other.
        with self._lock:
            return verdicts_across(self.run, nodes, runbook, self.timeout)

    def run(self, nodes_csv: str, runbook: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
        argv = [self.python, "-m", "megaheal", "diagnose", runbook, "--nodes", nodes_csv, "--json"]
        with subprocess.Popen(argv, cwd=self.cwd, env=dict(self.env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
            self._running = proc
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _stop(proc)
                raise TimeoutError(f"ran past {timeout_s:g} s") from None
            finally:
                self._running = None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def stop(self) -> None:
        """End the run in flight, if any (the healer is on its way out: nothing may outlive it on the hosts)."""
        proc = self._running
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _stop(proc: subprocess.Popen[str]) -> None:
    """Its whole session (it started srun and local ranks): SIGTERM, then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.communicate(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    except ProcessLookupError:
        proc.communicate()


def local_env(base: Mapping[str, str]) -> dict[str, str]:
    """For hosts that are all this machine: no SLURM_ variable, so no check tries srun on hosts Slurm never heard of
    (a local `megaheal run` may itself run inside an allocation)."""
    return {k: v for k, v in base.items() if not k.startswith("SLURM_")}


def verdicts_across(run: RunRunbook, nodes: list[str], runbook: str, timeout: timedelta) -> list[HostVerdict]:
    """Run the runbook once over `nodes` (`run` takes them as one comma-separated "host") and split its verdict into
    one per host, in `nodes` order."""
    whole, result = run_parsed(run, ",".join(nodes), runbook, timeout)
    if result is None:
        return [HostVerdict(n, Status.ERROR, whole.summary, whole.seconds) for n in nodes]
    return split(result, nodes, whole.summary, whole.seconds)


def split(result: dict[str, Any], nodes: list[str], summary: str, seconds: float) -> list[HostVerdict]:
    """The runbook's result (its `--json` payload) as a verdict per host of `nodes`."""
    suspects = [s for s in result.get("suspects", []) if isinstance(s, dict) and isinstance(s.get("name"), str)]
    named = {s["name"]: str(s.get("reason", "")) for s in suspects if s.get("kind") == "node" and s["name"] in nodes}
    links = [s for s in suspects if s.get("kind") == "link"]
    pairs = {m["labels"]["pair"]: round(float(m["value"]), 4) for step in result.get("steps", [])
             for m in step.get("measurements", []) if m.get("name") == "pair_busbw" and "pair" in m.get("labels", {})}
    status = Status(result.get("verdict", Status.ERROR.value))
    out = []
    for node in nodes:
        details: dict[str, Any] = {}
        mine = {p: v for p, v in pairs.items() if node in p.split("<->")}
        if mine:
            details["pairs_gbps"] = mine
        my_links = [f"{s['name']}: {s.get('reason', '')}" for s in links if node in s["name"].split("<->")]
        if my_links:
            details["links"] = my_links
        if node in named:
            out.append(HostVerdict(node, Status.FAIL, named[node], seconds, details))
        elif named or status is Status.PASS:
            out.append(HostVerdict(node, Status.PASS, "not named" if named else summary, seconds, details))
        else:
            not_pinned = Status.ERROR if status is Status.ERROR else Status.DEGRADED
            out.append(HostVerdict(node, not_pinned, f"named no host: {summary}", seconds, details))
    return out

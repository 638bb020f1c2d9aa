"""Asking Slurm, through its own commands: where this process runs, which hosts a job holds, how the cluster
reaches them, which steps a job has, and changing a node's state. Used by the runbooks' srun jobs and by the
Slurm launcher (healer/launchers/slurm_agents.py).

Every command is an argument list with a timeout (ground.commands.run_command): no shell. Names that reach a
command are Slurm's own (from `scontrol show hostnames`) or checked by ground/names.py; a drain reason is
built by megaheal and cut to a safe alphabet here (`safe_reason`), never taken from an alert as it came.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

from ground.commands import CommandResult, run_command
from ground.names import check_name

TIMEOUT = timedelta(seconds=15)
REASON_MAX = 200
# Letters, digits, spaces and a little punctuation: what a person reads in `sinfo -R`; no quotes, `=`, `%` or
# control characters, whatever scontrol and the tools that parse its output make of them.
_REASON_UNSAFE = re.compile(r"[^A-Za-z0-9 .,:;_/()+#@-]+")


class SlurmError(RuntimeError):
    """A Slurm command failed or did not answer; the message names the command and what it said."""


def inside_allocation() -> bool:
    """Whether this process runs inside a Slurm job allocation (salloc, sbatch, or a step of one)."""
    return bool(os.environ.get("SLURM_JOB_ID"))


def srun_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of work started on other hosts through srun: `base` without a loopback-only gloo."""
    env = dict(base)
    # NOTE: `megaheal run` pins gloo to loopback for jobs on one machine; across hosts that would make every rank
    # advertise 127.0.0.1. Unset, gloo takes the address its hostname resolves to.
    if env.get("GLOO_SOCKET_IFNAME") == "lo":
        del env["GLOO_SOCKET_IFNAME"]
    return env


def _run(argv: list[str], timeout: timedelta = TIMEOUT) -> CommandResult:
    result = run_command(argv, timeout)
    if not result.ok:
        said = (result.err or result.out).strip().splitlines()
        raise SlurmError(f"{' '.join(argv[:2])}: {said[-1] if said else f'exit status {result.rc}'}")
    return result


def hostnames(nodelist: str) -> list[str]:
    """Slurm's compressed node list ("mh[1-4]") expanded by scontrol, in order."""
    out = _run(["scontrol", "show", "hostnames", nodelist]).out.split()
    if not out:
        raise SlurmError(f"scontrol could not expand the node list {nodelist!r}")
    return out


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    address: str
    """NodeAddr: where Slurm itself reaches the node's slurmd (an address or a name the cluster resolves)."""
    state: str
    """State as scontrol prints it (IDLE, MIXED, ALLOCATED, IDLE+DRAIN, DOWN*, ...)."""
    reason: str | None


def nodes(names: list[str]) -> dict[str, NodeInfo]:
    """What scontrol knows of each of `names` (one line per node: `scontrol -o show node`)."""
    out = _run(["scontrol", "-o", "show", "node", ",".join(names)]).out
    found: dict[str, NodeInfo] = {}
    for line in out.splitlines():
        fields = _fields(line)
        if "NodeName" in fields:
            found[fields["NodeName"]] = NodeInfo(fields["NodeName"], fields.get("NodeAddr", fields["NodeName"]),
                                                 fields.get("State", ""), fields.get("Reason"))
    missing = [n for n in names if n not in found]
    if missing:
        raise SlurmError(f"scontrol show node: no such node(s) {', '.join(missing)}")
    return found


def _fields(line: str) -> dict[str, str]:
    """`Key=value Key=value ... Reason=free text [user@time]` (Reason is last and may hold spaces)."""
    head, sep, reason = line.partition(" Reason=")
    fields = dict(item.split("=", 1) for item in head.split() if "=" in item)
    if sep:
        fields["Reason"] = reason.strip()
    return fields


def _job_fields(line: str) -> dict[str, str]:
    """`scontrol -o show job`'s `Key=value` words (a job's Reason is one word, unlike a node's)."""
    return dict(item.split("=", 1) for item in line.split() if "=" in item)


def steps(job_id: str) -> dict[str, list[str]]:
    """The job's running steps by step name: {name: ["JOB.STEP", ...]}."""
    out = _run(["squeue", "--steps", f"--jobs={job_id}", "--noheader", "--format=%i|%j"]).out
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        step, _, name = line.strip().partition("|")
        if step and not step.endswith((".batch", ".extern")):
            found.setdefault(name, []).append(step)
    return found


@dataclass(frozen=True, slots=True)
class JobInfo:
    """What scontrol says of a job: what a successor of it is submitted with."""

    job_id: str
    name: str
    command: str
    """The batch script as it was submitted (its path)."""
    workdir: str
    stdout: str
    nodes: tuple[str, ...]


def job(job_id: str) -> JobInfo:
    """`scontrol -o show job JOB_ID`. NOTE: fields are split at spaces: a script path or job name with a space in
    it is refused rather than misread."""
    if not job_id.isdigit():
        raise ValueError(f"a Slurm job id is a number, got {job_id!r}")
    fields = _job_fields(_run(["scontrol", "-o", "show", "job", job_id]).out.strip())
    missing = [k for k in ("JobName", "Command", "WorkDir", "StdOut", "NodeList") if not fields.get(k)]
    if missing:
        raise SlurmError(f"scontrol show job {job_id}: no {', '.join(missing)} (a name or path with a space?)")
    return JobInfo(job_id, fields["JobName"], fields["Command"], fields["WorkDir"], fields["StdOut"],
                   tuple(hostnames(fields["NodeList"])))


def job_state(job_id: str) -> str:
    """The job's state as scontrol says it (PENDING, RUNNING, COMPLETED, CANCELLED, ...; GONE once Slurm forgot it)."""
    if not job_id.isdigit():
        raise ValueError(f"a Slurm job id is a number, got {job_id!r}")
    result = run_command(["scontrol", "-o", "show", "job", job_id], TIMEOUT)
    if not result.ok:
        if "Invalid job id" in (result.err or ""):
            return "GONE"
        raise SlurmError(f"scontrol show job {job_id}: {(result.err or result.out).strip()[-300:]}")
    return _job_fields(result.out.strip()).get("JobState", "")


def submit(argv: list[str], env: Mapping[str, str], cwd: str) -> str:
    """`sbatch --parsable ...` (an argument list, bounded): the new job's id."""
    if argv[:2] != ["sbatch", "--parsable"]:
        raise ValueError(f"submit runs `sbatch --parsable ...`, got {argv[:2]}")
    try:
        proc = subprocess.run(argv, env=dict(env), cwd=cwd, capture_output=True, text=True,
                              timeout=TIMEOUT.total_seconds(), check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SlurmError(f"sbatch: {exc}") from exc
    found = proc.stdout.strip().split(";")[0]
    if proc.returncode != 0 or not found.isdigit():
        raise SlurmError(f"sbatch: {(proc.stderr or proc.stdout).strip()[-500:] or f'exit status {proc.returncode}'}")
    return found


def cancel(job_id: str) -> None:
    """`scancel JOB_ID`: every step of the job ends (SIGTERM, SIGKILL after KillWait), then the job."""
    if not job_id.isdigit():
        raise ValueError(f"a Slurm job id is a number, got {job_id!r}")
    _run(["scancel", job_id])


def controller_answers(timeout: timedelta = timedelta(seconds=5)) -> bool:
    """Whether slurmctld answers from here (`scontrol ping`): a host cut off from the cluster cannot tell another
    host's loss from its own."""
    result = run_command(["scontrol", "ping"], timeout)
    return result.ok and "is UP" in result.out


def step_runs_on(job_id: str, node: str, timeout: timedelta = timedelta(seconds=6)) -> bool:
    """Whether Slurm can still run a step of `job_id` on `node` (`srun ... true`, bounded): what the scheduler says
    of a host the healer stopped hearing from. NOTE: slurmctld marks a dead host DOWN only after SlurmdTimeout, and
    never a host whose link to the job's other hosts alone is cut; a step that cannot start there is the scheduler's
    own confirmation, at once. Bounded to a few seconds: a host that starts no step that soon, while its agent does
    not answer either, is taken as lost."""
    check_name(node, "node")
    argv = ["srun", f"--jobid={job_id}", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--overlap",
            "--mem=0", "--job-name=megaheal-reach", f"--time={max(1, int(timeout.total_seconds() // 60) + 1)}",
            "--input=none", "true"]
    return run_command(argv, timeout).ok


def cancel_steps(step_ids: list[str]) -> None:
    """End these steps (SIGKILL to every process Slurm tracks in them); a step that ended meanwhile is no error."""
    if step_ids:
        result = run_command(["scancel", *step_ids], TIMEOUT)
        if result.rc is None:
            raise SlurmError(f"scancel {' '.join(step_ids)}: {result.err}")


def safe_reason(text: str) -> str:
    """`text` cut to what a drain reason may hold: a safe alphabet, one line, at most REASON_MAX characters."""
    return " ".join(_REASON_UNSAFE.sub(" ", text).split())[:REASON_MAX].rstrip()


def drain(node: str, reason: str) -> None:
    """Keep the scheduler off `node` (its running jobs go on); `sinfo -R` shows the reason. SlurmError when
    slurmctld refuses (draining needs a Slurm operator or administrator) or does not answer."""
    try:
        _run(drain_argv(node, reason))
    except SlurmError as exc:
        raise SlurmError(f"draining {node}: {exc}") from exc


def resume(node: str) -> None:
    """Give `node` back to the scheduler (a drained host that was repaired). SlurmError when slurmctld refuses (it
    needs a Slurm operator) or does not answer."""
    try:
        _run(resume_argv(node))
    except SlurmError as exc:
        raise SlurmError(f"resuming {node}: {exc}") from exc


def resume_argv(node: str) -> list[str]:
    check_name(node, "node")
    return ["scontrol", "update", f"NodeName={node}", "State=RESUME"]


def drain_argv(node: str, reason: str) -> list[str]:
    check_name(node, "node")
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={safe_reason(reason)}"]

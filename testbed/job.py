"""A self-healing job submitted to the bed with deploy/slurm/megaheal.sbatch, as a user would, and what it leaves
to read back: the step records of every rank, the attempts in the healer's journal, the incidents in its database,
and the processes still alive on any host. The multi-host tests (tests/multihost/slurm_job.py adds their checks)
and bench/recovery_hosts.py both drive jobs this way.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ground import procfs
from testbed import procs
from testbed.bed import Bed
from testbed.cmd import BedError
from wire import journal
from wire.run_paths import RunPaths

REPO = Path(__file__).resolve().parents[1]
SBATCH = "deploy/slurm/megaheal.sbatch"
SCRIPT_SBATCH = "deploy/slurm/megaheal-script.sbatch"
"""The batch script for a user's own program (megaheal run SCRIPT ARGS under Slurm)."""


ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE"})
"""A job's states in slurmctld once it is over."""


def _job_fields(line: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in line.split() if "=" in f)


def job_env(bed: Bed, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a job on the bed: its SLURM_CONF, one thread per rank, this checkout importable, and no
    GLOO_SOCKET_IFNAME (gloo takes the address the host's name resolves to; lo would make every rank advertise
    127.0.0.1)."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    return bed.env(env)


def step_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every step record the ranks wrote (RUN_DIR/ranks/<rank>.jsonl: wall-clock `time`, `step`, `pid`, ...),
    each with its file's rank as `rank`; a line still being written is skipped."""
    out: list[dict[str, Any]] = []
    ranks = run_dir / "ranks"
    for path in sorted(ranks.glob("*.jsonl")) if ranks.exists() else ():
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                out.append(record | {"rank": int(path.stem)})
    return out


def highest_steps(records: list[dict[str, Any]]) -> dict[int, int]:
    """The highest step of each rank in `records`, by rank."""
    highest: dict[int, int] = {}
    for record in records:
        highest[record["rank"]] = max(highest.get(record["rank"], -1), record["step"])
    return highest


def wait_step(run_dir: Path, proc: subprocess.Popen[str], step: int, timeout_s: float, ranks: int = 6,
              output: Callable[[], str] = str) -> None:
    """Until each of `ranks` ranks of the job `proc` runs (sbatch, salloc) finished `step`; BedError with the job's
    `output` if it ends first, or when the time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BedError(f"the job ended early:\n{output()[-3000:]}")
        done = highest_steps(step_records(run_dir))
        if len(done) == ranks and min(done.values()) >= step:
            return
        time.sleep(0.2)
    raise BedError(f"timed out after {timeout_s:.0f} s waiting for every rank at step {step} "
                   f"(last: {highest_steps(step_records(run_dir))})")


@dataclass
class SlurmJob:
    bed: Bed
    run_dir: Path
    out: Path
    proc: subprocess.Popen[str]
    job_id: str
    output: str = field(default="")

    @classmethod
    def submit(cls, bed: Bed, workdir: Path, steps: int, args: str = "", extra_set: str = "",
               config: str | None = None) -> SlurmJob:
        """`sbatch --wait` the batch script with its run directory and output under `workdir`; `config`: None runs
        the script's own default (the demo, made to fit 3 training hosts x 2 ranks), as a user submits it."""
        run_dir, out = workdir / "run", workdir / "slurm.out"
        workdir.mkdir(parents=True, exist_ok=True)  # sbatch writes no output into a directory that is missing
        env = {k: v for k, v in job_env(bed).items() if k != "MEGAHEAL_CONFIG"}
        env |= {"MEGAHEAL_RUN_DIR": str(run_dir), "MEGAHEAL_SET": f"steps={steps} {extra_set}".strip(),
                "MEGAHEAL_ARGS": args, "MEGAHEAL_PYTHON": sys.executable}
        if config is not None:
            env["MEGAHEAL_CONFIG"] = config
        return cls._sbatch(bed, run_dir, out, [SBATCH], REPO, env)

    @classmethod
    def _sbatch(cls, bed: Bed, run_dir: Path, out: Path, script: list[str], cwd: Path, env: dict[str, str]) -> SlurmJob:
        """`sbatch --wait` SCRIPT [ARGS]: it returns when the job ended, with its exit status; it says the job id
        first."""
        proc = subprocess.Popen(["sbatch", "--wait", f"--output={out}", *script], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        job = re.search(r"Submitted batch job (\d+)", first)
        if not job:
            raise BedError(f"sbatch did not submit the job: {first}{proc.stdout.read()}")
        return cls(bed, run_dir, out, proc, job.group(1))

    @classmethod
    def submit_program(cls, bed: Bed, workdir: Path, program: list[str], args: str = "") -> SlurmJob:
        """`sbatch --wait` deploy/slurm/megaheal-script.sbatch with a user's `program` (SCRIPT ARGS, or -m MODULE
        ARGS), submitted from `workdir` (where its ranks run), as a user submits their own training script."""
        run_dir, out = workdir / "run", workdir / "slurm.out"
        workdir.mkdir(parents=True, exist_ok=True)
        env = job_env(bed) | {"MEGAHEAL_RUN_DIR": str(run_dir), "MEGAHEAL_ARGS": args, "MEGAHEAL_HOME": str(REPO),
                              "MEGAHEAL_PYTHON": sys.executable}
        return cls._sbatch(bed, run_dir, out, [str(REPO / SCRIPT_SBATCH), *program], workdir, env)

    # ---- while it runs -----------------------------------------------------------------------------------

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def records(self) -> list[dict[str, Any]]:
        return step_records(self.run_dir)

    def steps(self) -> dict[int, int]:
        """The highest step each rank recorded, by rank."""
        return highest_steps(self.records())

    def wait_step(self, step: int, timeout_s: float, ranks: int = 6) -> None:
        wait_step(self.run_dir, self.proc, step, timeout_s, ranks, self.text)

    def journal(self) -> list[dict[str, Any]]:
        """The attempts' journal, each event as its line holds it."""
        return [msgspec.to_builtins(e) for e in journal.read(RunPaths(self.run_dir).journal)]

    def attempt(self, n: int) -> dict[str, Any]:
        """The journal's start entry of attempt `n`."""
        return next(e for e in self.journal() if e["event"] == "start" and e.get("attempt") == n)

    def host_of_rank(self, attempt: int) -> dict[int, str]:
        return {int(r): n for e in self.journal() if e["event"] == "ranks" and e.get("attempt") == attempt
                for r, n in e["nodes"].items()}

    # ---- once it ended -----------------------------------------------------------------------------------

    def incidents(self) -> list[dict[str, Any]]:
        from healer.runner.report import load_incidents

        return load_incidents(self.run_dir)

    def attempts(self) -> list[int]:
        return sorted({e["attempt"] for e in self.journal() if e["event"] == "start"})

    def leftovers(self) -> dict[str, list[str]]:
        """Processes of the job still alive: on any host (but its slurmd), or on this machine naming the run
        directory."""
        left: dict[str, list[str]] = {}
        for host in self.bed.hosts:
            found = [f"{p} {procs.command(p)}" for p in self.bed.pids(host) if procs.command(p) != "slurmd"]
            if found:
                left[host.name] = found
        here = [f"{p} {procs.command(p)}" for p in procfs.pids()
                if any(str(self.run_dir) in a for a in procfs.cmdline(p)) and procs.alive(p)]
        if here:
            left["this machine"] = here
        return left

    def wait_ended(self, timeout_s: float) -> int:
        """Until the job ended, however it did; its exit status (the batch script's, as `sbatch --wait` gives it).
        TimeoutError once `timeout_s` ran out.
        NOTE: read from slurmctld every 0.25 s rather than waited for from `sbatch --wait`, which asks slurmctld
        after 2 s, 10 s and 42 s and then every 32 s (Slurm's sbatch.c, with the bed's MinJobAge of 60 s): each
        multi-host job's test waited 0-32 s more after its job had ended (a 74 s test took 106 s in one run)."""
        deadline = time.monotonic() + timeout_s
        env = job_env(self.bed)
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                return rc
            fields = _job_fields(subprocess.run(["scontrol", "-o", "show", "job", self.job_id], env=env, check=False,
                                                capture_output=True, text=True, timeout=30).stdout)
            if fields.get("JobState") in ENDED and ":" in fields.get("ExitCode", ""):
                # NOTE: sbatch --wait's own status is the job's exit code (a signal's: none of ours)
                self.proc.terminate()
                self.proc.wait(30)
                return int(fields["ExitCode"].split(":")[0])
            time.sleep(0.25)
        raise TimeoutError(f"job {self.job_id} still running after {timeout_s:.0f} s")

    def stop(self) -> None:
        """Cancel the job if it still runs (a failed run must not leave it to the next one)."""
        if self.proc.poll() is None:
            subprocess.run(["scancel", self.job_id], env=job_env(self.bed), capture_output=True, timeout=30)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

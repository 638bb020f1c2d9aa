"""A self-healing job submitted to the bed with deploy/slurm/megaheal.sbatch, as a user would, and what the fault
tests read back from it: the steps the ranks recorded, the attempts the healer's journal holds, the incidents in its
database, the Slurm state of each host, and the processes left on any host."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from healer.jsonl import read_jsonl
from healer.launchers import journal
from healer.runner.report import load_incidents
from megaheal import procfs, slurm
from tests.conftest import REPO
from tests.multihost.conftest import bed_env
from tests.support import wait_for
from testbed import procs
from testbed.bed import Bed



@dataclass
class SlurmJob:
    bed: Bed
    run_dir: Path
    out: Path
    proc: subprocess.Popen[str]
    job_id: str
    output: str = field(default="")

    @classmethod
    def submit(cls, bed: Bed, tmp_path: Path, steps: int, args: str = "", extra_set: str = "") -> SlurmJob:
        run_dir, out = tmp_path / "run", tmp_path / "slurm.out"
        # The script's own default config (the demo, made to fit 3 training hosts x 2 ranks), as a user submits it.
        env = {k: v for k, v in bed_env(bed).items() if k != "MEGAHEAL_CONFIG"}
        env |= {"MEGAHEAL_RUN_DIR": str(run_dir), "MEGAHEAL_SET": f"steps={steps} {extra_set}".strip(),
                              "MEGAHEAL_ARGS": args, "MEGAHEAL_PYTHON": sys.executable}
        # --wait: sbatch returns when the job ended, with its exit status; it says the job id first.
        proc = subprocess.Popen(["sbatch", "--wait", f"--output={out}", "deploy/slurm/megaheal.sbatch"], cwd=REPO,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        first = proc.stdout.readline()
        job = re.search(r"Submitted batch job (\d+)", first)
        assert job, first + proc.stdout.read()
        return cls(bed, run_dir, out, proc, job.group(1))

    # ---- while it runs -----------------------------------------------------------------------------------

    def text(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def steps(self) -> dict[int, int]:
        """The highest step each rank recorded, by rank."""
        highest: dict[int, int] = {}
        for path in (self.run_dir / "ranks").glob("*.jsonl") if (self.run_dir / "ranks").exists() else ():
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line being written
                if isinstance(record.get("step"), int):
                    highest[int(path.stem)] = max(highest.get(int(path.stem), -1), record["step"])
        return highest

    def wait_step(self, step: int, timeout_s: float) -> None:
        """Until every rank of the first attempt finished `step` (and a checkpoint before it exists, when asked)."""
        def there() -> bool:
            assert self.proc.poll() is None, f"the job ended early:\n{self.text()[-3000:]}"
            done = self.steps()
            return len(done) == 6 and min(done.values()) >= step
        wait_for(f"every rank at step {step}", there, timeout_s, every_s=0.2)

    def journal(self) -> list[dict[str, Any]]:
        return list(read_jsonl(journal.path(self.run_dir)))

    def attempt(self, n: int) -> dict[str, Any]:
        """The journal's start entry of attempt `n`."""
        return next(e for e in self.journal() if e["event"] == "start" and e.get("attempt") == n)

    def host_of_rank(self, attempt: int) -> dict[int, str]:
        return {int(r): n for e in self.journal() if e["event"] == "ranks" and e.get("attempt") == attempt
                for r, n in e["nodes"].items()}

    # ---- once it ended -----------------------------------------------------------------------------------

    def finish(self, timeout_s: float) -> str:
        """Wait for the job to end; its output. Fails unless it ended well."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            subprocess.run(["scancel", self.job_id], env=bed_env(self.bed), capture_output=True, timeout=30)
            self.proc.wait(60)
            raise AssertionError(f"the job ran past {timeout_s:.0f} s:\n{self.text()[-4000:]}") from None
        self.output = self.text()
        assert rc == 0 and "outcome: finished" in self.output, self.output[-4000:]
        return self.output

    def incidents(self) -> list[dict[str, Any]]:
        return load_incidents(self.run_dir)

    def attempts(self) -> list[int]:
        return sorted({e["attempt"] for e in self.journal() if e["event"] == "start"})

    def slurm_state(self, host: str) -> slurm.NodeInfo:
        return slurm.nodes([host])[host]

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

    def assert_nothing_left(self, timeout_s: float = 60) -> None:
        wait_for("every process of the job to be gone", lambda: not self.leftovers(), timeout_s, every_s=0.5)

    def stop(self) -> None:
        """Cancel the job if it still runs (a failed test must not leave it to the next one)."""
        if self.proc.poll() is None:
            subprocess.run(["scancel", self.job_id], env=bed_env(self.bed), capture_output=True, timeout=30)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


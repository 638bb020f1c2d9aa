"""A self-healing job submitted to the bed with deploy/slurm/megaheal.sbatch (testbed/job.py submits it and reads
back its steps, journal, incidents and leftovers), plus what the fault tests check once it ended: that it finished
well, the Slurm state of each host, and that no process is left on any host."""

from __future__ import annotations

from ground import slurm
from testbed import job
from tests.support import wait_for


class SlurmJob(job.SlurmJob):
    def finish(self, timeout_s: float) -> str:
        """Wait for the job to end; its output. Fails unless it ended well."""
        rc = self.end(timeout_s)
        assert rc == 0 and "outcome: finished" in self.output, self.output[-4000:]
        return self.output

    def end(self, timeout_s: float) -> int:
        """Wait for the job to end, however it does; its exit status (sbatch --wait's: the batch script's)."""
        try:
            rc = self.wait_ended(timeout_s)
        except TimeoutError:
            self.stop()
            raise AssertionError(f"the job ran past {timeout_s:.0f} s:\n{self.text()[-4000:]}") from None
        self.output = self.text()
        return rc

    def slurm_state(self, host: str) -> slurm.NodeInfo:
        return slurm.nodes([host])[host]

    def assert_nothing_left(self, timeout_s: float = 60) -> None:
        wait_for("every process of the job to be gone", lambda: not self.leftovers(), timeout_s, every_s=0.5)


def losses_by_attempt(job: SlurmJob) -> dict[int, dict[int, float]]:
    """Rank 0's loss at each step, by the attempt that trained it (from its own step records)."""
    out: dict[int, dict[int, float]] = {}
    for r in job.records():
        if r["rank"] == 0 and "loss" in r:
            out.setdefault(int(r["attempt"]), {})[r["step"]] = r["loss"]
    return out


def assert_continues(losses: dict[int, dict[int, float]], restarts: tuple[tuple[int, int], ...]) -> None:
    """Each (before, after) attempt pair of a restart from memory: `after` starts at or before the step after the
    last `before` trained (no step skipped), and each step both trained has the same loss (the state came back
    exactly, bit for bit)."""
    for before, after in restarts:
        first, reached = min(losses[after]), max(losses[before])
        assert first <= reached + 1, f"attempt {after} starts at step {first}, attempt {before} reached {reached}"
        again = sorted(set(losses[before]) & set(losses[after]))
        assert all(losses[after][s] == losses[before][s] for s in again), \
            {s: (losses[before][s], losses[after][s]) for s in again}

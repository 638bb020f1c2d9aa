"""A self-healing job submitted to the bed with deploy/slurm/megaheal.sbatch (testbed/job.py submits it and reads
back its steps, journal, incidents and leftovers), plus what the fault tests check once it ended: that it finished
well, the Slurm state of each host, and that no process is left on any host."""

from __future__ import annotations

import subprocess

from ground import slurm
from testbed import job
from tests.support import wait_for


class SlurmJob(job.SlurmJob):
    def finish(self, timeout_s: float) -> str:
        """Wait for the job to end; its output. Fails unless it ended well."""
        try:
            rc = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"the job ran past {timeout_s:.0f} s:\n{self.text()[-4000:]}") from None
        self.output = self.text()
        assert rc == 0 and "outcome: finished" in self.output, self.output[-4000:]
        return self.output

    def slurm_state(self, host: str) -> slurm.NodeInfo:
        return slurm.nodes([host])[host]

    def assert_nothing_left(self, timeout_s: float = 60) -> None:
        wait_for("every process of the job to be gone", lambda: not self.leftovers(), timeout_s, every_s=0.5)

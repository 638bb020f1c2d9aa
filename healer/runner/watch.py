"""The healer's watcher under Slurm: what keeps a job going when the host that runs its healer is lost.

    megaheal watch --run-dir RUN_DIR --batch-host HOST     (a one-host step on another host of the allocation)

The healer runs in the batch script, on the allocation's first host, which also trains. A healer that dies alone is
followed by one that takes the run over in place (the batch script's loop); a batch host that dies takes the batch
script with it, and with `--no-kill` (which lets the healer replace any other host) Slurm then keeps the job running
on the other hosts with nothing left to drive it, until its time limit. So deploy/slurm/megaheal.sbatch keeps this
watcher running on another host, which asks the healer's report endpoint for /healthz every second:

- an answer: all is well;
- the connection refused: the batch host's kernel answers, so it is the healer process alone that is gone (the batch
  script takes the run over in place): nothing to do;
- no answer for `after_s`: before anything, the watcher makes sure it is not the one cut off: slurmctld answers
  (`scontrol ping`) and it reaches another of the job's hosts (an agent's port, TCP). Only then is the batch
  host asked the scheduler's way (`srun ... true` there, bounded), and the healer once more; when both stay silent
  the job hands over: a successor job (the same batch script, `--dependency=singleton` on the same job name,
  `--no-requeue`, on as many hosts as are left, its output appended to this one's) is submitted with
  MEGAHEAL_TAKE_OVER=1, and this job is cancelled. The successor's healer takes the run over from its run directory
  (incidents, restart budget, checkpoints): the lost host becomes a host_lost incident there, its evidence this
  watcher's handover record (RUN_DIR/launcher/handover.json).

Why a successor job, not a second healer in this allocation: this allocation has no batch script any more, so its
end would have to be a `scancel` (the job CANCELLED, `sbatch --wait`'s status lost); a chain keeps every job's own
status, and the successor is scheduled in ~20 s on this bed (a requeue instead waits out Slurm's cred_expire, 121 s,
and blocks a singleton chain meanwhile). See docs/operations.md, "The healer's host".
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from ground import slurm
from ground.names import check_name
from ground.tls import PeerTls, https
from healer.launchers import agent_registry
from healer.launchers.run_authority import RunAuthority
from wire import journal
from wire.run_paths import RunPaths

log = logging.getLogger(__name__)

HANDOVER = "handover.json"
"""The watcher's record of a handover, in RUN_DIR/launcher/: what the successor's incident says."""


@dataclass(frozen=True, slots=True)
class Handover:
    """Why and how a job was handed to a successor (written by the watcher, read by the successor's healer)."""

    job_id: str
    """The Slurm job that was ended."""
    successor: str
    """The Slurm job submitted in its place."""
    batch_host: str
    lapsed_at: float
    """When the healer stopped answering (epoch seconds)."""
    handed_at: float
    witnesses: dict[str, str] = field(default_factory=dict)
    """What each witness said of the batch host."""

    @staticmethod
    def read(run_dir: Path) -> Handover | None:
        path = RunPaths(run_dir).launcher / HANDOVER
        try:
            data = json.loads(path.read_text())
            return Handover(**data)
        except (OSError, ValueError, TypeError):
            return None


@dataclass(kw_only=True, slots=True)
class Watch:
    run_dir: Path
    batch_host: str
    job_id: str
    after_s: float = 10.0
    """How long the healer may not answer (timeouts, not refusals) before the batch host is asked about."""
    every_s: float = 1.0
    probe_timeout_s: float = 2.0
    arm_timeout_s: float = 600.0
    """How long to wait for the healer's first answer (its start, its agents' srun steps) before giving up."""

    def __post_init__(self) -> None:
        check_name(self.batch_host, "batch host")
        if not self.job_id.isdigit():
            raise ValueError(f"the Slurm job id must be a number, got {self.job_id!r}")
        if self.after_s <= 0 or self.every_s <= 0:
            raise ValueError("after_s and every_s must be > 0")

    # ---- asking the healer ----------------------------------------------------------------------------

    def _peer(self) -> PeerTls:
        """The healer, proven by a certificate of the run's authority (this watcher shows none: /healthz needs
        none)."""
        ctx = ssl.create_default_context(cafile=str(RunAuthority(RunPaths(self.run_dir).launcher / "tls").ca_cert))
        ctx.check_hostname = False  # NOTE: the peer's role in its certificate is checked instead (ground/tls.py)
        return PeerTls(ctx, "healer")

    def probe(self) -> str:
        """ok, refused (the host answers, the healer does not listen) or silent (no answer at all)."""
        try:
            url = RunPaths(self.run_dir).healer_url.read_text().strip()
        except OSError:
            return "silent"
        try:
            status, _ = https("GET", f"{url}/healthz", None, {}, self.probe_timeout_s, self._peer(), 1 << 16)
        except ConnectionRefusedError:
            return "refused"
        except (TimeoutError, OSError, ValueError):
            return "silent"
        return "ok" if status == 200 else "refused"

    # ---- the loop ---------------------------------------------------------------------------------------

    def run(self) -> int:
        """Watch until a handover (0) or the healer never answered within arm_timeout_s (1)."""
        deadline = time.monotonic() + self.arm_timeout_s
        while self.probe() != "ok":
            if time.monotonic() > deadline:
                log.error("the healer of %s never answered in %.0f s: not watching", self.run_dir, self.arm_timeout_s)
                return 1
            time.sleep(self.every_s)
        job = self._job()
        log.info("watching the healer of %s (batch host %s, job %s)", self.run_dir, self.batch_host, self.job_id)
        heard, lapsed_at = time.monotonic(), None
        while True:
            said = self.probe()
            if said != "silent":
                heard, lapsed_at = time.monotonic(), None
            else:
                lapsed_at = lapsed_at or time.time()
                if time.monotonic() - heard >= self.after_s:
                    why_not = self.why_not_hand_over()
                    if why_not is None:
                        self.hand_over(job, lapsed_at)
                        return 0
                    log.warning("the healer has not answered for %.0f s, but %s: waiting", self.after_s, why_not)
                    heard, lapsed_at = time.monotonic(), None
            time.sleep(self.every_s)

    def _job(self, tries: int = 5) -> slurm.JobInfo:
        """What scontrol says of this job, read while all is well: the script, output and name to submit again
        (a transient scontrol failure is tried again; the last one is raised)."""
        for _ in range(tries - 1):
            try:
                return slurm.job(self.job_id)
            except slurm.SlurmError as exc:
                log.warning("scontrol show job %s: %s; again in %.0f s", self.job_id, exc, self.every_s * 5)
                time.sleep(self.every_s * 5)
        return slurm.job(self.job_id)

    def why_not_hand_over(self) -> str | None:
        """Why the silence is not the batch host's loss (None: it is): this watcher is the one cut off, the batch
        host still runs steps, or the healer answers again."""
        if not slurm.controller_answers():
            return "slurmctld does not answer here either (this host may be the one cut off)"
        others = {n: url for n, url in agent_registry.load(self.run_dir).items()
                  if n not in (self.batch_host, os.environ.get("SLURMD_NODENAME"))}
        # NOTE: any one host, not a majority: the registry still names hosts lost earlier in the run.
        if others and not any(_reaches(url, self.probe_timeout_s) for url in others.values()):
            return f"none of the {len(others)} other hosts answers here (this host may be the one cut off)"
        if slurm.step_runs_on(self.job_id, self.batch_host):
            return f"{self.batch_host} still runs steps"
        if self.probe() != "silent":
            return "the healer answers again"
        return None

    def hand_over(self, job: slurm.JobInfo, lapsed_at: float) -> Handover:
        """Submit the successor job and cancel this one."""
        paths = RunPaths(self.run_dir)
        last = journal.Journal.of(paths.journal).last_start()
        trained = len(last.nodes) if last is not None else 0
        left = [h for h in job.nodes if h != self.batch_host]
        # NOTE: this job's and step's own variables stay behind (the successor gets its own), the cluster's config
        # path comes along.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) or k == "SLURM_CONF"}
        env |= {"MEGAHEAL_TAKE_OVER": "1", "MEGAHEAL_SPARES": str(max(0, len(left) - trained))}
        argv = ["sbatch", "--parsable", f"--job-name={job.name}", "--dependency=singleton", "--no-requeue",
                f"--nodes={len(left)}", "--open-mode=append", f"--output={job.stdout}", f"--chdir={job.workdir}",
                "--export=ALL", job.command]
        successor = slurm.submit(argv, env, cwd=job.workdir)
        record = Handover(job_id=self.job_id, successor=successor, batch_host=self.batch_host, lapsed_at=lapsed_at,
                          handed_at=time.time(),
                          witnesses={"healer": f"no answer from its report endpoint for {self.after_s:.0f} s",
                                     "slurm": f"no step starts on {self.batch_host}"})
        (paths.launcher / HANDOVER).write_text(json.dumps(asdict(record)) + "\n")
        log.warning("the healer's host %s is lost: Slurm job %s goes on as job %s; cancelling %s", self.batch_host,
                    self.job_id, successor, self.job_id)
        slurm.cancel(self.job_id)
        return record


def watch(run_dir: Path, batch_host: str, job_id: str | None = None, after: timedelta = timedelta(seconds=10)) -> int:
    job = job_id or os.environ.get("SLURM_JOB_ID", "")
    return Watch(run_dir=run_dir, batch_host=batch_host, job_id=job, after_s=after.total_seconds()).run()


def _reaches(url: str, timeout_s: float) -> bool:
    """Whether a TCP connection to `url`'s host and port is answered (accepted or refused: the host is there)."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        return False
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False

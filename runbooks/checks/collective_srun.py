"""The collective bandwidth job across real hosts: one rank per task of an `srun` step on the named nodes.

Parent side (`run_srun_job`): one `srun --nodelist=... --ntasks-per-node=R --distribution=block` step
(block: ranks 0..R-1 on the step's first node, and so on, as the pairwise schedule expects), with
`--overlap` so it also runs beside a training step that holds the allocation's CPUs. Rank side
(`python -m runbooks.checks.collective_srun SPEC_JSON`): rank, world and node come from Slurm's
task environment; rank 0 serves the rendezvous store on the step's first node, at a port derived
from the job and step ids (every task computes the same one, no file or second channel needed);
rank 0 gathers every rank's timings and prints them as one line on stdout, which srun forwards.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

from ground.durations import to_mapping
from ground.slurm import hostnames, srun_env
from ground.typedconfig import from_mapping
from runbooks.checks.collective_job import JobError, JobSpec, rank_body

log = logging.getLogger(__name__)

RESULT = "MEGAHEAL-COLLECTIVE-RESULT "
RANK_ERROR = "MEGAHEAL-RANK-ERROR "
PORT_BASE, PORT_SPAN = 20000, 12000  # below Linux's ephemeral range (32768-60999): no client port takes it
STOP_GRACE_S = 5.0


def srun_argv(spec: JobSpec, nodes: list[str]) -> list[str]:
    return [
        "srun",
        f"--nodes={len(nodes)}",
        f"--ntasks={spec.world_size}",
        f"--ntasks-per-node={spec.ranks_per_node}",
        f"--nodelist={','.join(nodes)}",
        "--distribution=block",
        "--kill-on-bad-exit=1",
        "--overlap",
        "--job-name=megaheal-collective",
        "--export=ALL",
        sys.executable,
        "-m",
        "runbooks.checks.collective_srun",
        json.dumps(to_mapping(spec)),
    ]


def run_srun_job(spec: JobSpec, nodes: list[str], timeout: timedelta) -> list[dict[str, Any]]:
    """Run the job on `nodes` through srun; each rank's timings (with its "node"), in rank order."""
    if shutil.which("srun") is None:
        raise JobError("srun is not on PATH: cannot start ranks on other hosts")
    proc = subprocess.Popen(srun_argv(spec, nodes), shell=False, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=srun_env(os.environ))
    try:
        out, err = proc.communicate(timeout=timeout.total_seconds())
    except subprocess.TimeoutExpired:
        # SIGTERM first: srun passes it to every task and ends the step on every host.
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise JobError(f"srun step on {','.join(nodes)} gave no result within {timeout.total_seconds():g}s; "
                       f"{_why(err)}") from None
    results = next((line[len(RESULT):] for line in out.splitlines() if line.startswith(RESULT)), None)
    if proc.returncode != 0 or results is None:
        raise JobError(f"srun step on {','.join(nodes)} exited {proc.returncode} without a result: {_why(err)}")
    ranks: list[dict[str, Any]] = json.loads(results)
    if len(ranks) != spec.world_size:
        raise JobError(f"expected {spec.world_size} ranks' results, got {len(ranks)}")
    return ranks


def _why(err: str) -> str:
    lines = err.strip().splitlines()
    mine = [line[len(RANK_ERROR):] for line in lines if line.startswith(RANK_ERROR)]
    return "; ".join(mine) if mine else " | ".join(lines[-3:]) or "(no output)"


# ---------------------------------------------------------------------------- inside each task


def rendezvous_port(job_id: int, step_id: int) -> int:
    """The same port on every task of a step; consecutive steps and jobs get different ones."""
    return PORT_BASE + (job_id * 64 + step_id) % PORT_SPAN


def _task_main(spec: JobSpec) -> None:
    import torch
    import torch.distributed as dist

    env = os.environ
    rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env["SLURM_LOCALID"])
    if world != spec.world_size:
        raise RuntimeError(f"srun started {world} tasks for a {spec.world_size}-rank job")
    if spec.device == "auto":
        # Decided where the ranks run: the machine that started srun may have no GPU at all.
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        spec.device = "cuda" if gpus >= spec.ranks_per_node else "cpu"
    spec.leaders = list(range(0, world, spec.ranks_per_node))
    master = hostnames(env["SLURM_STEP_NODELIST"])[0]
    port = rendezvous_port(int(env["SLURM_JOB_ID"]), int(env["SLURM_STEP_ID"]))
    store = dist.TCPStore(master, port, world, rank == 0, spec.timeout)
    results = rank_body(rank, spec, store, local, gather=True,
                        extra={"node": env["SLURMD_NODENAME"], "device": spec.device})
    if rank == 0:
        sys.stdout.write(RESULT + json.dumps(results) + "\n")
        sys.stdout.flush()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if len(argv) != 1:
        print("usage: srun ... python -m runbooks.checks.collective_srun SPEC_JSON", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        _task_main(from_mapping(JobSpec, json.loads(argv[0]), "spec"))
    except Exception as exc:  # noqa: BLE001 -- a probe fails closed: the parent must learn why, whatever it was
        where = f"rank {os.environ.get('SLURM_PROCID', '?')} on {os.environ.get('SLURMD_NODENAME', '?')}"
        log.debug("%s failed after %.1fs", where, time.monotonic() - t0, exc_info=True)
        print(f"{RANK_ERROR}{where}: {type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}",
              file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A training process that outlives a failed attempt: it trains in one generation after another.

    python -m train.warm.worker --control HOST:PORT --worker ID --key-file PATH --config CONFIG --run-dir DIR
        [--set KEY=VALUE ...] [--from-generation G]

It starts once (interpreter, torch, the trainer imported) and then takes plans from its pool's store
(wire/warm_plan.py), sealed with the pool's key (read from `--key-file`, a private file). What it trains (config,
overrides, run directory) is fixed on its command line; a plan says only which rank it holds and where it resumes
from. In a plan that gives it a rank it joins the generation's process group, resumes (from its own snapshot in
memory, from a peer's replica when it replaces a rank that died, or from the disk checkpoint when no state is held by
all or a replica fails its checksum: its ready report then says why) and trains. When a peer dies its collectives
fail (gloo: the connection to the dead peer closes; those blocked on live peers are released when they tear down
their group in turn, or at the generation's collective timeout): it abandons the step, leaves the group, reports,
and waits for the next plan, keeping its snapshots. A worker without a rank is a standby: it waits, already warm,
for a plan that gives it one.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist
import yaml

from inprocess.abort import open_sockets
from inprocess.generations import STUCK_EXIT_CODE, GenerationLoop, Ready, connect_to
from train.config import TrainConfig, load_config
from train.trainer import Trainer
from train.warm.replicas import Replicas, gather_resume_state, replica_stride
from wire.run_paths import RunPaths
from wire.warm_plan import Plan, WorkerStart, resolve_checkpoint
from wire.warm_seal import read_key

__all__ = ["STUCK_EXIT_CODE", "Worker", "main"]


class Worker:
    """The trainer in each generation of a warm worker (the generations themselves: inprocess/generations.py)."""

    def __init__(self, control: dist.Store, worker: str, start: WorkerStart, secret: bytes,
                 watch: dist.Store | None = None, connect: Callable[[], dist.Store] | None = None,
                 keep: frozenset[str] | None = None) -> None:
        self.start = start
        self.loop = GenerationLoop(control, worker, watch, connect, keep, secret=secret)
        self.replicas: Replicas | None = None
        self.trainer: Trainer | None = None

    @property
    def stop_requested(self) -> bool:
        return self.loop.stop_requested

    def serve(self, from_generation: int | None = None) -> int:
        return self.loop.serve(self._train, from_generation)

    def _train(self, plan: Plan, ready: Ready) -> None:
        rank, world = plan.assign[self.loop.worker], plan.world
        cfg = self._config(plan)
        run_dir = Path(self.start.run_dir)
        try:
            stride = replica_stride(world, plan.per_host or world)
            if self.replicas is None or (self.replicas.rank, self.replicas.world) != (rank, world):
                self.replicas = Replicas(rank, world, stride)  # a fresh rank (or a new layout): nothing it holds counts
            # NOTE: a group of its own for the replicas under NCCL (host tensors); on gloo the training group serves.
            self.replicas.group = dist.new_group(backend="gloo") if plan.backend != "gloo" else None
            resume = gather_resume_state(self.replicas, plan.at_most_step) if plan.resume == "memory" else None
            snapshot = resume.snapshot if resume is not None else None
            # NOTE: a fallback to the disk says why after "disk": the healer reads the source's first word.
            source = (f"memory step {snapshot.step}" if snapshot is not None else
                      f"disk ({resume.why})" if resume is not None else "disk")
            if rank == 0:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            self.trainer = Trainer(cfg, run_dir, snapshot=snapshot, replicas=self.replicas)
            if rank == 0 and plan.at_most_step is not None and snapshot is not None:
                # NOTE: a rollback in memory throws away what was trained after the snapshot, as one from a checkpoint
                # does: so are the disk's checkpoints of it. A fresh make test's warm rollback past a NaN had a rank
                # that could not leave the aborted generation; the cold restart after it resumed from the poisoned
                # step 16 on disk, and rolled back four times more until the restart budget was spent.
                self.trainer.checkpointer.abandon_after(snapshot.step, f"a state held in memory (warm rollback, "
                                                                       f"generation {plan.generation})")
            ready(source)
            if self.stop_requested:
                self.trainer.request_stop()
            self.trainer.run()
        finally:
            # NOTE: the group's sockets close only once nothing holds it (the trainer's modules, pipeline stages and
            # flight recorder do): a peer blocked in a collective with this rank, not with the dead one, is
            # released by that close (gloo's abort does not wake it), so the trainer goes before the group.
            self.trainer = None

    def _config(self, plan: Plan) -> TrainConfig:
        """The config the worker was started with, with what the plan changes: the batches to skip, the save and
        snapshot intervals, and the disk checkpoint to resume from (a name inside the started config's checkpoint
        directory, never a free path)."""
        overrides = [*self.start.overrides]
        if plan.skip_steps:
            overrides.append(f"skip_steps=[{','.join(map(str, plan.skip_steps))}]")
        if plan.every_steps is not None:
            overrides.append(f"checkpoint.every_steps={plan.every_steps}")
        if plan.snapshot_every_steps is not None:
            overrides.append(f"snapshot_every_steps={plan.snapshot_every_steps}")
        cfg = load_config(self.start.config, overrides)
        # NOTE: the disk is where a generation without a common snapshot (or the first) starts from.
        if plan.disk_resume == "auto":
            cfg.checkpoint.resume = "auto"
        elif plan.disk_resume is not None:
            root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else RunPaths(Path(self.start.run_dir)).checkpoints
            cfg.checkpoint.resume = str(resolve_checkpoint(root, plan.disk_resume))
        return cfg

    def request_stop(self) -> None:
        """SIGTERM: a final checkpoint and a clean exit, as under torchrun (async-signal safe: flags only)."""
        self.loop.stop_requested = True
        if self.trainer is not None:
            self.trainer.request_stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.warm.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--control", required=True, metavar="HOST:PORT", help="the pool's store")
    parser.add_argument("--worker", required=True, help="this worker's id in the pool")
    parser.add_argument("--key-file", required=True, help="the pool's key: a file of mode 0600 (wire/warm_seal.py)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--from-generation", type=int, default=None,
                        help="the first generation whose plan it reads (default: the newest written)")
    args = parser.parse_args(argv)
    faulthandler.enable()  # as train/__main__.py: a fatal signal prints the Python stacks first
    secret = read_key(args.key_file)
    connect = connect_to(args.control)
    control, watch = connect(), connect()
    start = WorkerStart(args.config, args.run_dir, tuple(args.overrides))
    worker = Worker(control, args.worker, start, secret, watch=watch, connect=connect, keep=open_sockets())
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.request_stop())
    return worker.serve(args.from_generation)


if __name__ == "__main__":
    code = main()
    # NOTE: out without the interpreter's shutdown, which joins every thread pool's threads: an async save that was
    # in flight when its generation was aborted can stay blocked in that generation's collective for good, and held
    # a worker whose job had finished (its own final save committed) at exit for the pool's whole timeout.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

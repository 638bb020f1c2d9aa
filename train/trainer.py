"""The training loop of one rank: build the parallel model, step, time every phase, record.

A Trainer is built once per process after the process group exists. Its public surface is
`run()`, plus `step()` for callers (tests, later the checkpoint layer) that drive it.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from exporters.client import RankClient
from exporters.flight_recorder import FlightRecorderDumper
from ground.names import derive_name
from inprocess import waits
from train.checkpoint.manager import Checkpointer
from train.checkpoint.state import ModelParts, capture, config_hash, layout_hash, load_template, model_hash, restore
from train.checkpoint.writers import writers
from train.config import TrainConfig
from train.data import PrefetchLoader, TokenSource, TokenStream, build_source
from train.ft.batches import SharedBatches
from train.ft.replicas import Quorum
from train.ft.steps import GroupSteps
from train.hang_faults import HangInjector
from train.layout import stage_ids, stage_layers, validate_layout
from train.mfu import Peak, flops_per_token, mfu, resolve_peak
from train.model import GPT, count_flop_params, cross_entropy_loss
from train.optim import build_lr_scheduler, build_optimizer
from train.parallelize import apply_data_parallel, apply_tensor_parallel
from train.param_checksum import ReplicaChecksum
from train.pipeline import build_schedule
from train.place import build_mesh, rank_device, rank_place
from train.records import StepRecordWriter, StepTable
from train.replica_faults import ReplicaFlipper
from train.rerun import Layout, Outcome, Rerunner
from train.sdc_faults import MatmulFlipper, ParamFlipper, this_node
from train.timing import PhaseTimer, TimedAllGather, TimedPipelineWaits, TimedReduceScatter
from train.warm.replicas import Replicas
from train.warm.snapshot import Snapshot
from wire import ft_env, rank_env
from wire.phase_now import ENV as PHASE_DIR_ENV
from wire.phase_now import PhaseBeacon
from wire.rerun import EVENT as RERUN_EVENT
from wire.rerun import RerunVerdict, event_fields
from wire.run_paths import RunPaths
from wire.step_record import StepRecord, to_line


class Trainer(GroupSteps):
    def __init__(self, cfg: TrainConfig, run_dir: Path, snapshot: Snapshot | None = None,
                 replicas: Replicas | None = None) -> None:
        """`snapshot`: resume from this in-memory state instead of the disk (a warm restart, same layout);
        `replicas`: keep snapshots in memory, and a peer's, as a warm worker does (train/warm/)."""
        self.cfg = cfg
        self.run_dir = run_dir
        world = dist.get_world_size() if dist.is_initialized() else 1
        validate_layout(cfg.parallel, cfg.model, cfg.global_batch, world)
        self.device = rank_device(cfg.device)
        self.mesh = build_mesh(cfg, self.device) if world > 1 else None
        self.place = rank_place(self.mesh, world)
        self.ft_env = ft_env.read(os.environ, cfg.ft.groups) if cfg.ft.enabled else None
        self.record_rank = self.place.rank + (self.ft_env.group * world if self.ft_env is not None else 0)
        """The rank's number in its records and telemetry: over the whole job, every replica group's ranks in turn."""
        attempt = os.environ.get(rank_env.ATTEMPT, "")
        self.attempt = int(attempt) if attempt.isdigit() else None
        """The job's attempt this trainer trains in (a warm worker makes one trainer per attempt): on every record."""
        # Where this rank is now, for the node agent when the job hangs (nothing is written unless asked for).
        self.beacon = PhaseBeacon.from_env(self.record_rank)
        if self.beacon is not None:
            # NOTE: the phases longer than a step have names of their own (startup, restore, checkpoint_save): the
            # healer learns how long each takes, so a slow save or restore is not called a hang.
            self.beacon.enter("startup", 0)
        self.hang = HangInjector(cfg.inject_hangs, self.place.rank, run_dir)
        self.replica_flips = ReplicaFlipper(cfg.inject_replica_flips, self.place.rank, run_dir)
        self.timer = PhaseTimer(self.device, on_enter=self._entering,
                                on_exit=self.beacon.leave if self.beacon is not None else None)
        self.reduce_timer = TimedReduceScatter(self.device)
        self.gather_timer = TimedAllGather(self.device)
        self.reduce_timer.beacon = self.gather_timer.beacon = self.beacon
        self._poisoned = False
        """The coming pass trains on the batch with inject_bad_sample in it: its loss is NaN."""
        self.chunks, self.stage_indices = self._build_chunks()
        self.schedule = self._build_schedule()
        self.flipper = MatmulFlipper(cfg.inject_matmul_flips, self.place.rank, list(self.chunks))
        self.param_flipper = ParamFlipper(cfg.inject_param_flips, self.place.rank, list(self.chunks), run_dir)
        self.rerun = self._rerunner(world)
        self._other_batches: TokenSource | None = None
        """Where a re-run's moved batches come from (made at the first one)."""
        self.pipeline_waits = TimedPipelineWaits(self.device) if self.schedule is not None else None
        if self.pipeline_waits is not None:
            self.pipeline_waits.activate()
            if not self.pipeline_waits.available and self.place.rank == 0:
                print("warning: this torch has no schedules._wait_batch_p2p: pipeline waits stay in forward_backward "
                      "(a slow stage's partners will look slow too)", flush=True)
        self.optimizer = build_optimizer(
            [(n, p) for chunk in self.chunks for n, p in chunk.named_parameters()], cfg.optim
        )
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.steps)
        self.flops_per_token = flops_per_token(
            count_flop_params(cfg.model), cfg.model.n_layers, cfg.model.dim, cfg.model.seq_len, cfg.model.window
        )
        self.peak = self._agree_on_peak()
        self.parts = ModelParts(self.chunks)
        checkpoints = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else RunPaths(run_dir).checkpoints
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            # NOTE: each replica group saves its own: a group that comes back alone resumes from its own, and is
            # brought to the others' step by a live peer
            checkpoints / f"group-{self.ft_env.group}" if self.ft_env is not None else checkpoints,
            self.place.rank,
            info={"layout": {"pp": cfg.parallel.pp, "dp": cfg.parallel.dp, "tp": cfg.parallel.tp,
                             "world_size": self.place.world_size},
                  "model_hash": model_hash(cfg.model),
                  "config_hash": config_hash(cfg),
                  "writers": writers(self.device, self.place.world_size)},
        )
        self.replicas = replicas
        self.layout = layout_hash(cfg)
        with self.beacon.inside("restore") if self.beacon is not None else nullcontext():
            self.step_index, start_sample = self._resume() if snapshot is None else self._resume_from(snapshot)
        self.loader: PrefetchLoader | SharedBatches
        if self.ft_env is None:
            self.loader = PrefetchLoader(
                TokenStream(
                    build_source(cfg.data, cfg.model.vocab_size),
                    cfg.model.seq_len,
                    cfg.global_batch,
                    dp_rank=self.place.dp,
                    dp_degree=cfg.parallel.dp,
                    start_sample=start_sample,
                ),
                cfg.data.prefetch,
            )
        else:
            self.loader = SharedBatches(build_source(cfg.data, cfg.model.vocab_size), cfg.model.seq_len,
                                        cfg.global_batch, self.place.dp, cfg.parallel.dp, start_sample)
        self.ft = self._replica_groups()
        self._quorum: Quorum | None = None
        self._stop_requested = False  # set by a signal handler on this rank
        self.stopping = False  # agreed by all ranks: save and leave after this step
        self.writer = StepRecordWriter(run_dir, self.record_rank)
        # The node sidecar's client: a null object unless MEGAHEAL_SIDECAR_SOCKET is set; never blocks.
        self.telemetry = RankClient.from_env(
            cfg.job or derive_name(run_dir.resolve().name), self.record_rank, self.place.local_rank,
            self.place.world_size, self.place.coords(),
        )
        self.telemetry.hello()
        self.table = StepTable() if self.place.rank == 0 else None
        self._host = socket.gethostname()
        # Every process group is made by now: the dump names each with its ranks.
        self.flight_recorder = FlightRecorderDumper.from_env(os.environ.get(PHASE_DIR_ENV))
        if self.beacon is not None:
            self.beacon.between(self.step_index)

    # ------------------------------------------------------------ construction

    def _build_chunks(self) -> tuple[list[GPT], list[int]]:
        """Build this rank's model chunks: meta init, own layers only, seeded weights, then TP and FSDP."""
        cfg, par = self.cfg, self.cfg.parallel
        indices = stage_ids(self.place.pp, par) if par.pp > 1 else [0]
        chunks = []
        for stage in indices:
            with torch.device("meta"):
                chunk = GPT(
                    cfg.model,
                    stage_layers(stage, par, cfg.model.n_layers) if par.pp > 1 else None,
                    with_embedding=stage == 0,
                    with_head=stage == par.n_stages - 1 or par.pp == 1,
                )
            chunk.to_empty(device=self.device)
            chunk.init_weights(cfg.seed)
            if par.tp > 1:
                apply_tensor_parallel(chunk, self.mesh["tp"], par.sequence_parallel)
            if par.dp > 1:
                apply_data_parallel(chunk, self.mesh["dp"], self.reduce_timer, self.gather_timer)
            chunks.append(chunk)
        return chunks, indices

    def _rerunner(self, world: int) -> Rerunner | None:
        """Every step's check and the re-runs of a suspect one (train/rerun.py), with the replicas' weights compared
        where the data-parallel ranks gather them (train/param_checksum.py)."""
        cfg, par = self.cfg.rerun, self.cfg.parallel
        if not cfg.enabled or world == 1 or self.cfg.ft.enabled:
            # NOTE: under replica groups, a step's check and re-runs would need the other groups' replicas (the
            # re-run of another share of the batch): not built yet, docs/operations.md says so
            return None
        pipelined = self.schedule is not None
        checksum = (ReplicaChecksum(list(self.chunks), self.mesh["dp"].get_group(), self.device, pipelined)
                    if cfg.replica_checksum and par.dp > 1 and self.mesh is not None else None)
        return Rerunner(cfg, Layout(pp=par.pp, dp=par.dp, tp=par.tp), list(self.chunks), self.device, this_node(),
                        pipelined=pipelined, checksum=checksum)

    def _build_schedule(self):
        if self.cfg.parallel.pp == 1:
            return None
        return build_schedule(
            self.chunks,
            self.stage_indices,
            self.cfg.parallel,
            self.mesh["pp"].get_group(),
            self.device,
            self._loss,
        )

    def _agree_on_peak(self) -> Peak:
        """Resolve the peak FLOP/s once, on rank 0 while the others wait, so a CPU probe is not contended."""
        if self.place.world_size == 1 or self.device.type == "cuda" or self.cfg.peak_flops:
            return resolve_peak(self.device, self.cfg.peak_flops)
        value = torch.zeros(1, dtype=torch.float64)
        source = [""]
        if self.place.rank == 0:
            peak = resolve_peak(self.device, self.cfg.peak_flops)
            value[0], source[0] = peak.flops_per_second, peak.source
        dist.broadcast(value, src=0)
        dist.broadcast_object_list(source, src=0)
        return Peak(flops_per_second=float(value[0]), source=source[0])

    def _resume(self) -> tuple[int, int]:
        """Load the checkpoint that checkpoint.resume selects; returns (steps done, next sample index)."""
        path = self.checkpointer.resume_path(model_hash(self.cfg.model))
        if path is None:
            return 0, 0
        # NOTE: rank 0 validated the manifest before choosing it (catalog.manifest_problems); an old one may lack
        # its layout: then the state is loaded as if resharded, which works for any layout.
        saved_world = json.loads((path / "manifest.json").read_text()).get("layout", {}).get("world_size")
        state = load_template(self.parts, self.optimizer, self.lr_scheduler, self.place.rank,
                              same_world=saved_world == self.place.world_size)
        self.checkpointer.load(state, path)
        return restore(state, self.parts, self.optimizer, self.lr_scheduler, self.place.rank)

    def _resume_from(self, snapshot: Snapshot) -> tuple[int, int]:
        """Put an in-memory snapshot of this rank back (no checkpoint file is read)."""
        state = load_template(self.parts, self.optimizer, self.lr_scheduler, self.place.rank, same_world=True)
        snapshot.fill(state, self.place.rank, self.layout)
        return restore(state, self.parts, self.optimizer, self.lr_scheduler, self.place.rank)

    def request_stop(self) -> None:
        """Ask for a final checkpoint and a clean exit (async-signal safe: only sets a flag)."""
        self._stop_requested = True

    # ------------------------------------------------------------ the step

    def _entering(self, phase: str) -> None:
        if self.beacon is not None:
            self.beacon.enter(phase, self.step_index)
        self.hang.maybe(self.step_index, phase)

    def step(self) -> StepRecord:
        """Run one optimizer step and return its record (also written to this rank's JSON lines). Under replica
        groups a step the groups did not commit (one was lost mid-way) is tried again with the groups left."""
        while True:
            record = self._try_step()
            if record is not None:
                return record

    def _try_step(self) -> StepRecord | None:
        t0 = time.perf_counter()
        timer = self.timer
        if self.ft is not None:
            with timer.phase("ft_quorum", host=True):
                self._quorum = self.ft.begin()
            if self._quorum.behind:
                self._wait_for_state(timer)
                return None
            assert isinstance(self.loader, SharedBatches)
            self.loader.share(self._quorum.participants, self._quorum.rank)
        position = self.loader.position
        with timer.phase("data_wait", host=True):
            if self.step_index in self.cfg.skip_steps:
                self.loader.next()  # passed over: this step trains on the batch after it
            batch_start = self.loader.position
            inputs, targets = self.loader.next()
            inputs = inputs.to(self.device, non_blocking=True)
            targets = targets.to(self.device, non_blocking=True)
        self.optimizer.zero_grad(set_to_none=True)
        self._prepare_pass(batch_start, self.place.dp)
        if self.rerun is not None:
            self.rerun.begin()
        with timer.phase("forward_backward"):
            loss = self._forward_backward(inputs, targets)
        reduce_enter_ns = self.reduce_timer.drain_into(timer)
        self.gather_timer.drain_into(timer)
        if self.pipeline_waits is not None:
            self.pipeline_waits.drain_into(timer)
        checked = self._check(loss, inputs, targets, batch_start)
        if self.ft is not None:
            with timer.phase("ft_reduce"):
                checked = self._average_over_groups(checked)
            if not self.ft.commit():
                self._abandon(position, timer)
                return None
        if checked.skip:
            # NOTE: the gradients left are a re-run's (other batches on other ranks) or the suspect step's: no
            # update is made of them. The schedule still steps, so the learning rate stays the step's.
            self.optimizer.zero_grad(set_to_none=True)
            grad_norm = torch.zeros((), device=self.device)
            lr = self.lr_scheduler.get_last_lr()[0]
            self.lr_scheduler.step()
        else:
            with timer.phase("grad_norm_clip"):
                grad_norm = self._clip_gradients()
            with timer.phase("optimizer"):
                self.optimizer.step()
                lr = self.lr_scheduler.get_last_lr()[0]
                self.lr_scheduler.step()
        if batch_start == self.cfg.inject_nan_at_sample:
            self._corrupt_weights(float("nan"), "set to NaN")
        elif batch_start == self.cfg.inject_spike_at_sample:
            self._corrupt_weights(4.0, "multiplied by 4")
        with self.beacon.inside("global_scalars") if self.beacon is not None else nullcontext():
            loss_value, grad_norm_value = self._global_scalars(checked.loss, grad_norm, checked.reported)
        if self.rerun is not None and not checked.skip:
            self.rerun.note(loss_value)
        with timer.phase("checkpoint", host=True):
            self._maybe_save(self.step_index + 1)
            self._maybe_snapshot(self.step_index + 1)
        phases = timer.collect()
        if self.device.type == "cpu":
            # On CPU the collectives run synchronously inside forward (gather) and backward (reduce): report
            # compute alone, so the phases add up to the step.
            for comm in ("dp_reduce", "dp_gather"):
                phases["forward_backward"] -= phases.get(comm, 0.0)
        # NOTE: on either device: the pipeline's waits block the stream forward/backward is timed on.
        phases["forward_backward"] -= phases.get("pp_wait", 0.0)
        step_seconds = time.perf_counter() - t0
        record = self._record(loss_value, grad_norm_value, lr, step_seconds, phases, reduce_enter_ns,
                              checked.verdict)
        line = to_line(record)
        self.writer.write(line)
        # NOTE: an async save (the default) of this step commits only now (Checkpointer.release): a kill between
        # its commit and this write (a stop's short grace running out) left a checkpoint of N steps without the
        # record of step N-1. A sync save (checkpoint.async_save false) still commits inside the step, so that the
        # step's checkpoint phase holds all of it.
        self.checkpointer.release()
        self.telemetry.step(line)
        if checked.verdict is not None:
            self._tell_verdict(checked.verdict)
        self._tell(record.checkpoint_events)
        if self.stopping and self.checkpointer.cfg.save_on_sigterm:
            # The job is about to exit: the stop's save must be committed first. Its event comes after the
            # step's record, and the record's checkpoint phase holds the save's staging only.
            with self.beacon.inside("checkpoint_save") if self.beacon is not None else nullcontext():
                self.checkpointer.wait()
            self._tell(self.checkpointer.drain_events())
        if self.table is not None and self.step_index % self.cfg.log_every == 0:
            self.table.row(line)
        self.step_index += 1
        if self.beacon is not None:
            self.beacon.between(self.step_index)
        return record

    def _tell(self, checkpoint_events: list[dict[str, Any]]) -> None:
        for event in checkpoint_events:
            self.telemetry.event(event["event"], **{k: v for k, v in event.items() if k != "event"})

    def _tell_verdict(self, verdict: RerunVerdict) -> None:
        """Rank 0 reports a re-run's verdict (every rank reached the same one from the same fingerprints)."""
        if self.place.rank != 0:
            return
        self.telemetry.event(RERUN_EVENT, **event_fields(verdict))
        print(f"step {verdict.step} re-run ({verdict.what}, {verdict.seconds:.2f} s): {verdict.verdict}"
              + (f", ranks {verdict.ranks}" if verdict.ranks else "")
              + (f", samples {verdict.samples}" if verdict.verdict == "data" else "")
              + ("; its update skipped" if verdict.skipped else ""), flush=True)

    # ------------------------------------------------------------ re-runs (train/rerun.py)

    def _check(self, loss: torch.Tensor | None, inputs: torch.Tensor, targets: torch.Tensor,
               batch_start: int) -> Outcome:
        """The step's check, and its re-runs when it is suspect."""
        if self.rerun is None:
            return Outcome(loss)
        local = self.cfg.global_batch // self.cfg.parallel.dp
        with self.timer.phase("rerun", host=True):
            checked = self.rerun.check(
                self.step_index, loss, lambda shift: self._rerun_pass(shift, inputs, targets, batch_start),
                lambda replica: (batch_start + replica * local, batch_start + (replica + 1) * local), self.attempt)
        if checked.verdict is not None or checked.skip:
            # The re-runs' collectives are the re-run's time (the `rerun` phase), not the step's reduce.
            scratch = PhaseTimer(self.device)
            self.reduce_timer.drain_into(scratch)
            self.gather_timer.drain_into(scratch)
            if self.pipeline_waits is not None:
                self.pipeline_waits.drain_into(scratch)
        return checked

    def _rerun_pass(self, shift: int, inputs: torch.Tensor, targets: torch.Tensor, batch_start: int
                    ) -> torch.Tensor | None:
        """The step's forward and backward again, on the batch of the replica `shift` further on."""
        self.optimizer.zero_grad(set_to_none=True)
        replica = (self.place.dp + shift) % self.cfg.parallel.dp
        if shift:
            inputs, targets = self._batch_of(replica, batch_start)
        self._prepare_pass(batch_start, replica)
        return self._forward_backward(inputs, targets)

    def _batch_of(self, replica: int, batch_start: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        if self._other_batches is None:
            self._other_batches = build_source(cfg.data, cfg.model.vocab_size)
        stream = TokenStream(self._other_batches, cfg.model.seq_len, cfg.global_batch, dp_rank=replica,
                             dp_degree=cfg.parallel.dp, start_sample=batch_start)
        inputs, targets = stream.next_batch()
        return inputs.to(self.device), targets.to(self.device)

    def _prepare_pass(self, batch_start: int, replica: int) -> None:
        """Before a forward pass on the batch of `replica`: the fault injections that may strike it."""
        self.flipper.arm(self.step_index)
        self.param_flipper.arm(self.step_index)
        bad, local = self.cfg.inject_bad_sample, self.cfg.global_batch // self.cfg.parallel.dp
        first = batch_start + replica * local
        self._poisoned = bad is not None and first <= bad < first + local

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy_loss(logits, targets)
        # Fault injection (inject_bad_sample): a batch the model cannot train on, on any rank.
        return loss * float("nan") if self._poisoned else loss

    def _corrupt_weights(self, factor: float, what: str) -> None:
        """Fault injection (inject_nan_at_sample, inject_spike_at_sample): every weight of this rank is multiplied
        by `factor`, as a bad batch can throw a model off (NaN: poisoned; 4: the loss spikes)."""
        with torch.no_grad():
            for chunk in self.chunks:
                for param in chunk.parameters():
                    param.mul_(factor)
        print(f"rank {self.place.rank}: fault injection: weights {what} after step {self.step_index}", flush=True)

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward over the step's batch; the mean loss where this rank computes it."""
        autocast = (
            torch.autocast(device_type="cuda", dtype=torch.bfloat16) if self.cfg.autocast_bf16 else nullcontext()
        )
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            has_first = 0 in self.stage_indices
            has_last = self.cfg.parallel.n_stages - 1 in self.stage_indices
            with autocast:
                self.schedule.step(
                    *([inputs] if has_first else []),
                    target=targets if has_last else None,
                    losses=losses if has_last else None,
                )
            return torch.stack(losses).mean().detach() if has_last else None
        # No pipeline: gradient accumulation over microbatches, with the dp reduce on the last one only.
        chunk = self.chunks[0]
        n = self.cfg.parallel.microbatches
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n))):
            if self.cfg.parallel.dp > 1:
                chunk.set_requires_gradient_sync(i == n - 1)
            with autocast:
                loss = self._loss(chunk(x), y) / n
            loss.backward()
            total += loss.detach()
        return total

    def _clip_gradients(self) -> torch.Tensor:
        """Global L2 norm of all gradients over the whole 3D mesh, then clip to optim.grad_clip."""
        params = [p for chunk in self.chunks for p in chunk.parameters() if p.grad is not None]

        def total_norm() -> torch.Tensor:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0, foreach=True)
            # NOTE: full_tensor sums the squares over the dp and tp shards; DTensor's collectives wait inside a C++
            # op, so in a warm generation this runs where its abort can end the wait (a rank stuck here for 20 s
            # after an abort exited 75 and opened a crash incident: tests/multihost/test_warm_across_hosts.py).
            return norm.full_tensor() if isinstance(norm, DTensor) else norm

        norm = waits.call(total_norm, "the gradients' norm")
        if self.cfg.parallel.pp > 1:
            # Each pp rank holds different layers: add the squares over the pipeline.
            squared = norm.float() ** 2
            waits.wait_collective(dist.all_reduce(squared, group=self.mesh["pp"].get_group(), async_op=True),
                                  "the gradients' norm over the pipeline")
            norm = squared.sqrt()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.optim.grad_clip, norm, foreach=True)
        return norm

    def _global_scalars(self, loss: torch.Tensor | None, grad_norm: torch.Tensor,
                        reported: float | None = None) -> tuple[float, float]:
        """The batch's mean loss on every rank (the last stage's tp-rank-0 values, averaged over dp; `reported`
        instead where the step's check gave one), and whether any rank was asked to stop, agreed in the same
        all-reduce."""
        if self.place.world_size == 1:
            self.stopping = self._stop_requested
            return float(loss), float(grad_norm)
        value = torch.zeros(2, dtype=torch.float64, device=self.device)
        if loss is not None and self.place.tp == 0:
            value[0] = loss.double() / self.cfg.parallel.dp
        value[1] = float(self._stop_requested)
        waits.wait_collective(dist.all_reduce(value, async_op=True), "the step's loss and stop flag")
        self.stopping = bool(value[1] > 0)
        return float(value[0]) if reported is None else reported, float(grad_norm)

    def _maybe_save(self, steps_done: int) -> None:
        ckpt = self.checkpointer
        final = steps_done == self.cfg.steps and ckpt.cfg.every_steps > 0
        preempted = self.stopping and ckpt.cfg.save_on_sigterm
        if not (ckpt.due(steps_done) or final or preempted):
            return
        with self.beacon.inside("checkpoint_save") if self.beacon is not None else nullcontext():
            state = capture(self.parts, self.optimizer, self.lr_scheduler, steps_done, self.loader.position,
                            self.place.rank)
            ckpt.save(state, steps_done, self.loader.position)  # waits for the previous save, when one is in flight

    def _maybe_snapshot(self, steps_done: int) -> None:
        """Under a warm worker: keep this rank's state in memory, and send a copy to its peer (train/warm/)."""
        every = self.cfg.snapshot_every_steps or self.checkpointer.cfg.every_steps
        if self.replicas is None or every <= 0 or steps_done % every:
            return
        state = capture(self.parts, self.optimizer, self.lr_scheduler, steps_done, self.loader.position,
                        self.place.rank)
        self.replicas.add(Snapshot.take(state, steps_done, self.place.rank, self.layout))
        self.replica_flips.maybe(self.replicas)

    def _record(
        self,
        loss: float,
        grad_norm: float,
        lr: float,
        step_seconds: float,
        phases: dict[str, float],
        reduce_enter_ns: int | None,
        verdict: RerunVerdict | None = None,
    ) -> StepRecord:
        tokens = self.cfg.global_batch * self.cfg.model.seq_len
        tps = tokens / step_seconds
        quorum = self._quorum if self.ft is not None else None
        # every group's ranks shared the step's tokens
        devices = self.place.world_size * (quorum.participants if quorum is not None else 1)
        return StepRecord(
            step=self.step_index, time=time.time(), loss=loss, grad_norm=grad_norm, lr=lr, tokens=tokens,
            step_seconds=step_seconds, tokens_per_second=tps,
            mfu=mfu(tps, self.flops_per_token, devices, self.peak),
            peak_flops=self.peak.flops_per_second, peak_source=self.peak.source, phases=phases,
            # CLOCK_MONOTONIC is shared by the processes of one host: comparable within a node.
            dp_reduce_enter_ns=reduce_enter_ns, sample_index=self.loader.position,
            checkpoint_events=self.checkpointer.drain_events(),
            # Linux reports ru_maxrss in KiB: the process's peak resident memory so far.
            max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            rank=self.record_rank, local_rank=self.place.local_rank, world_size=self.place.world_size,
            mesh=self.place.coords(), node=self._host, pid=os.getpid(), attempt=self.attempt,
            rerun=verdict.verdict if verdict is not None else None,
            replica_group=self.ft.group if self.ft is not None else None,
            replicas=quorum.participants if quorum is not None else None)

    # ------------------------------------------------------------ the loop

    def run(self) -> None:
        """Train for cfg.steps steps."""
        failed = False
        try:
            while self.step_index < self.cfg.steps and not self.stopping:
                self.step()
            # NOTE: the final save and the teardown take longer than a step: this tells the healer's hang
            # detector that the silence that follows is the job ending, not a hang.
            self.telemetry.event("finishing", step=self.step_index, reason="stop" if self.stopping else "done")
            if self.stopping and self.place.rank == 0:
                print(f"stopped on request after step {self.step_index - 1}", flush=True)
        except Exception as exc:
            # Tell the sidecar why this rank is going down, then let the exception end the process.
            self.telemetry.event("exception", type=type(exc).__name__, message=str(exc)[:500], step=self.step_index)
            failed = True
            raise
        finally:
            self.close(abandon=failed)

    def close(self, abandon: bool = False) -> None:
        """Release what the trainer holds; `abandon`: the process group broke (a peer died), so a save in flight
        is left to fail on its own instead of being waited for (the process lives on: a warm worker)."""
        if self.flight_recorder is not None:
            self.flight_recorder.close()
        if self.pipeline_waits is not None:
            self.pipeline_waits.close()
        self.flipper.close()
        self.param_flipper.close()
        if self.rerun is not None:
            self.rerun.close()
        if self.beacon is not None:
            self.beacon.close()
        self.checkpointer.close(wait=not abandon)
        if self.ft is not None:
            self.ft.close()
        self.loader.close()
        self.writer.close()
        self.telemetry.close()

"""Asynchronous checkpoints that survive faults, as MegaScale saves them: stage, then write in the background.

A save on every rank: `dcp.async_save` copies the state out (the only part training waits
for) and a background thread writes it. The save's commit point is rank 0's manifest, written
only after rank 0's upload finished, which DCP completes only once every rank's write result
was gathered; then `latest` moves atomically. A failed or killed save leaves no manifest, so
`latest` still names the previous good checkpoint. Rank 0 commits a save only once its caller
releases it (`release`, `wait` or `close`): the trainer first writes the record of the step the
save ends, so a checkpoint of N steps never stands without the record of step N-1.

Nothing that goes wrong with a save stops training: a failed write, manifest, `latest`,
retention or events.jsonl (a full disk, an I/O error) is a `checkpoint_failed` event naming the
stage, logged, and training goes on. A save that failed before `latest` moved does not count and
rank 0 deletes what it wrote, so a full disk is not kept full by half-written saves; saves cut
short by a kill are deleted when the job starts again.

Saves use their own gloo process group: an async save's collectives run in a background
thread, and sharing a group with training's collectives corrupts gloo's message stream.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from train.checkpoint import catalog
from train.checkpoint.faults import COMMIT_STAGES, FailingWriter, commit_fault

log = logging.getLogger(__name__)

# NOTE: DCP reports failures gathered from other ranks as CheckpointException, a BaseException,
# so `except Exception` alone would let one rank's full disk kill every rank.
SAVE_ERRORS = (Exception, CheckpointException)


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    every_steps: int = 0
    """Save after every this many steps; 0 disables periodic saves (SIGTERM still saves)."""
    dir: str | None = None
    """Checkpoint directory; default <run_dir>/checkpoints."""
    keep_last: int = 3
    """Complete checkpoints kept, newest first."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    async_save: bool = True
    """Write in the background while training goes on; false: block until written."""
    resume: str = "none"
    """none, auto (newest complete checkpoint that verifies, falling back to older ones) or a checkpoint path."""
    verify_checksums: bool = False
    """On resume also verify file checksums (sizes are always verified).

    NOTE: off by default, from bench/results/checkpoint.json ("checksums", 2-core machine): verifying them made a
    resume's own load 2.9x as long at 50M (0.81 s load + 1.54 s hashing) and 3.7x at 200M (1.92 s + 5.21 s), all
    of it on rank 0, which reads every rank's files (blake2b ~450 MiB/s on one core) while the load is spread over
    the ranks: at 1,000 ranks the check would read the whole checkpoint through one process, on the restart's
    critical path. Sizes catch what a crash or a full disk leaves (a short or missing file). The checksums are
    still written with every save (that doubles rank 0's commit, +91% / +99% over a sync save, but off training's
    path: async saves hash in the background), so `megaheal ckpt verify --checksums` or this option can look for
    silent corruption when it is suspected."""
    save_on_sigterm: bool = True
    """A SIGTERM (preemption) makes every rank write a final checkpoint and exit cleanly."""
    fail_writes_at: list[int] = field(default_factory=list)
    """Fault injection: saves at these steps fail inside the storage writer with ENOSPC, like a full disk."""
    fail_commit_at: dict[str, list[int]] = field(default_factory=dict)
    """Fault injection: stage of rank 0's commit (manifest, latest, retention, events) -> steps whose save fails
    there with ENOSPC, e.g. {"manifest": [4]}."""
    throttle_writes_at: list[int] = field(default_factory=list)
    """Fault injection: saves at these steps are slow, every rank's write taking as long as at throttle_mib_per_s,
    as on a throttled or overloaded store (nothing fails: the save is only slow)."""
    throttle_mib_per_s: float = 0.25
    """The rate of the throttled saves, MiB/s."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps must be >= 0, got {self.every_steps}")
        if self.keep_last < 1:
            raise ValueError(f"checkpoint.keep_last must be >= 1, got {self.keep_last}")
        if self.keep_every < 0:
            raise ValueError(f"checkpoint.keep_every must be >= 0, got {self.keep_every}")
        if not self.resume:
            raise ValueError("checkpoint.resume must be none, auto or a checkpoint directory")
        if not 0 < self.throttle_mib_per_s < float("inf"):
            raise ValueError(f"checkpoint.throttle_mib_per_s must be a finite number > 0, got "
                             f"{self.throttle_mib_per_s}")
        unknown = sorted(set(self.fail_commit_at) - set(COMMIT_STAGES))
        if unknown:
            raise ValueError(f"checkpoint.fail_commit_at: unknown stage(s) {', '.join(unknown)}; stages: "
                             f"{', '.join(COMMIT_STAGES)}")


@dataclass(slots=True)
class _PendingSave:
    step: int
    started: float
    finalized: Future
    released: threading.Event
    """Set once rank 0 may commit (the caller has written what must stand before the checkpoint does)."""


class Checkpointer:
    """Saves and resumes one rank's training state; every rank makes the same calls in the same order."""

    def __init__(self, cfg: CheckpointConfig, ckpt_dir: Path, rank: int, info: dict[str, Any]) -> None:
        self.cfg = cfg
        self.dir = ckpt_dir
        self.rank = rank
        self._info = info  # layout, model hash: goes into every manifest
        self._distributed = dist.is_initialized()
        self._group = dist.new_group(backend="gloo") if self._distributed else None
        self._finalizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-finalize")
        self._pending: _PendingSave | None = None
        # One staging buffer, reused by every async save: a save waits for the previous one, so the
        # buffer is free again, and re-staging into cached storage is ~5x faster than allocating anew.
        # Pinned memory and non-blocking copies only where there is a GPU to copy from.
        cuda = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda,
        )) if cfg.async_save else None
        # Appended by the finalizer thread, drained by the training loop (deque ops are thread-safe).
        self._events: deque[dict[str, Any]] = deque()
        if rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)

    def due(self, steps_done: int) -> bool:
        return self.cfg.every_steps > 0 and steps_done % self.cfg.every_steps == 0

    # ------------------------------------------------------------ save

    def save(self, state: dict[str, Any], steps_done: int, sample_index: int) -> None:
        """Start saving `state` (training may change its tensors as soon as this returns). Rank 0 commits it once
        `release()` (or `wait()`, `close()`) is called; a sync save waits here, so it commits before returning."""
        self.wait()  # one save in flight at a time: the next waits for the previous
        path = self.dir / catalog.step_dir_name(steps_done)
        if self.rank == 0 and path.is_dir():
            self._withdraw(path)
        slow = steps_done in self.cfg.throttle_writes_at
        writer = FailingWriter(path, fail=steps_done in self.cfg.fail_writes_at,
                               mib_per_s=self.cfg.throttle_mib_per_s if slow else 0.0)
        started = time.time()
        kwargs = dict(checkpoint_id=path, storage_writer=writer, process_group=self._group,
                      no_dist=not self._distributed)
        if self._stager is not None:
            upload: Future = dcp.async_save(state, async_stager=self._stager, **kwargs)
        else:
            upload = Future()
            try:
                upload.set_result(dcp.save(state, **kwargs))
            except SAVE_ERRORS as exc:  # a failed save is reported by _finalize; training goes on
                upload.set_exception(exc)
        manifest_info = {**self._info, "step": steps_done, "data": {"sample_index": sample_index}}
        released = threading.Event()
        finalized = self._finalizer.submit(self._finalize, upload, path, manifest_info, started, released)
        self._pending = _PendingSave(step=steps_done, started=started, finalized=finalized, released=released)
        if self._stager is None:
            self.wait()

    @staticmethod
    def _withdraw(path: Path) -> None:
        """Rank 0, before the save that writes into an existing directory (a step saved again after a rollback or
        a corrupt checkpoint): no old manifest may stand over new shards while they are written."""
        try:
            catalog.withdraw(path)
        except OSError:
            # NOTE: every rank must make the same save call, so rank 0 cannot skip this one; the new manifest
            # replaces the old one at commit, and only a kill before that would leave it standing.
            log.warning("checkpoint: cannot withdraw the old manifest of %s before saving into it", path,
                        exc_info=True)

    def _finalize(self, upload: Future, path: Path, info: dict[str, Any], started: float,
                  released: threading.Event) -> dict[str, Any]:
        """Background: wait for the write, then (rank 0, once released) commit the manifest, move `latest`, apply
        retention. Returns the save's event; a failure is an event too, never an exception (training goes on)."""
        try:
            upload.result()
        except SAVE_ERRORS as exc:  # any write failure means: this save does not count
            event = self._failure(path, info["step"], "write", exc, committed=False)
        else:
            event = {"event": "checkpoint_saved", "step": info["step"], "write_seconds": time.time() - started}
            if self.rank == 0:
                released.wait()
                event = self._commit(path, {**info, "write_seconds": event["write_seconds"]}, event)
        return self._record(event)

    def _commit(self, path: Path, info: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
        """Rank 0: the manifest (the commit point), then `latest`, then retention. The save counts only once
        `latest` names it; a failure of retention leaves it committed (and older saves on disk)."""
        step, stage = info["step"], "manifest"
        try:
            commit_fault(self.cfg.fail_commit_at, stage, step)
            manifest = catalog.write_manifest(path, info)
            stage = "latest"
            commit_fault(self.cfg.fail_commit_at, stage, step)
            catalog.mark_latest(self.dir, path)
        except OSError as exc:
            return self._failure(path, step, stage, exc, committed=False)
        event["bytes"] = sum(f["size"] for f in manifest["files"])
        try:
            commit_fault(self.cfg.fail_commit_at, "retention", step)
            self._apply_retention()
        except OSError as exc:
            return self._failure(path, step, "retention", exc, committed=True)
        return event

    def _failure(self, path: Path, step: int, stage: str, exc: BaseException, committed: bool) -> dict[str, Any]:
        """The checkpoint_failed event of the save of `step` at `stage`, logged. A save that does not count is
        deleted by rank 0: by now every rank has finished writing it (DCP gathers every write result first)."""
        event = {"event": "checkpoint_failed", "step": step, "stage": stage, "committed": committed,
                 "error": f"{type(exc).__name__}: {exc}"}
        if committed:
            log.error("checkpoint at step %d is committed, but its %s failed: %s", step, stage, event["error"])
            return event
        log.error("checkpoint at step %d failed (%s); latest stays %s: %s",
                  step, stage, catalog.read_latest(self.dir), event["error"])
        if self.rank == 0 and path.is_dir():
            try:
                catalog.remove(path)
            except OSError as cleanup:
                log.error("checkpoint: cannot delete the failed save %s", path, exc_info=True)
                event["cleanup_error"] = f"{type(cleanup).__name__}: {cleanup}"
        return event

    def _apply_retention(self) -> None:
        victims = catalog.retention_victims(
            catalog.list_checkpoints(self.dir), self.cfg.keep_last, self.cfg.keep_every,
            catalog.read_latest(self.dir),
        )
        for victim in victims:
            catalog.remove(victim)

    def drain_events(self) -> list[dict[str, Any]]:
        """Saves that finished or failed since the last call."""
        events = []
        while self._events:
            events.append(self._events.popleft())
        return events

    def _record(self, event: dict[str, Any]) -> dict[str, Any]:
        """Keep `event` for drain_events and (rank 0) append it to events.jsonl; returns it as recorded. An append
        that fails is undone (no torn line) and the event says so: a committed save becomes a checkpoint_failed
        at stage events, committed."""
        if self.rank == 0:
            try:
                commit_fault(self.cfg.fail_commit_at, "events", event["step"])
                _append_line(self.dir / "events.jsonl", json.dumps({"time": time.time(), **event}))
            except OSError as exc:
                log.error("checkpoint: cannot append to %s", self.dir / "events.jsonl", exc_info=True)
                error = f"{type(exc).__name__}: {exc}"
                event = ({"event": "checkpoint_failed", "step": event["step"], "stage": "events", "committed": True,
                          "error": error} if event["event"] == "checkpoint_saved" else {**event, "events_error": error})
        self._events.append(event)
        return event

    def release(self) -> None:
        """Let rank 0 commit the save in flight (if any) as soon as it is written."""
        if self._pending is not None:
            self._pending.released.set()

    def wait(self) -> dict[str, Any] | None:
        """Release the save in flight (if any) and block until it is written and committed; returns its event."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        pending.released.set()
        return pending.finalized.result()

    def close(self, wait: bool = True) -> None:
        """`wait` False: do not wait for a save in flight (its collectives may wait on a peer that died)."""
        # NOTE: released either way: the finalizer thread must not stay parked on it (the interpreter joins the
        # executor's threads at exit), and a save that was written may count.
        self.release()
        if wait:
            self.wait()
        self._finalizer.shutdown(wait=wait)
        if self._stager is not None:
            self._stager.close()

    # ------------------------------------------------------------ resume

    def resume_path(self, model_hash: str) -> Path | None:
        """The checkpoint to resume from under cfg.resume, decided by rank 0 and shared with all. Rank 0 first
        deletes saves cut short by a kill (nothing else writes checkpoints while a job starts)."""
        choice: list[str | None] = [None]
        if self.rank == 0:
            self._remove_interrupted()
            choice[0] = self._choose(model_hash)
        if self._distributed:
            dist.broadcast_object_list(choice, src=0, group=self._group)
        return Path(choice[0]) if choice[0] else None

    def _choose(self, model_hash: str) -> str | None:
        mode = self.cfg.resume
        if mode == "none":
            return None
        if mode != "auto":
            info = next((c for c in catalog.list_checkpoints(Path(mode).parent) if c.path == Path(mode)), None)
            problems = catalog.verify(info, self.cfg.verify_checksums) if info else ["not a checkpoint directory"]
            if problems or info is None:
                raise FileNotFoundError(f"checkpoint.resume={mode}: cannot resume: {'; '.join(problems)}")
            self._abandon_newer(info)
            return mode
        result = catalog.choose_resume(self.dir, model_hash, self.cfg.verify_checksums)
        for name, why in result.skipped:
            print(f"resume: skipping {self.dir / name}: {why}", flush=True)
        if result.checkpoint is None:
            print(f"resume: no usable checkpoint in {self.dir}; starting from step 0", flush=True)
            return None
        print(f"resume: loading {result.checkpoint.path} (step {result.checkpoint.step})", flush=True)
        return str(result.checkpoint.path)

    def _remove_interrupted(self) -> None:
        for info in catalog.list_checkpoints(self.dir):
            if info.complete:
                continue
            print(f"resume: deleting {info.path}: a save cut short (no manifest)", flush=True)
            try:
                catalog.remove(info.path)
            except OSError:
                log.warning("checkpoint: cannot delete the interrupted save %s", info.path, exc_info=True)

    def _abandon_newer(self, resumed: catalog.CheckpointInfo) -> None:
        """Resuming from an explicit checkpoint (the healer's rollback past a NaN or a loss spike names one) starts
        a new history: mark this run's newer checkpoints abandoned, so that no later `--resume auto` goes back to
        what the attempt with the NaN or the spike wrote, and point `latest` at where training went back to."""
        self.abandon_after(resumed.step, resumed.path)

    def abandon_after(self, step: int, resumed: Path | str) -> None:
        """Mark this run's checkpoints newer than `step` abandoned: training went back to `resumed` (a checkpoint, or
        a state held in memory: a warm rollback), and they belong to the history thrown away. Rank 0 only."""
        try:
            abandoned = catalog.abandon_newer(self.dir, resumed, step)
            if abandoned and isinstance(resumed, Path) and resumed.parent.resolve() == self.dir.resolve():
                catalog.mark_latest(self.dir, resumed)
        except OSError as exc:
            # NOTE: fail closed: training on without the markers would leave the poisoned checkpoints to the next
            # --resume auto.
            raise RuntimeError(f"resuming from {resumed}: cannot mark the checkpoints of {self.dir} newer than step "
                               f"{step} abandoned ({exc}); not training on") from exc
        for name in abandoned:
            print(f"resume: {self.dir / name} abandoned: training goes back to {resumed} (step {step})", flush=True)

    def load(self, state: dict[str, Any], path: Path) -> None:
        """Fill `state` (shaped for this layout) from the checkpoint at `path`, resharding as needed."""
        dcp.load(state, checkpoint_id=path, process_group=self._group, no_dist=not self._distributed)


def _append_line(path: Path, line: str) -> None:
    """Append `line` and a newline; on failure (a full disk) cut the file back to where it was, so that no torn
    line is left for the next record to run into."""
    data = (line + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError:
            os.ftruncate(fd, size)
            raise
    finally:
        os.close(fd)

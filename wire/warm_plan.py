"""The control plane of warm workers: what a pool tells its workers, through a key-value store every worker reaches.

The pool (train/warm/pool.py, or the healer's healer/launchers/warm_control.py) holds a torch.distributed TCPStore;
the workers (train/warm/worker.py, inprocess/generations.py) connect to it as clients. Keys, all under `warm/`:

    hello/<worker>        the worker's pid: it is up, torch and the trainer imported, waiting for a plan
    plan/<g>              generation g's plan (JSON, Plan below); `gen` holds the newest g
    ready/<g>/<worker>    the worker built its trainer in generation g and resumed (from <source>)
    end/<g>/<worker>      how its generation ended for it: "ok", or "failed: <why>"

Every value is sealed with the pool's key (wire/warm_seal.py): the store takes writes from any client that reaches
it, and a value that is not sealed is refused as if absent. A plan carries generations and assignments only,
what a rollback changes (where to resume from, batches to skip) and the save and snapshot intervals the healer tuned: what runs (the trainer's config, its overrides, the
run directory, and with it the checkpoint root) is fixed when a worker is started (WorkerStart), by the pool or by
the node agent from the healer's authenticated start order. A plan's checkpoint is a name inside that root.

A generation is one formation of the job's process group: the first one, then one per warm restart. Its process
group lives under the store prefix `gen/<g>/`, so no key of a broken generation is ever read by the next one
(the failure torchrun's restarts hit in torch 2.13, see train/entry.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from wire.warm_seal import SealedStore

PREFIX = "warm/"
RESUMES = ("memory", "disk")
BACKENDS = ("gloo", "nccl")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


@dataclass(frozen=True, slots=True)
class Plan:
    generation: int
    world: int
    assign: dict[str, int]
    """worker id -> its global rank in this generation (the others stay standbys)."""
    local_rank: dict[str, int]
    per_host: int = 0
    """Ranks per host, for where replicas live (0: all on one host)."""
    resume: str = "memory"
    """memory: from the newest snapshot every rank has (the disk when none); disk: from the newest checkpoint."""
    disk_resume: str | None = "auto"
    """What a rank resumes from when it resumes from the disk: auto (the newest good checkpoint), a checkpoint's
    name in the checkpoint root the worker was started with (`step-00000008`: a rollback that found no snapshot old
    enough in memory), or None (what the config says)."""
    at_most_step: int | None = None
    """Resume from a state at or before this step (a rollback past a bad step)."""
    skip_steps: list[int] = field(default_factory=list)
    """Steps whose batches are passed over (every rollback's so far): they take the place of the worker's own."""
    every_steps: int | None = None
    """checkpoint.every_steps for this generation, where the healer tuned it (healer/launchers/save_tuning.py);
    None: the worker's own."""
    snapshot_every_steps: int | None = None
    """snapshot_every_steps likewise."""
    stop: bool = False
    """No generation: every worker that reads this exits."""
    backend: str = "gloo"
    timeout_s: float = 60.0
    """Collective timeout of the generation's process group."""

    def __post_init__(self) -> None:
        if self.resume not in RESUMES or self.backend not in BACKENDS:
            raise ValueError(f"plan {self.generation}: resume must be one of {RESUMES}, backend one of {BACKENDS}")
        if self.disk_resume not in (None, "auto") and checkpoint_name(self.disk_resume) != self.disk_resume:
            raise ValueError(f"plan {self.generation}: disk_resume names a checkpoint, not a path")
        if any(not isinstance(s, int) or s < 0 for s in self.skip_steps) or (self.at_most_step or 0) < 0:
            raise ValueError(f"plan {self.generation}: steps are integers >= 0")
        for every in (self.every_steps, self.snapshot_every_steps):
            if every is not None and (not isinstance(every, int) or every < 1):
                raise ValueError(f"plan {self.generation}: an interval is an integer >= 1 of steps, got {every!r}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        raw: dict[str, Any] = json.loads(text)
        try:
            return cls(**raw)
        except TypeError as exc:  # a field this version does not know, or one missing
            raise ValueError(f"not a plan: {exc}") from exc


@dataclass(frozen=True, slots=True)
class WorkerStart:
    """What a worker of megaheal's trainer runs, fixed when it is started (never read from the store): given on its
    command line by the pool, or by the node agent from the healer's start order."""

    config: str
    run_dir: str
    overrides: tuple[str, ...] = ()
    """`--set` items (KEY=VALUE), the run's own: the job's name, the dp degree, a rollback's batches to skip."""

    def argv(self) -> list[str]:
        return ["--config", self.config, "--run-dir", self.run_dir, *(a for o in self.overrides for a in ("--set", o))]


def key(*parts: object) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


def write_plan(store: SealedStore, plan: Plan, newest: bool = True) -> None:
    """Generation `plan.generation`'s plan, sealed; `newest`: `gen` says it is the newest."""
    store.set(key("plan", plan.generation), plan.to_json())
    if newest:
        store.set(key("gen"), str(plan.generation))


def read_plan(store: SealedStore, generation: int) -> Plan | None:
    """Generation `generation`'s plan; None while there is none sealed with the pool's key (a value a client
    without it wrote is refused, and logged, by the store)."""
    text = store.get(key("plan", generation))
    if text is None:
        return None
    plan = Plan.from_json(text)
    if plan.generation != generation:
        raise ValueError(f"the plan under {key('plan', generation)} is generation {plan.generation}'s")
    return plan


# ---- the checkpoint a plan names ------------------------------------------------------------------------------


def checkpoint_name(resume: str) -> str:
    """The name a plan gives checkpoint `resume` (a path, or already a name): its last part, a plain name (no `/`,
    no `..`, no leading dot); ValueError otherwise."""
    name = resume.rstrip("/").rpartition("/")[2]
    if not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{resume!r} does not name a checkpoint (a directory's name: step-00000008)")
    return name


def resolve_checkpoint(root: Path, name: str) -> Path:
    """Checkpoint `name` of a plan inside `root`, the checkpoint directory the worker was started with; ValueError
    for a name that is not a plain name or that leads out of `root` (a link)."""
    path = root / checkpoint_name(name)
    if name != path.name or path.resolve().parent != root.resolve():
        raise ValueError(f"checkpoint {name!r} is not a directory of {root}")
    return path


def keeper_hosts(nodes: tuple[str, ...] | list[str]) -> dict[str, str]:
    """Per host of a warm job (in node-rank order), the host whose ranks keep the replicas of its ranks' snapshots:
    the next one, as a rank's keeper is `per_host` ranks on (train/warm/replicas.py); none for a job on one host,
    whose replicas never leave it."""
    return {n: nodes[(i + 1) % len(nodes)] for i, n in enumerate(nodes)} if len(nodes) > 1 else {}

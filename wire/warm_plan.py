"""The control plane of warm workers: what a pool tells its workers, through a key-value store every worker reaches.

The pool (train/warm/pool.py) holds a torch.distributed TCPStore; the workers (train/warm/worker.py) connect to it
as clients. Keys, all under `warm/`:

    hello/<worker>        the worker's pid: it is up, torch and the trainer imported, waiting for a plan
    plan/<g>              generation g's plan (JSON, Plan below); `gen` holds the newest g
    ready/<g>/<worker>    the worker built its trainer in generation g and resumed (from <source>)
    end/<g>/<worker>      how its generation ended for it: "ok", or "failed: <why>"

A generation is one formation of the job's process group: the first one, then one per warm restart. Its process
group lives under the store prefix `gen/<g>/`, so no key of a broken generation is ever read by the next one
(the failure torchrun's restarts hit in torch 2.13, see train/entry.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

PREFIX = "warm/"


@dataclass(frozen=True, slots=True)
class Plan:
    generation: int
    world: int
    assign: dict[str, int]
    """worker id -> its global rank in this generation (the others stay standbys)."""
    local_rank: dict[str, int]
    config: str
    run_dir: str
    overrides: list[str] = field(default_factory=list)
    per_host: int = 0
    """Ranks per host, for where replicas live (0: all on one host)."""
    resume: str = "memory"
    """memory: from the newest snapshot every rank has (the disk when none); disk: from the newest checkpoint."""
    disk_resume: str | None = "auto"
    """What a rank resumes from when it resumes from the disk: auto (the newest good checkpoint), a checkpoint's
    path (a rollback that found no snapshot old enough in memory), or None (what the config says)."""
    at_most_step: int | None = None
    """Resume from a state at or before this step (a rollback past a bad step)."""
    stop: bool = False
    """No generation: every worker that reads this exits."""
    backend: str = "gloo"
    timeout_s: float = 60.0
    """Collective timeout of the generation's process group."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        raw: dict[str, Any] = json.loads(text)
        return cls(**raw)


def key(*parts: object) -> str:
    return PREFIX + "/".join(str(p) for p in parts)

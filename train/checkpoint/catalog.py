"""The checkpoint directory on disk: manifests, the `latest` marker, verification and retention.

Layout of `<ckpt_dir>`:
    step-00000008/            one torch.distributed.checkpoint save (.metadata, __<rank>_<n>.distcp)
    step-00000008/manifest.json   written by rank 0 only after every rank finished writing
    latest                    the name of the newest complete checkpoint, replaced atomically

A directory without a manifest is incomplete (a save still running, failed or killed) and is
never resumed from. This module is plain file handling, with no process group, so the CLI
(`megaheal ckpt`) and the trainer share it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old or the new content, never a mix.

    Write a temp file, fsync it, rename it over the target, then fsync the directory so the
    rename itself survives a power loss.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def file_checksum(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "blake2b").hexdigest()


def describe_files(ckpt: Path, checksums: bool = True) -> list[dict[str, Any]]:
    """Name, size and (optionally) checksum of every file a save wrote, sorted by name."""
    files = []
    for path in sorted(p for p in ckpt.iterdir() if p.is_file() and p.name != MANIFEST):
        entry: dict[str, Any] = {"name": path.name, "size": path.stat().st_size}
        if checksums:
            entry["blake2b"] = file_checksum(path)
        files.append(entry)
    return files


def write_manifest(ckpt: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Describe the finished save in `ckpt` and write its manifest (the save's commit point)."""
    manifest = {"format": FORMAT_VERSION, **info, "files": describe_files(ckpt), "completed_at": time.time()}
    atomic_write_text(ckpt / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def mark_latest(ckpt_dir: Path, ckpt: Path) -> None:
    atomic_write_text(ckpt_dir / LATEST, ckpt.name + "\n")


def read_latest(ckpt_dir: Path) -> str | None:
    try:
        return (ckpt_dir / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- reading and verifying


@dataclass(slots=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.manifest is not None

    @property
    def status(self) -> str:
        if not self.complete:
            return "incomplete"
        return "corrupt" if self.problems else "ok"


def list_checkpoints(ckpt_dir: Path) -> list[CheckpointInfo]:
    """Every step directory, newest first, with its manifest where one was written."""
    found = []
    if not ckpt_dir.is_dir():
        return found
    for path in ckpt_dir.iterdir():
        match = _STEP_DIR.match(path.name)
        if not match or not path.is_dir():
            continue
        info = CheckpointInfo(path=path, step=int(match.group(1)), manifest=None)
        try:
            info.manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            pass
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            info.manifest = {}
            info.problems.append(f"{MANIFEST}: unreadable ({exc})")
        found.append(info)
    return sorted(found, key=lambda c: c.step, reverse=True)


def verify(info: CheckpointInfo, checksums: bool = False) -> list[str]:
    """Problems that make `info` unusable (empty list: good). Sizes always, checksums when asked."""
    if not info.complete:
        return ["no manifest: the save did not complete"]
    problems = list(info.problems)
    for entry in info.manifest.get("files", []):
        path = info.path / entry["name"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{entry['name']}: missing")
            continue
        if size != entry["size"]:
            problems.append(f"{entry['name']}: size {size} bytes, manifest says {entry['size']}")
        elif checksums and file_checksum(path) != entry.get("blake2b"):
            problems.append(f"{entry['name']}: checksum mismatch")
    if not info.manifest.get("files") and not info.problems:
        problems.append("manifest lists no files")
    info.problems = problems
    return problems


@dataclass(frozen=True, slots=True)
class ResumeChoice:
    checkpoint: CheckpointInfo | None
    skipped: list[tuple[str, str]]
    """(checkpoint name, why it was passed over), newest first."""


def choose_resume(ckpt_dir: Path, model_hash: str | None = None, checksums: bool = False) -> ResumeChoice:
    """The newest complete checkpoint that verifies (and matches the model, when a hash is given)."""
    skipped = []
    for info in list_checkpoints(ckpt_dir):
        problems = verify(info, checksums)
        if not problems and model_hash is not None and info.manifest.get("model_hash") != model_hash:
            problems = [f"saved for another model (hash {info.manifest.get('model_hash')}, this run {model_hash})"]
        if problems:
            skipped.append((info.path.name, "; ".join(problems)))
            continue
        return ResumeChoice(checkpoint=info, skipped=skipped)
    return ResumeChoice(checkpoint=None, skipped=skipped)


def retention_victims(infos: list[CheckpointInfo], keep_last: int, keep_every: int, latest: str | None) -> list[Path]:
    """Directories to delete: complete saves beyond the newest `keep_last` that are not a multiple of
    `keep_every`, and incomplete ones older than the newest complete save (never `latest`)."""
    complete = [c for c in infos if c.complete]
    kept = {c.path.name for c in complete[:keep_last]}
    if keep_every > 0:
        kept |= {c.path.name for c in complete if c.step % keep_every == 0}
    if latest:
        kept.add(latest)
    newest_complete = complete[0].step if complete else -1
    victims = []
    for c in infos:
        if c.path.name in kept:
            continue
        if c.complete or c.step < newest_complete:
            victims.append(c.path)
    return victims

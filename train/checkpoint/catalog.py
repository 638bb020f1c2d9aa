"""The checkpoint directory on disk: manifests, the `latest` marker, verification and retention.

Layout of `<ckpt_dir>`:
    step-00000008/            one torch.distributed.checkpoint save (.metadata, __<rank>_<n>.distcp)
    step-00000008/manifest.json   written by rank 0 only after every rank finished writing
    step-00000012/abandoned.json  left by a rollback: training went back to an older checkpoint
    latest                    the name of the newest complete checkpoint, replaced atomically

A directory without a manifest is incomplete (a save still running, failed or killed) and is
never resumed from. Nor is an abandoned one: when a job resumes from an explicit checkpoint (a
rollback past a NaN or a loss spike, or an operator's choice), every complete checkpoint newer
than it was written by the history being thrown away, and `--resume auto` must never go back to
it. The marker sits in the checkpoint it condemns, so a later save of the same step (which
removes it first) is not condemned with it. A manifest is read as untrusted input: anything
that does not describe files inside its own directory is a problem named in words, never a crash.
This module is plain file handling, with no process group, so the CLI (`megaheal ckpt`) and the
trainer share it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
ABANDONED = "abandoned.json"
LATEST = "latest"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")
# Files of a save's directory that are the catalog's, not the save's: never listed in a manifest.
_OWN_FILES = (MANIFEST, ABANDONED)

log = logging.getLogger(__name__)


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old or the new content, never a mix.

    Write a temp file, fsync it, rename it over the target, then fsync the directory so the
    rename itself survives a power loss. A failure (a full disk) removes the temp file again:
    a disk that is full must not fill further with our leftovers.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # NOTE: BaseException: a SIGTERM's exit or a Ctrl-C in the middle must not leave the temp file either.
        log.warning("writing %s failed; its temp file is removed", path, exc_info=True)
        tmp.unlink(missing_ok=True)
        raise
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
    for path in sorted(p for p in ckpt.iterdir() if p.is_file() and p.name not in _OWN_FILES):
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
    """The checkpoint name `latest` holds; None when there is none, or when it holds no checkpoint name."""
    try:
        name = (ckpt_dir / LATEST).read_bytes().strip().decode("ascii")
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return name if _STEP_DIR.match(name) else None


def abandon_newer(ckpt_dir: Path, resumed: Path | str, step: int) -> list[str]:
    """Mark every complete checkpoint of `ckpt_dir` newer than `step` abandoned: training resumed from `resumed`
    (at `step`), so they belong to a history that was thrown away. Returns their names; raises OSError when a
    marker cannot be written (then `--resume auto` could still pick one: the caller must not train on)."""
    abandoned = []
    for info in list_checkpoints(ckpt_dir):
        if info.step > step and info.complete and info.abandoned is None:
            marker = {"resumed_from": str(resumed), "resumed_step": step, "time": time.time()}
            atomic_write_text(info.path / ABANDONED, json.dumps(marker) + "\n")
            abandoned.append(info.path.name)
    return abandoned


def withdraw(ckpt: Path) -> None:
    """Make `ckpt` incomplete before a save writes into it again: its manifest first (so no moment shows an old
    manifest over new shards, or a new save still marked abandoned), then its abandoned marker."""
    (ckpt / MANIFEST).unlink(missing_ok=True)
    (ckpt / ABANDONED).unlink(missing_ok=True)


def remove(ckpt: Path) -> None:
    """Delete a checkpoint directory and everything in it (retention, a failed save, an interrupted one)."""
    shutil.rmtree(ckpt)


# ---------------------------------------------------------------- reading and verifying


@dataclass(slots=True)
class CheckpointInfo:
    path: Path
    step: int
    manifest: dict[str, Any] | None
    """The manifest as written ({} when it is unreadable or invalid: see problems); None: no manifest."""
    problems: list[str] = field(default_factory=list)
    abandoned: str | None = None
    """Why a rollback abandoned this checkpoint; None when it did not."""

    @property
    def complete(self) -> bool:
        return self.manifest is not None

    @property
    def status(self) -> str:
        if not self.complete:
            return "incomplete"
        if self.abandoned is not None:
            return "abandoned"
        return "corrupt" if self.problems else "ok"


def list_checkpoints(ckpt_dir: Path) -> list[CheckpointInfo]:
    """Every step directory, newest first, with its manifest where one was written."""
    found: list[CheckpointInfo] = []
    if not ckpt_dir.is_dir():
        return found
    for path in ckpt_dir.iterdir():
        match = _STEP_DIR.match(path.name)
        if not match or not path.is_dir():
            continue
        info = CheckpointInfo(path=path, step=int(match.group(1)), manifest=None)
        _read_manifest(info)
        if info.complete:
            info.abandoned = _read_abandoned(path)
        found.append(info)
    return sorted(found, key=lambda c: c.step, reverse=True)


def _read_manifest(info: CheckpointInfo) -> None:
    """Fill info.manifest from its file, or name in info.problems why it cannot be trusted."""
    try:
        raw = json.loads((info.path / MANIFEST).read_bytes())
    except FileNotFoundError:
        return
    # NOTE: ValueError covers bad JSON, bytes that are not UTF-8 and integers past Python's 4300-digit limit;
    # RecursionError a JSON document nested deeper than the interpreter's stack (tests/fuzz).
    except (OSError, ValueError, RecursionError) as exc:
        info.manifest = {}
        info.problems.append(f"{MANIFEST}: unreadable ({type(exc).__name__}: {str(exc)[:200]})")
        return
    problems = manifest_problems(raw, info.step)
    info.manifest = {} if problems else raw
    info.problems += [f"{MANIFEST}: {p}" for p in problems]


def manifest_problems(raw: Any, step: int) -> list[str]:
    """What makes `raw` (a decoded manifest.json) not a manifest of the save at `step`; [] when it is one. `files`
    is required; the fields the trainer writes besides are checked where present."""
    if not isinstance(raw, dict):
        return [f"expected an object, got {type(raw).__name__}"]
    problems = []
    if raw.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        problems.append(f"format: expected {FORMAT_VERSION}, got {str(raw.get('format'))[:40]}")
    if "step" in raw and (raw["step"] != step or isinstance(raw["step"], bool)):
        problems.append(f"step: expected {step} (the directory's), got {str(raw['step'])[:40]}")
    if not isinstance(raw.get("model_hash", ""), str):
        problems.append("model_hash: expected a string")
    layout = raw.get("layout", {"world_size": 1})
    if not isinstance(layout, dict) or not _count(layout.get("world_size"), minimum=1):
        problems.append("layout: expected an object with world_size, an integer >= 1")
    files = raw.get("files")
    if not isinstance(files, list):
        return [*problems, "files: expected a list of {name, size, blake2b}"]
    for i, entry in enumerate(files):
        problems += [f"files[{i}]: {p}" for p in _file_entry_problems(entry)]
    return problems


def _file_entry_problems(entry: Any) -> list[str]:
    if not isinstance(entry, dict):
        return ["expected an object {name, size, blake2b}"]
    problems = []
    name = entry.get("name")
    # NOTE: a name is looked up inside the checkpoint: "../" or "/" would read (and hash) files elsewhere.
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\0" in name or name in _OWN_FILES:
        problems.append(f"name: expected a file name inside the checkpoint, got {str(name)[:80]!r}")
    if not _count(entry.get("size")):
        problems.append(f"size: expected an integer >= 0, got {str(entry.get('size'))[:40]}")
    if not isinstance(entry.get("blake2b", ""), str):
        problems.append("blake2b: expected a hex string")
    return problems


def _count(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _read_abandoned(ckpt: Path) -> str | None:
    """Why a rollback abandoned `ckpt` (its marker's words), or None when it has no marker."""
    try:
        marker = json.loads((ckpt / ABANDONED).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        marker = None  # NOTE: fail closed: a marker that exists condemns the checkpoint, readable or not
    if isinstance(marker, dict) and isinstance(marker.get("resumed_from"), str):
        return f"abandoned: training went back to {marker['resumed_from'][:200]}, so this belongs to a history " \
               "thrown away (a rollback)"
    return f"abandoned: {ABANDONED} says a rollback went back past this checkpoint"


def verify(info: CheckpointInfo, checksums: bool = False) -> list[str]:
    """Problems that make `info` unusable (empty list: good). Sizes always, checksums when asked. Problems found
    once (an invalid manifest, a bad file) stay in info.problems; a checkpoint without any is checked again."""
    if info.manifest is None:
        return ["no manifest: the save did not complete"]
    if not info.problems:
        files = info.manifest.get("files", [])
        info.problems = [p for entry in files for p in _file_problems(info.path / entry["name"], entry, checksums)]
        if not files:
            info.problems = ["manifest lists no files"]
    return ([info.abandoned] if info.abandoned is not None else []) + info.problems


def _file_problems(path: Path, entry: dict[str, Any], checksums: bool) -> list[str]:
    name = entry["name"]
    try:
        st = path.lstat()
    except FileNotFoundError:
        return [f"{name}: missing"]
    if not stat.S_ISREG(st.st_mode):
        return [f"{name}: not a regular file"]  # NOTE: a symlink or a device would be read (hashed) elsewhere
    if st.st_size != entry["size"]:
        return [f"{name}: size {st.st_size} bytes, manifest says {entry['size']}"]
    if checksums and file_checksum(path) != entry.get("blake2b"):
        return [f"{name}: checksum mismatch"]
    return []


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
        saved_for = (info.manifest or {}).get("model_hash")
        if not problems and model_hash is not None and saved_for != model_hash:
            problems = [f"saved for another model (hash {saved_for}, this run {model_hash})"]
        if problems:
            skipped.append((info.path.name, "; ".join(problems)))
            continue
        return ResumeChoice(checkpoint=info, skipped=skipped)
    return ResumeChoice(checkpoint=None, skipped=skipped)


def retention_victims(infos: list[CheckpointInfo], keep_last: int, keep_every: int, latest: str | None) -> list[Path]:
    """Directories to delete: complete saves beyond the newest `keep_last` that are not a multiple of
    `keep_every`, abandoned ones, and incomplete ones older than the newest complete save (never `latest`).

    NOTE: an incomplete save newer than the newest complete one is left alone here: by the time retention runs
    the other ranks may have started the next save's directory. Failed saves are removed by the saver, and saves
    cut short by a kill when the job starts again (manager.py)."""
    complete = [c for c in infos if c.complete and c.abandoned is None]
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
        if c.complete or c.abandoned is not None or c.step < newest_complete:
            victims.append(c.path)
    return victims

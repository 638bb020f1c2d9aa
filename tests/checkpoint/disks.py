"""A real full disk for checkpoint tests: a small tmpfs mounted for the test (root only; skipped, saying why,
where it cannot be mounted)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(where: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of `size_bytes` at `where` (created) for the duration: a write past it fails with ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("a small real filesystem needs root to mount")
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755", "tmpfs", str(where)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs at {where}: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], capture_output=True, timeout=30)


def fill(disk: Path, leave_bytes: int = 0) -> Path:
    """Fill `disk` until at most `leave_bytes` are free; returns the filler file."""
    filler = disk / "filler"
    with filler.open("wb") as f:
        try:
            while os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize > leave_bytes:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return filler

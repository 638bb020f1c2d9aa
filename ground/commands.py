"""Running an external tool safely: an argument list, no shell, a timeout, and (rc, out, err) back.

Checks build argv lists only from validated config values (device names matched against what the
system lists, numbers, paths the check chose itself); nothing from an alert, label or heartbeat
reaches them, and there is no shell to interpret anything.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from datetime import timedelta


@dataclass(frozen=True, slots=True)
class CommandResult:
    """What a command did: its exit status (None when it timed out) and its output."""

    rc: int | None
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


def run_command(argv: list[str], timeout: timedelta) -> CommandResult:
    """Run `argv` (no shell) with a timeout; a missing program or a timeout is a result, not an exception."""
    if not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    if shutil.which(argv[0]) is None:
        return CommandResult(rc=None, out="", err=f"{argv[0]}: not found on PATH")
    try:
        proc = subprocess.run(
            argv, shell=False, capture_output=True, text=True, timeout=timeout.total_seconds(), check=False
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return CommandResult(rc=None, out=out, err=f"{argv[0]}: timed out after {timeout.total_seconds():g}s")
    return CommandResult(rc=proc.returncode, out=proc.stdout, err=proc.stderr)

"""Running the bed's tools: argument lists, never a shell, always a timeout, and errors that say what failed.

Every name that reaches a command (a host, a link, a prefix) comes from a validated `Bed.Config` or from
the bed's own layout; nothing is interpolated into a shell string.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

DEFAULT_TIMEOUT = timedelta(seconds=20)


class BedError(RuntimeError):
    """The bed could not do what it was asked; the message names the step, the command and why.

    `permanent` is True when trying again cannot help (not root, a tool missing, a bad configuration).
    """

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


@dataclass(frozen=True, slots=True)
class Result:
    """What a command did."""

    argv: tuple[str, ...]
    rc: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.rc == 0


def run(
    argv: Sequence[str],
    *,
    timeout: timedelta = DEFAULT_TIMEOUT,
    check: bool = True,
    env: Mapping[str, str] | None = None,
    what: str = "",
) -> Result:
    """Run `argv` without a shell; raise BedError naming `what` on a non-zero exit (when `check`) or a timeout."""
    if not argv or not all(isinstance(a, str) and a for a in argv):
        raise ValueError(f"argv must be a non-empty list of non-empty strings, got {argv!r}")
    try:
        proc = subprocess.run(
            list(argv),
            shell=False,
            capture_output=True,
            text=True,
            timeout=timeout.total_seconds(),
            check=False,
            env=None if env is None else dict(env),
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError as exc:
        raise BedError(f"{what or argv[0]}: {argv[0]} not found: {exc}", permanent=True) from exc
    except subprocess.TimeoutExpired as exc:
        raise BedError(f"{what or argv[0]}: `{' '.join(argv)}` timed out after {timeout.total_seconds():g}s") from exc
    result = Result(tuple(argv), proc.returncode, proc.stdout, proc.stderr)
    if check and not result.ok:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise BedError(f"{what or argv[0]}: `{' '.join(argv)}` exited {proc.returncode}: {' | '.join(detail[-3:])}")
    return result


def require_root() -> None:
    """The bed creates namespaces, links and daemons: only root may. Say so plainly otherwise."""
    if os.geteuid() != 0:
        raise BedError(
            "the test bed needs root (it creates network namespaces, a bridge and Slurm daemons); "
            f"you are uid {os.geteuid()}: run it as root, e.g. `sudo .venv/bin/megaheal testbed up`",
            permanent=True,
        )


# The programs the bed runs, and the Debian package each comes from.
TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
    "mount": "mount",
    "umount": "mount",
    "munged": "munge",
    "slurmctld": "slurmctld",
    "slurmd": "slurmd",
    "srun": "slurm-client",
    "sinfo": "slurm-client",
    "scontrol": "slurm-client",
    "scancel": "slurm-client",
}


def require_tools(names: Sequence[str] = tuple(TOOLS)) -> None:
    """Every program the bed runs is on PATH, or one error listing the missing ones and their packages."""
    missing = [n for n in names if shutil.which(n) is None]
    if missing:
        packages = sorted({TOOLS.get(n, n) for n in missing})
        raise BedError(
            f"missing programs: {', '.join(missing)}; install them with scripts/install-system-deps.sh "
            f"(apt-get install {' '.join(packages)})",
            permanent=True,
        )

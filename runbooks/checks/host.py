"""`host`: can this node take the job back? Checkpoint directory (free space, writable, write
speed), the node's local scratch directory (TMPDIR: temp files, caches), /dev/shm (NCCL and data loaders
need it; containers default to 64 MiB), clock offset, and processes still holding GPUs.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from runbooks.baselines import BaselineStore, below_baseline
from runbooks.checks.clock import ClockReading, kernel_clock, parse_server, sntp_offset
from runbooks.checks.procscan import GPU_DEVICE, gpu_holders, stuck_ranks
from runbooks.registry import Check, CheckContext
from wire.verdict import CheckResult, Measurement, Status, Suspect, worst

GiB = 1 << 30
MiB = 1 << 20


class HostCheck(Check):
    name = "host"

    @dataclass(kw_only=True, slots=True)
    class Config:
        checkpoint_dir: str = "runs"
        """Where checkpoints are written; if it does not exist yet, its nearest existing parent is tested."""
        min_free_gib: float = 5.0
        """Fail when the checkpoint file system has less free space than this."""
        write_test_mib: int = 32
        """Bytes written (and fsynced, then deleted) to measure write speed; 0 skips the speed test."""
        min_write_mib_s: float | None = None
        """Fail below this write speed; None: compare only with a stored baseline (degraded below it)."""
        scratch_dir: str | None = None
        """The node's local scratch directory; None: $TMPDIR, else /tmp. It must be a writable directory."""
        min_scratch_free_gib: float = 1.0
        """Fail when the scratch file system has less free space than this."""
        shm_path: str = "/dev/shm"
        """Shared memory mount used by NCCL and data-loader workers."""
        min_shm_free_gib: float = 1.0
        """Fail when the shared memory mount has less free space than this."""
        ntp_server: str | None = None
        """HOST or HOST:PORT to measure the clock offset against (SNTP); None: the kernel's NTP state only."""
        ntp_timeout: timedelta = timedelta(seconds=2)
        """How long to wait for the NTP server."""
        max_clock_offset: timedelta = timedelta(milliseconds=250)
        """Degraded beyond this offset (cross-node timelines stop being comparable)."""
        require_clock_sync: bool = False
        """Degraded when the kernel says the clock is not NTP-synchronised and no server was asked."""
        fail_on_gpu_holders: bool = False
        """Fail when any process holds a GPU (use before a restart, when the job's processes are gone)."""
        fail_on_stuck_ranks: bool = False
        """Fail when a training rank of this node is stuck in the kernel (state D) and SIGKILL cannot end it (use
        after the job was stopped: such a host cannot be trusted with the next attempt)."""
        baseline_fraction: float = 0.9
        """Degraded below this fraction of the stored write-speed baseline."""

        def __post_init__(self) -> None:
            for name in ("checkpoint_dir", "shm_path", "scratch_dir"):
                value = getattr(self, name)
                if (value is not None or name != "scratch_dir") and (not value or "\x00" in value):
                    raise ValueError(f"{name} must be a non-empty path, got {value!r}")
            for name in ("min_free_gib", "min_shm_free_gib", "min_scratch_free_gib"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
            if not 0 <= self.write_test_mib <= 4096:
                raise ValueError(f"write_test_mib must be in [0, 4096], got {self.write_test_mib}")
            if self.min_write_mib_s is not None and self.min_write_mib_s <= 0:
                raise ValueError(f"min_write_mib_s must be > 0 or unset, got {self.min_write_mib_s}")
            if self.ntp_server is not None:
                parse_server(self.ntp_server)
            if not timedelta(0) < self.ntp_timeout <= timedelta(seconds=30):
                raise ValueError(f"ntp_timeout must be in (0, 30s], got {self.ntp_timeout}")
            if self.max_clock_offset <= timedelta(0):
                raise ValueError(f"max_clock_offset must be > 0, got {self.max_clock_offset}")
            if not 0 < self.baseline_fraction <= 1:
                raise ValueError(f"baseline_fraction must be in (0, 1], got {self.baseline_fraction}")

    def __init__(self, proc: Path = Path("/proc"), gpu_device: re.Pattern[str] = GPU_DEVICE) -> None:
        self._proc = proc
        self._gpu_device = gpu_device

    def run(self, config: Config, ctx: CheckContext) -> CheckResult:
        store = BaselineStore(None if ctx.calibrate else ctx.baselines_path)
        parts = [
            self._checkpoint_dir(config, ctx, store),
            _scratch(config, ctx),
            _shm(config, ctx),
            _clock(config, ctx),
            self._holders(config, ctx),
            _stuck(config, ctx),
        ]
        status = worst([p.status for p in parts])
        bad = [p.summary for p in parts if p.status not in (Status.PASS, Status.SKIPPED)]
        summary = "; ".join(bad) if bad else "; ".join(p.summary for p in parts)
        return CheckResult(
            status=status,
            summary=summary,
            suspects=tuple(s for p in parts for s in p.suspects),
            measurements=tuple(m for p in parts for m in p.measurements),
            details={k: v for p in parts for k, v in p.details.items()},
        )

    def _checkpoint_dir(self, config: Config, ctx: CheckContext, store: BaselineStore) -> CheckResult:
        wanted = Path(config.checkpoint_dir).absolute()
        target = wanted
        while not target.exists() and target != target.parent:
            target = target.parent
        note = "" if target == wanted else f" (does not exist yet; tested {target})"
        labels = {"path": str(wanted), "node": ctx.hostname}
        if not target.is_dir():
            return _bad(Status.FAIL, f"checkpoint directory {wanted} is not a directory{note}", "path", str(wanted))
        st = os.statvfs(target)
        free = st.f_bavail * st.f_frsize
        measurements = [Measurement(name="checkpoint_free_bytes", value=float(free), unit="bytes", labels=labels)]
        if free < config.min_free_gib * GiB:
            return _bad(
                Status.FAIL,
                f"checkpoint directory {wanted}: {free / GiB:.2f} GiB free < " f"{config.min_free_gib:g} GiB{note}",
                "path",
                str(wanted),
                measurements,
            )
        try:
            speed = _write_speed(target, config.write_test_mib * MiB)
        except OSError as exc:
            return _bad(
                Status.FAIL,
                f"checkpoint directory {wanted} is not writable: {exc.strerror or exc}{note}",
                "path",
                str(wanted),
                measurements,
            )
        text = f"checkpoint dir {wanted}: {free / GiB:.1f} GiB free, writable{note}"
        if speed is None:
            return CheckResult(status=Status.PASS, summary=text, measurements=tuple(measurements))
        key = f"host/checkpoint_write/{wanted}"
        write = Measurement(
            name="checkpoint_write_speed",
            value=speed / MiB,
            unit="MiB/s",
            labels=labels,
            baseline=store.get(key),
            key=key,
        )
        measurements.append(write)
        if config.min_write_mib_s is not None and write.value < config.min_write_mib_s:
            return _bad(
                Status.FAIL,
                f"checkpoint directory {wanted} writes at {write.value:.0f} MiB/s < "
                f"{config.min_write_mib_s:g} MiB/s",
                "path",
                str(wanted),
                measurements,
            )
        if below_baseline(write.value, write.baseline, config.baseline_fraction):
            return _bad(
                Status.DEGRADED,
                f"checkpoint directory {wanted} writes at {write.value:.0f} MiB/s < "
                f"{config.baseline_fraction:g} x baseline {write.baseline:.0f}",
                "path",
                str(wanted),
                measurements,
            )
        return CheckResult(
            status=Status.PASS, summary=f"{text}, {write.value:.0f} MiB/s", measurements=tuple(measurements)
        )

    def _holders(self, config: Config, ctx: CheckContext) -> CheckResult:
        holders, unreadable = gpu_holders(self._proc, self._gpu_device, exclude=frozenset({os.getpid()}))
        details = {"gpu_holders": [h.to_payload() for h in holders], "unreadable_processes": unreadable}
        measurements = (
            Measurement(
                name="gpu_holder_processes", value=float(len(holders)), unit="processes", labels={"node": ctx.hostname}
            ),
        )
        stuck = [h for h in holders if h.state in ("D", "Z")]
        flagged = holders if config.fail_on_gpu_holders else stuck
        if not flagged:
            text = f"{len(holders)} process(es) hold GPUs" if holders else "no process holds a GPU"
            return CheckResult(status=Status.PASS, summary=text, measurements=measurements, details=details)
        status = Status.FAIL if config.fail_on_gpu_holders else Status.DEGRADED
        suspects = tuple(
            Suspect(kind="process", name=str(h.pid), reason=f"{h.comm} in state {h.state} holds {', '.join(h.devices)}")
            for h in flagged
        )
        text = "GPU held by " + ", ".join(f"pid {h.pid} ({h.comm}, state {h.state})" for h in flagged)
        return CheckResult(status=status, summary=text, suspects=suspects, measurements=measurements, details=details)


def _stuck(config: Config, ctx: CheckContext) -> CheckResult:
    if not config.fail_on_stuck_ranks:
        return CheckResult(status=Status.SKIPPED, summary="stuck ranks not looked for")
    # NOTE: the node agent names its host in MEGAHEAL_NODE (several "hosts" may share one machine in tests).
    node = os.environ.get("MEGAHEAL_NODE") or ctx.hostname
    stuck = stuck_ranks(node)
    if not stuck:
        return CheckResult(status=Status.PASS, summary="no rank stuck in the kernel")
    text = "rank process(es) stuck in the kernel (state D; SIGKILL cannot end them): " + ", ".join(
        f"pid {h.pid} ({h.comm})" for h in stuck)
    return CheckResult(status=Status.FAIL, summary=text,
                       suspects=tuple(Suspect(kind="process", name=str(h.pid), reason=f"{h.comm} in state D")
                                      for h in stuck),
                       details={"stuck_ranks": [h.to_payload() for h in stuck]})


def _bad(
    status: Status, summary: str, kind: str, name: str, measurements: list[Measurement] | None = None
) -> CheckResult:
    return CheckResult(
        status=status,
        summary=summary,
        suspects=(Suspect(kind=kind, name=name, reason=summary),),
        measurements=tuple(measurements or ()),
    )


def _write_speed(directory: Path, size: int) -> float | None:
    """Bytes/s of writing `size` bytes and fsyncing them; the probe file is always removed."""
    fd, path = tempfile.mkstemp(dir=directory, prefix=".megaheal-write-probe-")
    try:
        if size == 0:
            return None
        block = os.urandom(4 * MiB)  # random: compressing file systems must not flatter the number
        start = time.perf_counter()
        written = 0
        while written < size:
            written += os.write(fd, block[: min(len(block), size - written)])
        os.fsync(fd)
        return size / max(time.perf_counter() - start, 1e-9)
    finally:
        os.close(fd)
        os.unlink(path)


def _scratch(config: HostCheck.Config, ctx: CheckContext) -> CheckResult:
    # NOTE: tempfile.gettempdir() would silently fall back to /tmp when TMPDIR is broken, which is exactly
    # the fault to find: read the variable itself.
    path = Path(config.scratch_dir or os.environ.get("TMPDIR") or "/tmp")
    if not path.is_dir():
        what = "missing" if not path.exists() and not path.is_symlink() else "not a directory"
        return _bad(Status.FAIL, f"scratch directory {path} is {what}", "path", str(path))
    st = os.statvfs(path)
    free = st.f_bavail * st.f_frsize
    m = Measurement(name="scratch_free_bytes", value=float(free), unit="bytes",
                    labels={"path": str(path), "node": ctx.hostname})
    if free < config.min_scratch_free_gib * GiB:
        return _bad(Status.FAIL, f"scratch directory {path}: {free / GiB:.2f} GiB free < "
                    f"{config.min_scratch_free_gib:g} GiB", "path", str(path), [m])
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".megaheal-scratch-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return _bad(Status.FAIL, f"scratch directory {path} is not writable: {exc.strerror or exc}", "path",
                    str(path), [m])
    return CheckResult(status=Status.PASS, summary=f"scratch {path}: {free / GiB:.1f} GiB free, writable",
                       measurements=(m,))


def _shm(config: HostCheck.Config, ctx: CheckContext) -> CheckResult:
    path = Path(config.shm_path)
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return _bad(Status.FAIL, f"{path} unusable: {exc.strerror}", "path", str(path))
    free = st.f_bavail * st.f_frsize
    m = Measurement(
        name="shm_free_bytes", value=float(free), unit="bytes", labels={"path": str(path), "node": ctx.hostname}
    )
    if free < config.min_shm_free_gib * GiB:
        return _bad(
            Status.FAIL,
            f"{path}: {free / GiB:.2f} GiB free < {config.min_shm_free_gib:g} GiB "
            "(NCCL and data loaders need shared memory)",
            "path",
            str(path),
            [m],
        )
    if not os.access(path, os.W_OK):
        return _bad(Status.FAIL, f"{path} is not writable", "path", str(path), [m])
    return CheckResult(status=Status.PASS, summary=f"{path}: {free / GiB:.1f} GiB free", measurements=(m,))


def _clock(config: HostCheck.Config, ctx: CheckContext) -> CheckResult:
    try:
        reading: ClockReading = (
            sntp_offset(config.ntp_server, config.ntp_timeout) if config.ntp_server else kernel_clock()
        )
    except OSError as exc:
        return CheckResult(
            status=Status.DEGRADED, summary=f"clock offset unknown: {config.ntp_server or 'adjtimex'}: {exc}"
        )
    details = {
        "clock": {
            "source": reading.source,
            "synchronized": reading.synchronized,
            "offset_s": reading.offset_s,
            "error_bound_s": reading.error_bound_s,
        }
    }
    if reading.offset_s is None:
        if reading.synchronized:
            return CheckResult(status=Status.PASS, summary="clock NTP-synchronised (kernel)", details=details)
        status = Status.DEGRADED if config.require_clock_sync else Status.PASS
        return CheckResult(
            status=status,
            details=details,
            summary="clock not NTP-synchronised (kernel says so); offset unknown without ntp_server",
        )
    m = Measurement(
        name="clock_offset", value=reading.offset_s, unit="s", labels={"node": ctx.hostname, "source": reading.source}
    )
    limit = config.max_clock_offset.total_seconds()
    if abs(reading.offset_s) > limit:
        return CheckResult(
            status=Status.DEGRADED,
            measurements=(m,),
            details=details,
            summary=f"clock offset {reading.offset_s:+.3f}s vs {reading.source} exceeds {limit:g}s",
            suspects=(Suspect(kind="host", name=ctx.hostname, reason=f"clock off by {reading.offset_s:+.3f}s"),),
        )
    return CheckResult(
        status=Status.PASS,
        summary=f"clock offset {reading.offset_s * 1e3:+.1f} ms vs {reading.source}",
        measurements=(m,),
        details=details,
    )

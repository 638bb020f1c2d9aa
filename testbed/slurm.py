"""Slurm on the bed: munged, slurmctld on the machine, one slurmd inside each host.

Everything runs from the bed's state directory with its own slurm.conf and its own munge socket and
key, so the machine's /etc/slurm and /etc/munge are neither read nor changed: a client reaches the
bed with `SLURM_CONF=/run/<prefix>-testbed/etc/slurm.conf` (what `up` prints).
The keys are those measured to work with Debian's Slurm 22.05 (../shared/notes/multihost-testbed.md).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from testbed import procs
from testbed.cmd import BedError, run
from testbed.hostns import controller_name, enter
from testbed.layout import Host, Layout

SLURMD_PORT = 6818  # inside each host's own network namespace, so every slurmd may use the same one


def conf_text(layout: Layout, cpus_per_host: int, slurmctld_port: int, slurmd_timeout: timedelta) -> str:
    s = layout.state_dir
    nodes = "\n".join(
        f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus_per_host} State=UNKNOWN" for h in layout.hosts
    )
    return f"""\
# written by megaheal testbed ({layout.prefix}); removed by `megaheal testbed down`
ClusterName={layout.prefix}
SlurmctldHost={controller_name()}({layout.bridge_address})
SlurmctldPort={slurmctld_port}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={layout.munge_socket}
CredType=cred/munge
# No cgroups: processes are tracked by their parents, tasks are not bound to CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
# The configured CPUs count, not the machine's: every host is the same machine.
SlurmdParameters=config_overrides
# A host whose slurmd comes back registers as idle again (a revived host, a restarted slurmd).
ReturnToService=2
# How soon a dead host is marked DOWN (not responding).
SlurmdTimeout={max(1, int(slurmd_timeout.total_seconds()))}
InactiveLimit=0
KillWait=5
MinJobAge=60
StateSaveLocation={s}/slurmctld
SlurmdSpoolDir={s}/spool/%n
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/spool/slurmd-%n.pid
SlurmctldLogFile={layout.log_dir}/slurmctld.log
SlurmdLogFile={layout.log_dir}/slurmd-%n.log
{nodes}
PartitionName={layout.prefix} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


def slurmd_pid(layout: Layout, host: Host) -> int | None:
    return procs.read_pid(layout.state_dir / "spool" / f"slurmd-{host.name}.pid")


def slurmctld_pid(layout: Layout) -> int | None:
    return procs.read_pid(layout.state_dir / "slurmctld.pid")


def munged_pid(layout: Layout) -> int | None:
    return procs.read_pid(layout.state_dir / "munge" / "munged.pid")


def ensure_munge(layout: Layout) -> bool:
    """A munged of the bed's own (its key, its socket); True when started now."""
    if munged_pid(layout):
        return False
    key_dir, sock_dir = layout.munge_key.parent, layout.munge_socket.parent
    key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock_dir.mkdir(parents=True, exist_ok=True)
    sock_dir.chmod(0o755)  # munged wants its socket directory searchable by every client
    if not layout.munge_key.exists():
        fd = os.open(layout.munge_key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(1024))
    # --force: munged refuses root without it; it forks into the background and writes its pid file.
    run(
        ["munged", "--force", f"--socket={layout.munge_socket}", f"--key-file={layout.munge_key}",
         f"--pid-file={sock_dir / 'munged.pid'}", f"--log-file={layout.log_dir / 'munged.log'}",
         f"--seed-file={key_dir / 'munged.seed'}"],
        what="munged",
    )
    return True


def check_port_free(port: int) -> None:
    """slurmctld binds every address of the machine on its port; say which port is taken, and by what."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError as exc:
            raise BedError(
                f"slurmctld port {port} is in use ({exc.strerror}); another bed or Slurm runs here: "
                "pass --slurmctld-port", permanent=True,
            ) from exc


def ensure_slurmctld(layout: Layout, port: int) -> bool:
    if slurmctld_pid(layout):
        return False
    check_port_free(port)
    for d in (layout.state_dir / "slurmctld", layout.log_dir):
        d.mkdir(parents=True, exist_ok=True)
    # -i: ignore saved state (a fresh cluster every time); it daemonizes and writes its pid file.
    run(["slurmctld", "-i", "-f", str(layout.slurm_conf)], what="slurmctld")
    _wait_pid("slurmctld", lambda: slurmctld_pid(layout), layout.log_dir / "slurmctld.log")
    return True


def ensure_slurmd(layout: Layout, host: Host) -> bool:
    if slurmd_pid(layout, host):
        return False
    (layout.state_dir / "spool" / host.name).mkdir(parents=True, exist_ok=True)
    # Its node name comes from the host's hostname; it daemonizes inside the host's namespaces.
    run([*enter(layout, host, "/"), "slurmd", "-f", str(layout.slurm_conf)], what=f"slurmd on {host.name}")
    _wait_pid(f"slurmd on {host.name}", lambda: slurmd_pid(layout, host), layout.log_dir / f"slurmd-{host.name}.log")
    return True


def _wait_pid(what: str, probe: Callable[[], int | None], log: Path, timeout_s: float = 15.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = probe()
        if pid:
            return pid
        time.sleep(0.05)
    raise BedError(f"{what} did not start within {timeout_s:g}s; its log: {log}: {_tail(log)}")


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


# ---------------------------------------------------------------- asking slurmctld


def node_states(layout: Layout, timeout: timedelta = timedelta(seconds=10)) -> dict[str, str]:
    """Each node's state as sinfo prints it (idle, alloc, drain, down*, ...); {} when slurmctld does not answer."""
    res = run(["sinfo", "-h", "-N", "-o", "%N %T"], env=layout.slurm_env(dict(os.environ)), timeout=timeout,
              check=False)
    if not res.ok:
        return {}
    return dict(line.split(None, 1) for line in res.out.strip().splitlines() if " " in line)


def wait_idle(layout: Layout, hosts: list[Host], timeout: timedelta = timedelta(seconds=30)) -> None:
    """Until every host in `hosts` is idle in Slurm (registered and schedulable)."""
    deadline = time.monotonic() + timeout.total_seconds()
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = node_states(layout)
        if all(states.get(h.name) == "idle" for h in hosts):
            return
        time.sleep(0.2)
    raise BedError(
        f"hosts not idle in Slurm after {timeout.total_seconds():g}s: "
        + ", ".join(f"{h.name}={states.get(h.name, '?')}" for h in hosts)
        + f"; logs in {layout.log_dir}"
    )


def scontrol(layout: Layout, *args: str) -> None:
    run(["scontrol", *args], env=layout.slurm_env(dict(os.environ)), what="scontrol")


def drain(layout: Layout, host: Host, reason: str) -> None:
    """Keep the scheduler off `host` (running jobs finish); `sinfo -R` shows the reason."""
    scontrol(layout, "update", f"NodeName={host.name}", "State=DRAIN", f"Reason={reason}")


def resume(layout: Layout, host: Host) -> None:
    """Return a drained or down host to service. A down host whose slurmd registered meanwhile is back
    already (ReturnToService=2), and scontrol refuses to resume it: that is success too."""
    res = run(["scontrol", "update", f"NodeName={host.name}", "State=RESUME"],
              env=layout.slurm_env(dict(os.environ)), check=False, what="scontrol")
    state = node_states(layout).get(host.name, "")
    if not res.ok and any(s in state for s in ("drain", "down", "fail")):
        raise BedError(f"cannot resume {host.name} (state {state}): {(res.err or res.out).strip()}")


def cancel_all(layout: Layout) -> None:
    """Cancel every job on this bed (its own slurmctld: nobody else's jobs)."""
    run(["scancel", "--full", f"--partition={layout.prefix}"], env=layout.slurm_env(dict(os.environ)),
        check=False, what="scancel")

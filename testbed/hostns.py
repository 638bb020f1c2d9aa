"""Each host's own hostname (UTS namespace) and its own view of two files (mount namespace).

Decision (see README, "A cluster on one machine"): every host gets its own mount namespace in which
/etc/hosts is the bed's hosts file and /tmp is a directory of its own; everything else is the
machine's filesystem, shared like a cluster's shared filesystem (code, venv, run directories,
checkpoints). So code written for a real cluster runs unchanged: a default socket under /tmp, a
node-local scratch directory, `hostname` and name resolution all behave per host, and the machine's
own /etc/hosts is never edited.

The namespaces are kept by bind mounts (like `ip netns` keeps network namespaces), so they outlive
the process that made them and any process can enter them with `nsenter`.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from testbed.cmd import run
from testbed.layout import Host, Layout


def controller_name() -> str:
    """The machine's short hostname: slurmctld's name in slurm.conf and in every host's /etc/hosts."""
    return socket.gethostname().split(".")[0]


def hosts_file_text(layout: Layout) -> str:
    lines = [
        f"# written by megaheal testbed ({layout.prefix}): the hosts' /etc/hosts",
        "127.0.0.1\tlocalhost",
        f"{layout.bridge_address}\t{controller_name()}",
    ]
    lines += [f"{h.address}\t{h.name}" for h in layout.hosts]
    return "\n".join(lines) + "\n"


def enter(layout: Layout, host: Host, workdir: str | None = None) -> list[str]:
    """The argv prefix that runs a program inside `host` (its network, hostname and mount namespaces).

    NOTE: nsenter, not `ip netns exec`: the latter remounts /sys, the cgroup mounts vanish and slurmd
    stops with "No filesystem mounted on /sys/fs/cgroup" (../shared/notes/multihost-testbed.md).
    """
    argv = ["nsenter", f"--net={host.net_ns}", f"--uts={host.uts_ns}", f"--mount={host.mnt_ns}"]
    # Entering a mount namespace moves the working directory to its root; keep the caller's.
    argv.append(f"--wd={workdir or os.getcwd()}")
    return [*argv, "--"]


def mount_points() -> list[str]:
    """Mount points of the machine's mount namespace, in mount order."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")
        points.append(point)
    return points


def ensure_ns_dir(layout: Layout) -> None:
    """A private mount for the namespace files (a namespace can only be bound onto a private mount)."""
    layout.ns_dir.mkdir(parents=True, exist_ok=True)
    if str(layout.ns_dir) not in mount_points():
        run(["mount", "--bind", str(layout.ns_dir), str(layout.ns_dir)], what="namespace directory")
    run(["mount", "--make-private", str(layout.ns_dir)], what="namespace directory")


def under_tmp(path: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), "/tmp"]) == "/tmp" and os.path.abspath(path) != "/tmp"


def ensure_host(layout: Layout, host: Host, shared_tmp: tuple[str, ...] = ()) -> bool:
    """The host's UTS and mount namespaces with its hostname, /etc/hosts and /tmp; True when made now.
    `shared_tmp`: directories under the machine's /tmp that stay visible in the host's own /tmp."""
    points = mount_points()
    if str(host.uts_ns) in points and str(host.mnt_ns) in points:
        return False
    for f in (host.uts_ns, host.mnt_ns):
        if str(f) in points:
            run(["umount", str(f)], what=f"namespaces of {host.name}")
        f.touch()
    host.tmp.mkdir(parents=True, exist_ok=True)
    host.tmp.chmod(0o1777)
    # slave: mounts the machine makes later still show inside the host; the host's own never leak out.
    run(
        ["nsenter", f"--net={host.net_ns}", "unshare", f"--uts={host.uts_ns}", f"--mount={host.mnt_ns}",
         "--propagation", "slave", "hostname", host.name],
        what=f"namespaces of {host.name}",
    )
    inside = ["nsenter", f"--mount={host.mnt_ns}", "--"]
    run([*inside, "mount", "--bind", str(layout.hosts_file), "/etc/hosts"], what=f"/etc/hosts of {host.name}")
    # NOTE: a directory the machine keeps under /tmp (a checkout cloned there, a test session's tmp) is mounted
    # into the host's /tmp at the same path first, while the machine's /tmp is still visible in the namespace;
    # --rbind then carries it along. The mount lives in the host's namespace only: the machine's copy of
    # host.tmp keeps an empty directory there, so `down` removing the state directory never reaches into it.
    for path in shared_tmp:
        if not os.path.isdir(path):
            continue
        target = host.tmp / os.path.relpath(path, "/tmp")
        target.mkdir(parents=True, exist_ok=True)
        run([*inside, "mount", "--bind", path, str(target)], what=f"{path} in {host.name}'s /tmp")
    run([*inside, "mount", "--rbind", str(host.tmp), "/tmp"], what=f"/tmp of {host.name}")
    # NOTE: the new namespace holds copies of the other hosts' namespace mounts; detach them, or each
    # host's namespaces would be kept alive by the next host's and outlive `down`.
    for point in (str(layout.ns_dir), "/run/netns"):
        run([*inside, "umount", "--lazy", point], check=False)
    return True


def remove(layout: Layout) -> list[str]:
    """Unmount every mount under the bed's state directory (namespace files, then the directory)."""
    state = str(layout.state_dir)
    ours = [p for p in mount_points() if p == state or p.startswith(state + "/")]
    for point in reversed(ours):  # innermost first
        run(["umount", "--lazy", point], check=False)
    return ours

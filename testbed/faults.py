"""Real faults on the bed's hosts, as library functions for tests, benches and chaos schedules.

    kill_host / revive_host   a host dies: its link goes dark, every process in it is SIGKILLed
                              (its slurmd too, so Slurm marks it DOWN after SlurmdTimeout)
    cut_link / restore_link   `ip link set down|up` on its link: a partition; peers block, nothing crashes
    slow_link / restore_speed `tc tbf` at a given rate on both ends of its link
    freeze / thaw             processes stopped in the kernel (cgroup freezer): state D, SIGKILL waits
    drain / resume            Slurm's own health state: the scheduler keeps new work off a drained host
    clear                     undo all of the above (tests call it between cases; `down` undoes them too)

Every fault acts on real kernel objects; none is simulated.
"""

from __future__ import annotations

from pathlib import Path

from testbed import freezer, network, procs, slurm
from testbed.bed import Bed
from testbed.cmd import BedError
from testbed.layout import Host


def _host(bed: Bed, host: str | Host) -> Host:
    return host if isinstance(host, Host) else bed.host(host)


def kill_host(bed: Bed, host: str | Host) -> list[int]:
    """The host dies: its link goes down first (a dead machine sends no FIN or RST), then every process
    in it is SIGKILLed, frozen ones included. Returns the pids that were killed."""
    h = _host(bed, host)
    network.set_link(h, up=False)
    victims = bed.pids(h)
    procs.kill(victims)
    for group, pids in freezer.frozen_pids(bed.layout.freezer).items():
        if set(pids) & set(victims):
            freezer.thaw(bed.layout.freezer / group)  # a frozen task takes its SIGKILL only when thawed
    left = procs.wait_gone(victims, 10.0)
    if left:
        raise BedError(f"processes of {h.name} survived SIGKILL: {left}")
    return victims


def revive_host(bed: Bed, host: str | Host) -> None:
    """Power the host back on: link up, slurmd started, and back to idle in Slurm (ReturnToService=2)."""
    h = _host(bed, host)
    network.set_link(h, up=True)
    slurm.ensure_slurmd(bed.layout, h)
    if "drain" in slurm.node_states(bed.layout).get(h.name, ""):
        slurm.resume(bed.layout, h)  # a drain outlives the host's death; DOWN ends at registration
    slurm.wait_idle(bed.layout, [h])


def cut_link(bed: Bed, host: str | Host) -> None:
    network.set_link(_host(bed, host), up=False)


def restore_link(bed: Bed, host: str | Host) -> None:
    network.set_link(_host(bed, host), up=True)


def slow_link(bed: Bed, host: str | Host, rate_bit_s: int) -> None:
    """Limit the host's link to `rate_bit_s` each way (tbf; the kernel has no netem here)."""
    network.shape(_host(bed, host), rate_bit_s)


def restore_speed(bed: Bed, host: str | Host) -> None:
    network.unshape(_host(bed, host))


def freeze(bed: Bed, pids: list[int], name: str) -> Path:
    """Freeze `pids` in the kernel; returns the freezer group to pass to `thaw`."""
    return freezer.freeze(bed.layout.freezer, pids, name)


def thaw(group: Path) -> None:
    freezer.thaw(group)


def drain(bed: Bed, host: str | Host, reason: str) -> None:
    slurm.drain(bed.layout, _host(bed, host), reason)


def resume(bed: Bed, host: str | Host) -> None:
    slurm.resume(bed.layout, _host(bed, host))


def clear(bed: Bed) -> None:
    """Undo every fault: cancel the bed's jobs, thaw and remove frozen groups, links up at full speed,
    dead hosts revived, drained hosts resumed. The bed is as `up` left it."""
    slurm.cancel_all(bed.layout)
    freezer.remove_all(bed.layout.freezer)
    for h in bed.hosts:
        network.unshape(h)
        network.set_link(h, up=True)
        if not slurm.slurmd_pid(bed.layout, h):
            slurm.ensure_slurmd(bed.layout, h)
    states = slurm.node_states(bed.layout)
    for h in bed.hosts:
        if any(s in states.get(h.name, "") for s in ("drain", "down", "fail")):
            slurm.resume(bed.layout, h)
    slurm.wait_idle(bed.layout, list(bed.hosts))

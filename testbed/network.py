"""The bed's network: one bridge on the machine, one network namespace per host, a veth pair between.

Each host reaches the others and the machine (the bridge address, where slurmctld listens) on one
subnet, and nothing else: no default route is set inside a host, so a packet to any other address
fails with "Network is unreachable" instead of leaving the machine.
"""

from __future__ import annotations

import ipaddress
import json
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from testbed.cmd import BedError, run
from testbed.layout import NETNS_DIR, Host, Layout


def _links() -> dict[str, dict[str, Any]]:
    """The machine's links by name (root namespace)."""
    return {link["ifname"]: link for link in json.loads(run(["ip", "-j", "link", "show"]).out or "[]")}


def namespaces() -> list[str]:
    """Every named network namespace (`ip netns list`)."""
    out = run(["ip", "-j", "netns", "list"]).out.strip()
    return [n["name"] for n in json.loads(out)] if out else []


def check_subnet_free(layout: Layout) -> None:
    """Refuse a subnet that a route of the machine (other than this bed's bridge) already covers."""
    ours = ipaddress.ip_network(f"{layout.bridge_address}/{layout.prefixlen}", strict=False)
    for route in json.loads(run(["ip", "-j", "-4", "route", "show"]).out or "[]"):
        dst = route.get("dst", "")
        if dst == "default" or route.get("dev") == layout.bridge:
            continue
        try:
            net = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if net.overlaps(ours):
            raise BedError(
                f"subnet {ours} overlaps the route {dst} on {route.get('dev')}; pass another --subnet",
                permanent=True,
            )


def ensure_bridge(layout: Layout) -> bool:
    """Create the bridge with the machine's address on it; True when it was made now."""
    made = layout.bridge not in _links()
    if made:
        run(["ip", "link", "add", layout.bridge, "type", "bridge"], what="bridge")
    run(["ip", "addr", "replace", f"{layout.bridge_address}/{layout.prefixlen}", "dev", layout.bridge], what="bridge")
    run(["ip", "link", "set", layout.bridge, "up"], what="bridge")
    return made


def ensure_host(layout: Layout, host: Host) -> bool:
    """The host's namespace, its link to the bridge and its address, all up; True when made now."""
    made = False
    if host.name not in namespaces():
        run(["ip", "netns", "add", host.name], what=f"namespace {host.name}")
        made = True
    if host.veth not in _links():
        run(
            ["ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.name],
            what=f"link of {host.name}",
        )
        made = True
    run(["ip", "link", "set", host.veth, "master", layout.bridge], what=f"link of {host.name}")
    run(["ip", "link", "set", host.veth, "up"], what=f"link of {host.name}")
    inside = ["ip", "-n", host.name]
    run([*inside, "addr", "replace", f"{host.address}/{layout.prefixlen}", "dev", "eth0"], what=f"address of {host.name}")
    run([*inside, "link", "set", "eth0", "up"], what=f"link of {host.name}")
    run([*inside, "link", "set", "lo", "up"], what=f"loopback of {host.name}")
    return made


def found(layout: Layout) -> tuple[list[str], list[str]]:
    """This bed's namespaces and links that exist now, found by their names (whatever the host count)."""
    hosts = layout.host_pattern()
    veths = layout.veth_pattern()
    ns = [n for n in namespaces() if hosts.match(n)]
    links = [name for name in _links() if veths.match(name) or name == layout.bridge]
    return sorted(ns), sorted(links)


def remove(layout: Layout, wait: timedelta = timedelta(seconds=15)) -> list[str]:
    """Delete this bed's namespaces, links and bridge; wait until the kernel has let them go."""
    ns, links = found(layout)
    for name in ns:
        run(["ip", "netns", "delete", name], check=False)
    for name in links:
        run(["ip", "link", "delete", name], check=False)
    # NOTE: a namespace's devices are freed by a kernel work queue after its last user goes, not at
    # `ip netns delete`: wait for the veths to vanish, so that a following `up` does not find them.
    deadline = time.monotonic() + wait.total_seconds()
    while time.monotonic() < deadline:
        left_ns, left_links = found(layout)
        if not left_ns and not left_links:
            break
        time.sleep(0.1)
    return [*ns, *links]


def remove_netns_dir() -> list[str]:
    """Remove /run/netns (and iproute2's mount of it) when no namespace is left in it."""
    if not NETNS_DIR.is_dir() or any(NETNS_DIR.iterdir()):
        return []
    run(["umount", "--lazy", str(NETNS_DIR)], check=False)  # iproute2 bind-mounts it onto itself
    NETNS_DIR.rmdir()
    return [str(NETNS_DIR)]


# ---------------------------------------------------------------- link state and shaping (faults)


def set_link(host: Host, up: bool) -> None:
    """Take the host's link down (a partition: nothing in or out) or bring it back."""
    run(["ip", "link", "set", host.veth, "up" if up else "down"], what=f"link of {host.name}")


def link_is_up(host: Host) -> bool:
    info = _links().get(host.veth)
    return info is not None and "UP" in info.get("flags", [])


TBF_LATENCY = "200ms"


def _tbf_args(rate_bit_s: int) -> list[str]:
    # NOTE: the bucket must hold at least one timer tick of traffic (rate / HZ, HZ <= 1000) or tbf cannot
    # reach its rate; 1/100 s of it also keeps bursts small next to the MiB-sized messages tests time.
    burst = max(32 * 1024, rate_bit_s // 8 // 100)
    return ["root", "tbf", "rate", f"{rate_bit_s}bit", "burst", str(burst), "latency", TBF_LATENCY]


def shape(host: Host, rate_bit_s: int) -> None:
    """Limit the host's link to `rate_bit_s` in both directions (tbf on each end of the veth pair)."""
    if rate_bit_s < 8_000:
        raise ValueError(f"rate must be >= 8 kbit/s, got {rate_bit_s} bit/s")
    run(["tc", "qdisc", "replace", "dev", host.veth, *_tbf_args(rate_bit_s)], what=f"slow link of {host.name}")
    run(["tc", "-n", host.name, "qdisc", "replace", "dev", "eth0", *_tbf_args(rate_bit_s)], what=f"slow link of {host.name}")


def unshape(host: Host) -> None:
    """Remove the rate limit (both ends); nothing to do when there is none."""
    for argv in (["tc"], ["tc", "-n", host.name]):
        dev = host.veth if len(argv) == 1 else "eth0"
        if "tbf" in run([*argv, "qdisc", "show", "dev", dev], check=False).out:
            run([*argv, "qdisc", "del", "dev", dev, "root"], what=f"slow link of {host.name}")


_RATE = re.compile(r"\btbf\b.*?\brate (\S+)")


def shaped_rate(host: Host) -> str | None:
    """The tbf rate on the host's link as tc prints it ("80Mbit"), or None."""
    m = _RATE.search(run(["tc", "qdisc", "show", "dev", host.veth], check=False).out)
    return m.group(1) if m else None


def host_exists(host: Host) -> bool:
    return Path(host.net_ns).exists()

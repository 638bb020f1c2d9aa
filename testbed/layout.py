"""Where everything of a bed lives and what it is called, derived from its Config alone.

One prefix names it all, so that `down` finds every piece again from the prefix, also after the
process that ran `up` was killed half-way:

    host i (1-based)   hostname, network namespace and Slurm node  {prefix}{i}        e.g. mh1
                       address                                     subnet .10+i       e.g. 10.213.0.11
                       its end of the link (in its namespace)      eth0
    the link           host-side veth, on the bridge               {prefix}v{i}       e.g. mhv1
    the bridge         the machine's side, slurmctld's address     {prefix}br0, .1    e.g. mhbr0, 10.213.0.1
    state              config, logs, spools, namespaces, /tmp      /run/{prefix}-testbed/
    frozen processes   cgroup v1 freezer                           /sys/fs/cgroup/freezer/{prefix}-testbed/

A prefix is letters only, so that host names ({prefix} + digits) of one bed never match another
bed's prefix ("mh" + "t1" is not "mh" + digits).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

PREFIX = re.compile(r"^[a-z]{1,8}$")
MAX_HOSTS = 32
FIRST_HOST_OFFSET = 10  # host i gets network address + 10 + i: .11, .12, ...
FREEZER_ROOT = Path("/sys/fs/cgroup/freezer")
NETNS_DIR = Path("/run/netns")  # iproute2's: where `ip netns add` binds network namespaces


@dataclass(frozen=True, slots=True)
class Host:
    """One host of the bed."""

    index: int
    name: str
    """Hostname, network namespace name and Slurm node name."""
    address: str
    veth: str
    """The host-side end of its link (on the bridge): what link faults act on."""
    uts_ns: Path
    mnt_ns: Path
    tmp: Path
    """The directory mounted as this host's /tmp."""

    @property
    def net_ns(self) -> Path:
        return NETNS_DIR / self.name


@dataclass(frozen=True, slots=True)
class Layout:
    """Names, addresses and paths of one bed."""

    prefix: str
    hosts: tuple[Host, ...]
    bridge: str
    bridge_address: str
    prefixlen: int
    state_dir: Path
    ns_dir: Path
    """Bind mounts that keep each host's UTS and mount namespaces."""
    etc_dir: Path
    slurm_conf: Path
    hosts_file: Path
    """Every host's /etc/hosts."""
    munge_socket: Path
    munge_key: Path
    log_dir: Path
    record: Path
    """The Config the bed was brought up with (JSON), for `status` and `down` without arguments."""
    made_netns_dir: Path
    """Marker: /run/netns did not exist before this bed, so `down` removes it once it is empty."""
    freezer: Path

    @classmethod
    def build(cls, prefix: str, n_hosts: int, subnet: str, state_root: str | Path = "/run") -> Layout:
        if not PREFIX.match(prefix):
            raise ValueError(f"prefix must be 1-8 lower-case letters (it names links, namespaces, hosts), got {prefix!r}")
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in [1, {MAX_HOSTS}], got {n_hosts}")
        net = ipaddress.ip_network(subnet, strict=True)
        state = Path(state_root) / f"{prefix}-testbed"
        hosts = tuple(
            Host(
                index=i,
                name=f"{prefix}{i}",
                address=str(net.network_address + FIRST_HOST_OFFSET + i),
                veth=f"{prefix}v{i}",
                uts_ns=state / "ns" / f"{prefix}{i}.uts",
                mnt_ns=state / "ns" / f"{prefix}{i}.mnt",
                tmp=state / "tmp" / f"{prefix}{i}",
            )
            for i in range(1, n_hosts + 1)
        )
        return cls(
            prefix=prefix,
            hosts=hosts,
            bridge=f"{prefix}br0",
            bridge_address=str(net.network_address + 1),
            prefixlen=net.prefixlen,
            state_dir=state,
            ns_dir=state / "ns",
            etc_dir=state / "etc",
            slurm_conf=state / "etc" / "slurm.conf",
            hosts_file=state / "etc" / "hosts",
            munge_socket=state / "munge" / "munge.sock",
            munge_key=state / "munge-key" / "munge.key",
            log_dir=state / "log",
            record=state / "bed.json",
            made_netns_dir=state / "made-run-netns",
            freezer=FREEZER_ROOT / f"{prefix}-testbed",
        )

    # -- lookups
    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ValueError(f"no host {name!r} on this bed; its hosts: {', '.join(h.name for h in self.hosts)}")

    def host_pattern(self) -> re.Pattern[str]:
        """Matches this bed's host (and namespace) names, whatever its host count."""
        return re.compile(rf"^{self.prefix}(\d+)$")

    def veth_pattern(self) -> re.Pattern[str]:
        return re.compile(rf"^{self.prefix}v(\d+)$")

    def slurm_env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment whose Slurm commands (srun, sinfo, scontrol) talk to this bed."""
        env = dict(base if base is not None else {})
        env["SLURM_CONF"] = str(self.slurm_conf)
        return env

"""A multi-host cluster on one machine: `Bed(Bed.Config(hosts=4)).up()`, then Slurm across its hosts.

`up` is idempotent: it makes what is missing and keeps what is there, and says which. `down` removes
everything of the bed's prefix that exists (processes, namespaces, links, bridge, mounts, freezer
groups, state directory), found by name, so it also cleans up after an `up` that was killed half-way;
it touches nothing that does not carry the prefix. Layout and names: testbed/layout.py.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from testbed import freezer, hostns, network, procs, slurm
from testbed.cmd import BedError, require_root, require_tools
from testbed.layout import MAX_HOSTS, NETNS_DIR, PREFIX, Host, Layout

def default_shared_tmp() -> tuple[str, ...]:
    """This checkout and the running environment, if they live under /tmp (a CI clone may)."""
    import sys

    here = Path(__file__).resolve().parents[1]
    return tuple(sorted({str(p) for p in (here, Path(sys.prefix).resolve()) if hostns.under_tmp(str(p))}))


# The programs the bed starts on the machine; `down` ends those that name the bed's state directory.
DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")


@dataclass(slots=True)
class Report:
    """What `up` or `down` did: each item named, so the caller can print or assert on it."""

    made: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


class Bed:
    """One bed, addressed by its prefix."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        hosts: int = 4
        """Number of hosts (network namespaces with a slurmd each)."""
        prefix: str = "mh"
        """Names everything the bed makes (1-8 lower-case letters): hosts mh1.., links mhv1.., bridge mhbr0."""
        subnet: str = "10.213.0.0/24"
        """IPv4 subnet of the bridge (.1, slurmctld) and the hosts (.11, .12, ...); must be free on this machine."""
        cpus_per_host: int = 2
        """CPUs each host offers to Slurm (tasks per host); the machine's own count does not limit it."""
        slurmctld_port: int = 6817
        """slurmctld's port on the machine; two beds at once need two ports."""
        slurmd_timeout: timedelta = timedelta(seconds=10)
        """How long a silent slurmd (a dead host) takes to be marked DOWN."""
        state_root: str = "/run"
        """The state directory is STATE_ROOT/PREFIX-testbed."""
        shared_tmp: tuple[str, ...] = field(default_factory=default_shared_tmp)
        """Directories under the machine's /tmp that every host still sees (each host has a /tmp of its own, which
        would hide them): a checkout or a virtual environment cloned under /tmp, a test session's temporary
        directory. Default: this checkout and the running interpreter's environment, where they live under /tmp."""

        def __post_init__(self) -> None:
            if not PREFIX.match(self.prefix):
                raise ValueError(f"prefix must be 1-8 lower-case letters, got {self.prefix!r}")
            if not 1 <= self.hosts <= MAX_HOSTS:
                raise ValueError(f"hosts must be in [1, {MAX_HOSTS}], got {self.hosts}")
            try:
                net = ipaddress.ip_network(self.subnet, strict=True)
            except ValueError as exc:
                raise ValueError(f"subnet must be an IPv4 network such as 10.213.0.0/24: {exc}") from None
            if net.version != 4 or not net.is_private or net.num_addresses < 16 + self.hosts:
                raise ValueError(
                    f"subnet must be a private IPv4 network with room for {self.hosts} hosts "
                    f"(/24 is plenty), got {self.subnet}"
                )
            if not 1 <= self.cpus_per_host <= 256:
                raise ValueError(f"cpus_per_host must be in [1, 256], got {self.cpus_per_host}")
            if not 1024 <= self.slurmctld_port <= 65535 or self.slurmctld_port == slurm.SLURMD_PORT:
                raise ValueError(f"slurmctld_port must be in [1024, 65535] and not {slurm.SLURMD_PORT}, "
                                 f"got {self.slurmctld_port}")
            if not timedelta(seconds=1) <= self.slurmd_timeout <= timedelta(minutes=10):
                raise ValueError(f"slurmd_timeout must be in [1s, 10m], got {self.slurmd_timeout}")
            if not Path(self.state_root).is_absolute():
                raise ValueError(f"state_root must be an absolute path, got {self.state_root!r}")
            for path in self.shared_tmp:
                if not Path(path).is_absolute() or not hostns.under_tmp(path):
                    raise ValueError(f"shared_tmp: {path!r} is not an absolute path under /tmp")

        def to_payload(self) -> dict[str, Any]:
            data = asdict(self)
            data["slurmd_timeout"] = self.slurmd_timeout.total_seconds()
            data["shared_tmp"] = list(self.shared_tmp)  # as JSON gives it back, so records compare equal
            return data

        @classmethod
        def from_payload(cls, data: dict[str, Any]) -> Bed.Config:
            return cls(**{**data, "slurmd_timeout": timedelta(seconds=data["slurmd_timeout"]),
                          "shared_tmp": tuple(data.get("shared_tmp", ()))})

    def __init__(self, config: Config) -> None:
        self.config = config
        self.layout = Layout.build(config.prefix, config.hosts, config.subnet, config.state_root)

    @classmethod
    def existing(cls, prefix: str = "mh", state_root: str = "/run") -> Bed:
        """The bed that `up` recorded for `prefix`; BedError when there is none."""
        record = Layout.build(prefix, 1, "10.0.0.0/24", state_root).record
        try:
            return cls(cls.Config.from_payload(json.loads(record.read_text())))
        except FileNotFoundError:
            raise BedError(f"no test bed with prefix {prefix!r} is up ({record} does not exist)") from None

    @property
    def hosts(self) -> tuple[Host, ...]:
        return self.layout.hosts

    def host(self, name: str) -> Host:
        return self.layout.host(name)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` plus SLURM_CONF: Slurm commands run with it talk to this bed."""
        return self.layout.slurm_env(base)

    # ------------------------------------------------------------------------------------------ up

    def up(self, wait: timedelta = timedelta(seconds=60)) -> Report:
        require_root()
        require_tools()
        report = Report()
        layout, cfg = self.layout, self.config
        self._check_same_config()
        network.check_subnet_free(layout)
        for d in (layout.state_dir, layout.etc_dir, layout.log_dir):
            d.mkdir(parents=True, exist_ok=True)
        if not NETNS_DIR.exists():
            # `ip netns add` creates it (and mounts it) on first use: ours to remove when the bed goes.
            layout.made_netns_dir.touch()
        layout.record.write_text(json.dumps(cfg.to_payload(), indent=2) + "\n")
        layout.hosts_file.write_text(hostns.hosts_file_text(layout))
        layout.slurm_conf.write_text(
            slurm.conf_text(layout, cfg.cpus_per_host, cfg.slurmctld_port, cfg.slurmd_timeout)
        )
        _note(report, network.ensure_bridge(layout), f"bridge {layout.bridge} {layout.bridge_address}")
        hostns.ensure_ns_dir(layout)
        for h in layout.hosts:
            _note(report, network.ensure_host(layout, h), f"host {h.name} {h.address} (namespace, link {h.veth})")
            _note(report, hostns.ensure_host(layout, h, cfg.shared_tmp), f"host {h.name} hostname, /etc/hosts, /tmp")
        _note(report, slurm.ensure_munge(layout), "munged")
        _note(report, slurm.ensure_slurmctld(layout, cfg.slurmctld_port), f"slurmctld :{cfg.slurmctld_port}")
        for h in layout.hosts:
            _note(report, slurm.ensure_slurmd(layout, h), f"slurmd on {h.name}")
        slurm.wait_idle(layout, list(layout.hosts), wait)
        return report

    def _check_same_config(self) -> None:
        """An existing bed of this prefix with another shape must go down first (daemons read one config)."""
        try:
            old = json.loads(self.layout.record.read_text())
        except FileNotFoundError:
            return
        if old != self.config.to_payload():
            raise BedError(
                f"a test bed with prefix {self.config.prefix!r} is already up with another configuration "
                f"({old}); run `megaheal testbed down --prefix {self.config.prefix}` first",
                permanent=True,
            )

    # ---------------------------------------------------------------------------------------- down

    def down(self) -> Report:
        """Remove everything of this prefix; safe to run on a half-made bed or on nothing."""
        require_root()
        report = Report()
        layout = self.layout
        # Thaw first: a frozen process takes SIGKILL only once thawed.
        for group in freezer.groups(layout.freezer):
            freezer.thaw(group)
        ns, _ = network.found(layout)
        victims: set[int] = set()
        for name in ns:
            victims.update(procs.in_namespace(Path("/run/netns") / name))
        daemons = procs.with_argument(str(layout.state_dir), DAEMONS)  # they were started with our paths
        victims.update(daemons)
        procs.kill(victims)
        left = procs.wait_gone(victims, 10.0)
        if left:
            raise BedError(f"processes of the bed survived SIGKILL: {left}")
        report.removed += [f"{len(victims)} process(es)"] if victims else []
        report.removed += [f"freezer group {g}" for g in freezer.remove_all(layout.freezer)]
        report.removed += [f"mount {m}" for m in hostns.remove(layout)]
        report.removed += network.remove(layout)
        if layout.made_netns_dir.exists():
            report.removed += network.remove_netns_dir()
        if layout.state_dir.exists():
            shutil.rmtree(layout.state_dir)
            report.removed.append(str(layout.state_dir))
        leftovers = self.leftovers()
        if leftovers:
            raise BedError(f"down left these behind: {leftovers}")
        return report

    def leftovers(self) -> list[str]:
        """Anything of this prefix that exists now (empty after a clean `down`)."""
        layout = self.layout
        ns, links = network.found(layout)
        out = [f"namespace {n}" for n in ns] + [f"link {name}" for name in links]
        out += [f"process {p}" for p in procs.with_argument(str(layout.state_dir), DAEMONS)]
        out += [f"mount {m}" for m in hostns.mount_points() if m.startswith(str(layout.state_dir))]
        if layout.freezer.exists():
            out.append(f"cgroup {layout.freezer}")
        if layout.state_dir.exists():
            out.append(f"directory {layout.state_dir}")
        return out

    # -------------------------------------------------------------------------------------- status

    def status(self) -> dict[str, Any]:
        """What exists now, host by host, and what Slurm says of each host."""
        layout = self.layout
        ns, links = network.found(layout)
        states = slurm.node_states(layout) if slurm.slurmctld_pid(layout) else {}
        frozen = freezer.frozen_pids(layout.freezer)
        hosts = []
        for h in layout.hosts:
            hosts.append({
                "name": h.name,
                "address": h.address,
                "namespace": h.name in ns,
                "link": ("up" if network.link_is_up(h) else "down") if h.veth in links else "missing",
                "rate_limit": network.shaped_rate(h) if h.veth in links else None,
                "slurmd_pid": slurm.slurmd_pid(layout, h),
                "slurm_state": states.get(h.name),
            })
        healthy = (
            all(x["namespace"] and x["link"] == "up" and x["slurmd_pid"] and x["slurm_state"] == "idle"
                for x in hosts)
            and bool(slurm.munged_pid(layout)) and bool(slurm.slurmctld_pid(layout)) and not frozen
        )
        return {
            "prefix": layout.prefix,
            "up": layout.record.exists(),
            "healthy": healthy,
            "slurm_conf": str(layout.slurm_conf),
            "bridge": {"name": layout.bridge, "address": layout.bridge_address, "exists": layout.bridge in links},
            "munged_pid": slurm.munged_pid(layout),
            "slurmctld_pid": slurm.slurmctld_pid(layout),
            "hosts": hosts,
            "frozen": frozen,
        }

    # ------------------------------------------------------------------------------------ in hosts

    def enter(self, host: str | Host, workdir: str | None = None) -> list[str]:
        """The argv prefix that runs a program inside `host`: `[*bed.enter("mh1"), "hostname"]`."""
        h = host if isinstance(host, Host) else self.host(host)
        return hostns.enter(self.layout, h, workdir)

    def pids(self, host: str | Host) -> list[int]:
        """Every live process inside `host` (its slurmd, job steps, ranks)."""
        h = host if isinstance(host, Host) else self.host(host)
        return procs.in_namespace(h.net_ns)


def _note(report: Report, made: bool, what: str) -> None:
    (report.made if made else report.kept).append(what)

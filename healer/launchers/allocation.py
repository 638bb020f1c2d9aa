"""The Slurm allocation `megaheal run --launcher slurm` runs in (sbatch, salloc): its hosts, how each is reached,
how many ranks each host runs, where the healer listens for the agents, and the job's layout on it.

Read from the job's environment and from Slurm itself (ground/slurm.py), once, at the start of `megaheal run`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ground import slurm
from ground.names import check_name
from train.config import TrainConfig
from train.layout import LayoutError, validate_layout

DEFAULT_RANKS_PER_NODE = 2


class NotInAllocation(ValueError):
    """`--launcher slurm` outside a Slurm allocation."""


@dataclass(frozen=True, slots=True)
class Allocation:
    job_id: str
    hosts: tuple[str, ...]
    """In Slurm's order; the batch host (where `megaheal run` runs under sbatch) is the first."""
    addresses: dict[str, str]
    """Each host's cluster address (Slurm's NodeAddr): what its agent binds and the healer reaches."""
    ranks_per_node: int
    """The allocation's --ntasks-per-node, else DEFAULT_RANKS_PER_NODE."""
    healer_address: str
    """This machine's address on the way to the hosts: where the healer's report endpoint binds."""

    def __post_init__(self) -> None:
        for host in self.hosts:
            check_name(host, "node")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> Allocation:
        """The allocation this process runs in. NotInAllocation outside one; SlurmError when Slurm does not
        answer."""
        job_id, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
        if not job_id or not nodelist:
            raise NotInAllocation("--launcher slurm runs inside a Slurm allocation (sbatch or salloc; see "
                                  "deploy/slurm/megaheal.sbatch): SLURM_JOB_ID and SLURM_JOB_NODELIST are not set")
        hosts = slurm.hostnames(nodelist)
        info = slurm.nodes(hosts)
        per_node = env.get("SLURM_NTASKS_PER_NODE", "")
        if per_node and not per_node.isdecimal():
            raise ValueError(f"SLURM_NTASKS_PER_NODE is {per_node!r}, not a number of ranks per host")
        addresses = {h: info[h].address for h in hosts}
        return cls(job_id=job_id, hosts=tuple(hosts), addresses=addresses,
                   ranks_per_node=int(per_node) if per_node else DEFAULT_RANKS_PER_NODE,
                   healer_address=route_address(addresses[hosts[0]]))

    def split(self, spares: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(hosts that train, spares): the last `spares` hosts wait as spares."""
        if not 0 <= spares < len(self.hosts):
            raise ValueError(f"--spares {spares}: the allocation has {len(self.hosts)} host(s), and at least one "
                             "must train")
        return self.hosts[:len(self.hosts) - spares], self.hosts[len(self.hosts) - spares:]

    def dp(self, cfg: TrainConfig, nodes: int) -> int:
        """The data-parallel degree of `cfg` on `nodes` hosts of `ranks_per_node` ranks each: the rest of the layout
        (pp, tp) is the config's. ValueError saying why when the ranks do not make a layout the trainer accepts."""
        world = nodes * self.ranks_per_node
        par = cfg.parallel
        if world % (par.pp * par.tp):
            raise ValueError(f"{nodes} host(s) x {self.ranks_per_node} ranks = {world} ranks do not split into "
                             f"pp {par.pp} x tp {par.tp} groups")
        dp = world // (par.pp * par.tp)
        try:
            validate_layout(replace(par, dp=dp), cfg.model, cfg.global_batch, world)
        except LayoutError as exc:
            raise ValueError(f"{nodes} host(s) x {self.ranks_per_node} ranks give dp {dp}: {exc}") from exc
        return dp


def route_address(peer: str) -> str:
    """This machine's source address towards `peer` (the kernel's route choice; a UDP "connect" sends nothing)."""
    family, _, _, _, addr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])

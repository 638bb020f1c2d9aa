"""One rank's part in a job of replica groups: each step's quorum across the groups, the gradients averaged over
the groups that take part, and the commit that all of them agree on (torchft's Manager, on the process groups of
this machine's torch: gloo on CPU, NCCL on CUDA).

Inside a group the trainer is what it always is (pp x dp x tp, FSDP2 over dp); across groups each rank talks only
to the ranks at the same place in the other groups. A step goes:

    quorum = groups.begin()        # who takes part; a group that is behind takes a live peer's state here
    ... forward and backward on this group's share of the step's batch ...
    groups.average(tensors)        # the gradients (and the loss) averaged over the groups that take part
    if groups.commit(): optimizer.step()   # else: every group left retries the step with the groups still there

A group that dies mid-step fails the others' average (the connection drops, or `ft.timeout_s` runs out): nothing is
committed, and the next quorum goes on without it. Each group's store (where its ranks and the others' meet to form
the cross-group process group) is a TCPStore of its own on the host's training address, made fresh by every start
of the group, so that no key of an earlier start is read by a later one.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from train.ft.config import FtConfig
from train.ft.transport import SignedTransport
from wire.ft_env import FtEnv
from wire.warm_seal import read_key


@dataclass(frozen=True, slots=True)
class Quorum:
    participants: int
    """Groups taking part in this step."""
    rank: int
    """This group's place among them, 0 to participants - 1: which share of the step's batch it trains on."""
    step: int
    """The step about to be trained (a group that healed is at its peers' step now)."""
    behind: bool = False
    """The quorum has not reached the step the job was at when this group started (ft_env.AT_LEAST): no group of it
    holds the job's state, and it must not train."""


class ReplicaGroups:
    """This rank's manager in the quorum of replica groups.

        groups = ReplicaGroups(cfg.ft, env, device, state_dict=..., load_state_dict=...)
        groups.resume_at(step)     # before the first quorum, when this group resumed from its own checkpoint
    """

    def __init__(self, cfg: FtConfig, env: FtEnv, device: torch.device, *,
                 state_dict: Callable[[], dict[str, Any]],
                 load_state_dict: Callable[[dict[str, Any]], None]) -> None:
        from torchft import Manager

        from train.ft.process_group import SaltedGloo, SaltedNCCL, watch

        self.env = env
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        timeout = timedelta(seconds=cfg.timeout_s)
        # NOTE: kept: rank 0's is the master, which the group's store lives in for as long as the group trains
        self._store, store_address, port = _group_store(env.address, rank, timeout)
        self._transport: SignedTransport[dict[str, Any]] = SignedTransport(
            read_key(env.key_file, "replica groups' key"), env.address, timeout)
        pg = SaltedNCCL(timeout=timeout) if device.type == "cuda" else SaltedGloo(timeout=timeout)
        self._commit_timeout = timedelta(seconds=cfg.quorum_timeout_s)

        self.manager = Manager(
            pg=pg, min_replica_size=cfg.min_groups, load_state_dict=load_state_dict, state_dict=state_dict,
            replica_id=f"group{env.group}", lighthouse_addr=env.lighthouse, rank=rank, world_size=world,
            store_addr=store_address, store_port=port, hostname=env.address, timeout=timeout,
            quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s), connect_timeout=timeout,
            checkpoint_transport=self._transport, quorum_retries=cfg.lighthouse_retries,
            # NOTE: the quorum is waited for before the step's batch is read: which share of it this group trains
            # on depends on who takes part.
            use_async_quorum=False)
        watch(self.manager, pg)

    @property
    def group(self) -> int:
        return self.env.group

    def resume_at(self, step: int) -> None:
        """This group resumed from its own checkpoint at `step`: the quorum hears it is there, and a group further
        on (or a peer here, when the others are further on) sends its state to whoever is behind."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin(self) -> Quorum:
        self.manager.start_quorum()
        rank = self.manager.participating_rank()
        if rank is None:  # NOTE: only under torchft's fixed-with-spares mode, which is not used here
            raise RuntimeError(f"replica group {self.group} is not taking part in step {self.manager.current_step()}")
        step = self.manager.current_step()
        return Quorum(participants=self.manager.num_participants(), rank=rank, step=step,
                      behind=step < self.env.at_least)

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor (a DTensor's local shard) replaced by its average over the groups taking part, in one
        collective over a flat copy. A failure is not raised: it makes `commit` answer False."""
        locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        if not locals_:
            return
        flat = torch.cat([t.detach().reshape(-1).float() for t in locals_])
        self.manager.allreduce(flat).wait()
        if self.manager.errored() is not None:
            return  # the copies may hold anything now; the step is not committed
        offset = 0
        with torch.no_grad():
            for t in locals_:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n

    def commit(self) -> bool:
        """Whether this step's update is to be made: every rank of every group taking part got through, and
        enough groups took part (ft.min_groups)."""
        # NOTE: the group's ranks agree here, and a lost peer fails their average at different times (at once where
        # its connection closed, after ft.timeout_s where it went silent): waiting only ft.timeout_s for the slowest
        # made the fastest fail the group (a TimeoutError in a fresh make test's bed run): it waits as long as a
        # quorum may
        return self.manager.should_commit(timeout=self._commit_timeout)

    def failure(self) -> str | None:
        """What failed the step (the peer lost, a timeout), when it was not committed."""
        errored = self.manager.errored()
        return None if errored is None else f"{type(errored.original_exception).__name__}: {errored.original_exception}"

    def close(self) -> None:
        self.manager.shutdown(wait=False)
        self._transport.shutdown(wait=False)


def _group_store(address: str, rank: int, timeout: timedelta) -> tuple[dist.TCPStore, str, int]:
    """A TCPStore on this group's rank 0, listening on its host's `address` only (a TCPStore listens on every
    interface whatever host it is given: the socket is bound here and handed over); its address and port, told to
    every rank of the group over the group's own process group."""
    where: list[Any] = [address, 0]
    store: dist.TCPStore | None = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((address, 0))
        listener.listen(128)
        where[1] = listener.getsockname()[1]
        store = dist.TCPStore(address, where[1], is_master=True, wait_for_workers=False, timeout=timeout,
                              master_listen_fd=listener.detach())
    if dist.is_initialized():
        dist.broadcast_object_list(where, src=0)
    if store is None:
        store = dist.TCPStore(where[0], where[1], is_master=False, wait_for_workers=False, timeout=timeout)
    return store, str(where[0]), int(where[1])

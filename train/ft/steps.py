"""The trainer's side of replica groups (train/ft/): what a Trainer (train/trainer.py) does as one group of
several, kept apart from its step so that the step reads the same whether or not it trains in groups. Mixed into
Trainer; every method works on the trainer's own objects (its model parts, optimizer, loader, timers).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from train.checkpoint.state import capture, load_template, restore
from train.ft.replicas import ReplicaGroups
from train.rerun import Outcome
from train.timing import PhaseTimer
from train.warm.snapshot import Snapshot

WAIT_FOR_STATE_S = 0.5
"""Between two quorums that no group holding the job's state took part in."""

if TYPE_CHECKING:
    from train.trainer import Trainer


class GroupSteps:
    def _replica_groups(self: Trainer) -> ReplicaGroups | None:
        """Under ft.enabled: this rank's part in the quorum of replica groups (train/ft/), told where this group
        resumed from so that a group that is behind is sent a live peer's state."""
        if self.ft_env is None:
            return None
        groups = ReplicaGroups(self.cfg.ft, self.ft_env, self.device, state_dict=self._live_state,
                               load_state_dict=self._take_live_state)
        groups.resume_at(self.step_index)
        return groups

    def _live_state(self: Trainer) -> dict[str, Any]:
        """This rank's state as a joining group's rank at the same place takes it: plain host tensors."""
        state = capture(self.parts, self.optimizer, self.lr_scheduler, self.step_index, self.loader.position,
                        self.place.rank)
        return Snapshot.take(state, self.step_index, self.place.rank, self.layout).state

    def _take_live_state(self: Trainer, state: dict[str, Any]) -> None:
        """A live peer's state (its rank at this rank's place in its group): this group is at the peers' step now."""
        template = load_template(self.parts, self.optimizer, self.lr_scheduler, self.place.rank, same_world=True)
        Snapshot(step=int(state["train"]["step"]), rank=self.place.rank, layout=self.layout, state=state).fill(
            template, self.place.rank, self.layout)
        behind = self.step_index
        self.step_index, position = restore(template, self.parts, self.optimizer, self.lr_scheduler,
                                            self.place.rank)
        self.loader.load_state_dict({"sample_index": position})
        if self.place.rank == 0:
            print(f"replica group {self.ft_env.group if self.ft_env else '?'}: took a live peer's state at step "
                  f"{self.step_index} (was at {behind})", flush=True)

    def _average_over_groups(self: Trainer, checked: Outcome) -> Outcome:
        """The gradients (each this rank's shard, already reduced over its group's dp) and the loss averaged over
        the replica groups of the step: each group trained on an equal share of the step's batch."""
        assert self.ft is not None
        grads = [p.grad for chunk in self.chunks for p in chunk.parameters() if p.grad is not None]
        loss = (checked.loss.detach().float().reshape(1).clone() if checked.loss is not None
                else torch.zeros(1, device=self.device))
        self.ft.average([*grads, loss])
        return replace(checked, loss=loss[0]) if checked.loss is not None else checked

    def _wait_for_state(self: Trainer, timer: PhaseTimer) -> None:
        """A quorum of groups that all started after the job's step (two started at once, the others busy): none
        holds the job's state. Nothing is trained; the next quorum is waited for."""
        assert self.ft is not None and self._quorum is not None
        timer.collect()
        if self.place.rank == 0:
            print(f"replica group {self.ft.group}: a quorum at step {self._quorum.step}, short of step "
                  f"{self.ft.env.at_least} the job had reached: waiting for a group that holds its state", flush=True)
        time.sleep(WAIT_FOR_STATE_S)

    def _abandon(self: Trainer, position: int, timer: PhaseTimer) -> None:
        """A step the replica groups did not commit: no update, the same batch again at the next quorum."""
        assert self.ft is not None
        self.optimizer.zero_grad(set_to_none=True)
        self.loader.load_state_dict({"sample_index": position})
        scratch = PhaseTimer(self.device)
        self.reduce_timer.drain_into(scratch)
        self.gather_timer.drain_into(scratch)
        if self.pipeline_waits is not None:
            self.pipeline_waits.drain_into(scratch)
        timer.collect()
        why = self.ft.failure() or "too few replica groups took part"
        self.telemetry.event("ft_step_abandoned", step=self.step_index, reason=why[:300],
                             replicas=self._quorum.participants if self._quorum else None)
        if self.place.rank == 0:
            print(f"replica group {self.ft.group}: step {self.step_index} not committed ({why}); again", flush=True)

"""The `ft` section of the training config: fault tolerance per data-parallel replica group.

With it on, each replica group is a world of its own (its own torchrun, its own pp x dp x tp layout as `parallel`
says) and the groups join each step through a Lighthouse (torchft): a group that is lost drops out of the next
step's quorum while the others go on, and a group that comes back takes a live peer's state before it trains. Which
group a process belongs to, where the Lighthouse is and the run's key come from the environment
(wire/ft_env.py): they differ between the groups of one job, the config does not.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class FtConfig:
    enabled: bool = False
    """Train as one of several replica groups with a per-step quorum (torchft); off: one world, as usual."""
    groups: int = 2
    """Replica groups the job is laid out for: the most that take part in a step."""
    min_groups: int = 1
    """The fewest groups that may commit a step: with fewer, the groups left wait for the others to come back."""
    timeout_s: float = 10.0
    """How long a collective across groups, or a live state transfer, may take before the step is abandoned (a
    group that died mid-step is noticed by then, and the others retry the step without it)."""
    quorum_timeout_s: float = 60.0
    """How long a group waits for a step's quorum (the others to reach it, or enough of them to come back)."""
    lighthouse_retries: int = 10
    """How often a group asks the Lighthouse for a quorum again when it does not answer (it died, and its keeper
    starts it again on the same address): past them, the group fails."""

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"ft.groups must be >= 1, got {self.groups}")
        if not 1 <= self.min_groups <= self.groups:
            raise ValueError(f"ft.min_groups must be between 1 and ft.groups ({self.groups}), got {self.min_groups}")
        if self.lighthouse_retries < 0:
            raise ValueError(f"ft.lighthouse_retries must be >= 0, got {self.lighthouse_retries}")
        for name in ("timeout_s", "quorum_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ft.{name} must be > 0, got {getattr(self, name)}")

    def layout_problems(self, global_batch: int, dp: int, microbatches: int, pp: int) -> list[str]:
        """What keeps the layout from training as replica groups: the groups share each step's batch, so that a
        step's update is the same however many took part, and `global_batch` must split evenly over every number of
        them; a pipeline cannot take part (its stages fix their microbatches' shape at the first step, and a group's
        share of the batch changes with the groups of the step)."""
        if not self.enabled:
            return []
        piped = ([f"ft.enabled needs parallel.pp 1 (got {pp}): a pipeline's stages fix their microbatches' shape at "
                  "the first step, and a group's share of each step's batch changes with the groups that take part"]
                 if pp > 1 else [])
        return piped + [f"global_batch ({global_batch}) must split over {n} replica group(s) x parallel.dp ({dp}) x "
                f"parallel.microbatches ({microbatches}) = {n * dp * microbatches}, as any number of groups from "
                f"ft.min_groups ({self.min_groups}) to ft.groups ({self.groups}) may take part in a step"
                for n in range(self.min_groups, self.groups + 1) if global_batch % (n * dp * microbatches)]

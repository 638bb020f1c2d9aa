"""Each step's global batch, shared by the replica groups that take part in it.

Step k trains on global samples [start + kG, start + (k+1)G) whoever takes part: with n groups, group r takes the
r-th n-th of them, and its dp rank d the d-th dp-th of that. Every group's gradients are the mean over its equal
share, so their average over the n groups is the mean over the whole batch: a step's update is the same with 3
groups as with 2, and a run that lost a group mid-way has seen every sample once, as an uninterrupted one.

The loader's surface is the PrefetchLoader's (train/data.py) that the trainer uses otherwise: `position`, `next`,
`load_state_dict`, `close`. Nothing is prepared ahead: which share is this rank's is known only once the step's
quorum is.
"""

from __future__ import annotations

from typing import Any

import torch

from train.data import TokenSource, TokenStream


class SharedBatches:
    def __init__(self, source: TokenSource, seq_len: int, global_batch: int, dp_rank: int, dp_degree: int,
                 start_sample: int) -> None:
        self._source, self._seq_len, self._global_batch = source, seq_len, global_batch
        self._dp_rank, self._dp_degree = dp_rank, dp_degree
        self._position = start_sample
        self._share: tuple[int, int] | None = None

    @property
    def position(self) -> int:
        """The global sample index of the next step's batch (the same in every group)."""
        return self._position

    def share(self, participants: int, rank: int) -> None:
        """The step's quorum: `participants` groups, this one the `rank`-th."""
        if not 0 <= rank < participants:
            raise ValueError(f"replica rank {rank} is not among {participants} participants")
        self._share = (participants, rank)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._share is None:
            raise RuntimeError("the step's share is not known: call share() with the step's quorum first")
        participants, rank = self._share
        stream = TokenStream(self._source, self._seq_len, self._global_batch,
                             dp_rank=rank * self._dp_degree + self._dp_rank,
                             dp_degree=participants * self._dp_degree, start_sample=self._position)
        batch = stream.next_batch()
        self._position = stream.position
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"sample_index": self._position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._position = int(state["sample_index"])

    def close(self) -> None:
        pass

"""The ids the healer and the node agents both name processes by: a torchrun attempt's run id, a warm pool's, and a
warm worker's. A signal is sent only to a process that carries the run id it was meant for (ground/kill.py)."""

from __future__ import annotations


def run_id(job: str, attempt: int) -> str:
    """torchrun's rendezvous id of attempt `attempt` of `job` (`--rdzv-id`), the same on every host."""
    return f"{job}-{attempt}"


def pool_run_id(job: str, formed_in: int) -> str:
    """The run id of the warm pool formed in attempt `formed_in` of `job`: every worker of it carries it."""
    return f"{job}-warm{formed_in}"


def worker_id(node: str, formed_in: int, role: str) -> str:
    """A worker's id, unique in the job: its host, the attempt that formed its pool and `role` (r<local rank> for
    a rank of the formation, s<n> for the n-th standby)."""
    return f"{node}.{role}.a{formed_in}"

"""The environment a node agent gives the ranks of a user's program, beside torchrun's own (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, ...): the contract between healer/agent/node.py, which sets it, and megaheal/rank/, which
reads it in the rank. docs/your-trainer.md lists it for users.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

JOB = "MEGAHEAL_JOB"
"""The job's name: the ranks' records are filed under it."""
NODE = "MEGAHEAL_NODE"
"""The host's name as the healer knows it."""
ATTEMPT = "MEGAHEAL_ATTEMPT"
"""The attempt's number, from 0: one more at every restart the healer orders. Set for every rank (megaheal's trainer
too), and by a warm worker as each of its generations begins: every step record says which attempt it is of."""
RESTART_COUNT = "MEGAHEAL_RESTART_COUNT"
"""Restarts before this attempt: the attempt's number (0 on the first). The rank's bootstrap sets TORCHELASTIC_RESTART_COUNT to it: each
attempt is a torchrun of its own, whose count would always be 0."""
RESUME_STEP = "MEGAHEAL_RESUME_STEP"
"""After a rollback, the step of the checkpoint to resume from (one the program said it saved: a
`checkpoint_saved` event with that step); unset: the program's own choice (its newest)."""
SKIP_STEPS = "MEGAHEAL_SKIP_STEPS"
"""Steps whose batches the program should pass over after a rollback (comma-separated; unset: none)."""
WARM_CONTROL = "MEGAHEAL_WARM_CONTROL"
"""A warm worker's pool: the store (HOST:PORT) its plans come from (wire/warm_plan.py); megaheal.rank.restartable
runs the wrapped function in each generation that gives the worker a rank. Unset: the process is a plain rank."""
WARM_WORKER = "MEGAHEAL_WARM_WORKER"
"""The warm worker's id in its pool."""
WARM_FROM = "MEGAHEAL_WARM_FROM"
"""The first generation whose plan the worker reads."""
WARM_KEY_FILE = "MEGAHEAL_WARM_KEY_FILE"
"""The path of a private file holding the warm pool's key, which seals its plans (wire/warm_seal.py): the path, never
the key (an environment is readable through /proc)."""
SAFE_PATH_SET = "MEGAHEAL_SAFE_PATH"
"""Set beside PYTHONSAFEPATH=1 by the node agent: the bootstrap imports megaheal's modules without the user's
directory on sys.path, then puts that directory where Python would have it and unsets both (the script's own
children get the usual path)."""
SIDECAR_SOCKET = "MEGAHEAL_SIDECAR_SOCKET"
"""The node's datagram socket the rank's records go to (exporters/client.py)."""


def encode_steps(steps: Iterable[int]) -> str:
    return ",".join(str(s) for s in sorted(set(steps)))


def decode_steps(environ: Mapping[str, str]) -> frozenset[int]:
    """The steps of SKIP_STEPS; ValueError naming the variable when it is not a list of integers >= 0."""
    text = environ.get(SKIP_STEPS, "").strip()
    if not text:
        return frozenset()
    try:
        steps = frozenset(int(item) for item in text.split(","))
    except ValueError:
        raise ValueError(f"{SKIP_STEPS}={text!r}: expected integers >= 0, comma-separated") from None
    if any(s < 0 for s in steps):
        raise ValueError(f"{SKIP_STEPS}={text!r}: expected integers >= 0, comma-separated")
    return steps

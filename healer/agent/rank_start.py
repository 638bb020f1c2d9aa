"""What a start order becomes on this host: the torchrun agent's argument list and the ranks' environment (the
cold start's; a warm pool's workers get the same environment, healer/agent/warm_host.py). Pure but for the
process's own environment, which the ranks inherit, the key file a replica group's ranks read, and the free port a
first host's rendezvous binds."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from wire import ft_env, phase_now, rank_env
from wire.orders import ReplicaStart, StartOrder
from wire.run_ids import run_id
from wire.warm_seal import write_key

FR_BUFFER_SIZE = 2000
"""Collectives the flight recorder keeps per rank (a few steps' worth: a hang needs only the last ones)."""


@dataclass(frozen=True, slots=True)
class HostPlaces:
    """What of the agent's host every rank it starts is told: its name, its local disk and the agent's socket."""

    node: str
    scratch_dir: Path
    socket_path: str
    extra_env: Mapping[str, str]
    """The agent's own additions (an agent in the healer's process cannot use its own environment)."""


def rank_environment(order: StartOrder, host: HostPlaces, phase_dir: Path) -> dict[str, str]:
    """The environment of the ranks of `order` on `host`; `phase_dir`: where they say which phase they are in."""
    env = dict(os.environ) | dict(host.extra_env) | dict(order.env) | {
        "OMP_NUM_THREADS": order.env.get("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1")),
        rank_env.NODE: host.node, "TMPDIR": str(host.scratch_dir.absolute()),
        "MEGAHEAL_SIDECAR_SOCKET": host.socket_path, phase_now.ENV: str(phase_dir),
        rank_env.ATTEMPT: str(order.attempt)}
    # The flight recorder on (gloo's and NCCL's), unless the order or the host says how large: what a hang's
    # evidence reads each rank's last collectives from (exporters/flight_recorder.py). NOTE: TORCH_FR_BUFFER_SIZE
    # since torch 2.9; the older TORCH_NCCL_TRACE_BUFFER_SIZE, when that is what the host sets, still counts
    # (and is deprecated: torch warns on every rank).
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env.setdefault("TORCH_FR_BUFFER_SIZE", str(FR_BUFFER_SIZE))
    if order.program is not None:  # a user's program learns who it is from these (wire/rank_env.py)
        env |= {rank_env.JOB: order.job, rank_env.RESTART_COUNT: str(order.attempt),
                # NOTE: the bootstrap's own imports must not find the user's modules first (a `wire.py` of
                # theirs for megaheal's wire/): it starts on a safe path and then makes the script's own.
                "PYTHONSAFEPATH": "1", rank_env.SAFE_PATH_SET: "1"}
        if order.skip_steps:
            env[rank_env.SKIP_STEPS] = rank_env.encode_steps(order.skip_steps)
        else:
            env.pop(rank_env.SKIP_STEPS, None)
        if order.resume_step is not None:
            env[rank_env.RESUME_STEP] = str(order.resume_step)
        else:
            env.pop(rank_env.RESUME_STEP, None)
    return env


def replica_environment(order: StartOrder, replica: ReplicaStart, token: str, attempt_dir: Path,
                        address: str) -> dict[str, str]:
    """What the ranks of one replica group need (wire/ft_env.py): their group, the Lighthouse, this host's `address`
    (where a joining group fetches a peer's state from), and the run's key, in a file of mode 0600 under
    `attempt_dir` (the path only: an environment is readable through /proc)."""
    key_file = write_key(attempt_dir / "ft.key", ft_env.ft_key(token, order.job))
    return {ft_env.GROUP: str(replica.group), ft_env.LIGHTHOUSE: replica.lighthouse,
            ft_env.KEY_FILE: str(key_file), ft_env.ADDRESS: address, ft_env.AT_LEAST: str(replica.at_least)}


def torchrun_argv(o: StartOrder, endpoint: str, python: str, log_dir: Path) -> list[str]:
    """The host's torchrun agent for start order `o` (an argument list: nothing reaches a shell); `log_dir`: the
    ranks' log files (torchrun's --log-dir)."""
    argv = [python, "-m", "torch.distributed.run", "--nnodes", str(o.nnodes),
            "--node-rank", str(o.node_rank), "--nproc-per-node", str(o.nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id(o.job, o.attempt),
            # The first host holds the rendezvous store; the others only connect to it.
            "--rdzv-conf", f"is_host={'true' if o.node_rank == 0 else 'false'},join_timeout=120",
            # NOTE: no restarts inside torchrun: the healer decides (and may change the host set). A short
            # shutdown grace makes torchrun's failure report (how a rank died) come within a second or two.
            "--max-restarts", "0", "--monitor-interval", "0.2", "--shutdown-timeout", str(o.shutdown_timeout_s),
            "--log-dir", str(log_dir), "--redirects", "3", "--tee", "3"]
    if o.program is not None:
        # NOTE: the bootstrap makes an unchanged script visible (megaheal/rank/bootstrap.py), then runs it as is.
        return [*argv, "-m", "megaheal.rank.bootstrap", *(["-m"] if o.program.module else []), o.program.target,
                *o.program.args]
    assert o.config is not None
    argv += ["-m", "train", "--config", o.config, "--run-dir", o.run_dir]
    if o.resume:
        argv += ["--resume", o.resume]
    for item in o.overrides:
        argv += ["--set", item]
    return argv


def free_port() -> int:
    """A port the kernel had free a moment ago, for a first host's rendezvous store.
    NOTE: a small race (another process may take the port before torchrun binds it); a failed rendezvous shows as a
    failed start, which the healer handles like any other."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])

"""Orders a node agent takes from the healer, and what it answers: typed once, built as structs by the healer's
coordinator and decoded by the agent (no argument list, path or value from the healer reaches a shell). An order is
known by its id (healer/agent/order_book.py keeps them, across the agent's restarts), so a retried POST returns the
first one's state. Every order carries its healer's epoch (healer/incidents/epochs.py): an agent refuses an order of
an epoch below the highest it has taken (a 409 saying STALE_EPOCH), so a healer that a newer one took the job from
cannot act on it any more.

    {"kind": "start", "id": "job-7:start:n2@3", "epoch": 3, "job": ..., "attempt": 7, "nnodes": 2, "node_rank": 1, ...}
    {"kind": "stop", "id": ..., "epoch": 3, "attempt": 7, "grace_s": 0.5}
    {"kind": "signal", "id": ..., "epoch": 3, "attempt": 7, "rank": 3, "signal": "SIGKILL"}
    {"kind": "runbook", "id": ..., "epoch": 3, "runbook": "node-health", "timeout_s": 90}
    {"kind": "adopt", "id": ..., "epoch": 3, "job": ..., "attempt": 7, "node_rank": 1}
    {"kind": "evidence", "id": ..., "epoch": 3, "attempt": 7, "timeout_s": 10}
    {"kind": "workers", "id": ..., "epoch": 3}
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from wire.telemetry import Count, Finite, Name

OrderId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,199}\Z", description="an order id")]
Epoch = Annotated[int, Meta(ge=0, le=2**63 - 1, description="the ordering healer's epoch")]
"""Which healer sent an order: a newer healer of the job has a higher one (healer/incidents/epochs.py)."""
STALE_EPOCH = "stale epoch"
"""How an agent's refusal of an order from an older healer begins ("stale epoch 3 < 4", field "epoch"), what the
healer's client recognises it by (healer/launchers/agent_client.py: Fenced)."""
ENV_KEYS = frozenset({
    "GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT",
    "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_DISABLE", "NCCL_IB_TIMEOUT", "NCCL_IB_GID_INDEX", "NCCL_P2P_DISABLE",
    "NCCL_SHM_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_CROSS_NIC", "NCCL_ALGO", "NCCL_PROTO", "NCCL_BUFFSIZE",
    "NCCL_NTHREADS", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD",
    "NCCL_DEBUG", "NCCL_DEBUG_SUBSYS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE",
    "TORCH_DISTRIBUTED_DEBUG", "TORCH_CPP_LOG_LEVEL", "TORCH_SHOW_CPP_STACKTRACES",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS",
})
"""The variables a start order may set for its ranks, by name. NOTE: by name, not by prefix: `GLOO_`, `NCCL_`,
`TORCH_`, `CUDA_` also begin variables that load code (CUDA_INJECTION64_PATH, NCCL_NET_PLUGIN, NCCL_TUNER_PLUGIN),
and whoever holds the token would run theirs in every rank."""
EnvKey = Annotated[str, Meta(pattern=r"^[A-Z][A-Z0-9_]{0,100}\Z", description="a variable's name")]
"""Which names a start order may set is checked after (StartOrder), to name the ones refused."""
EnvValue = Annotated[str, Meta(pattern=r"^[^\x00]{0,4096}\Z", description="a value without NUL")]
Override = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*=[^\x00]{0,4096}\Z", description="KEY=VALUE")]
Endpoint = Annotated[str, Meta(pattern=r"^[A-Za-z0-9.:\[\]-]{1,253}:[0-9]{1,5}\Z", description="HOST:PORT")]
RunbookName = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_.-]{0,99}\Z", description="a shipped runbook's name")]
SIGNALS = ("SIGKILL", "SIGTERM", "SIGSTOP", "SIGCONT")
WorkerId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z", description="a warm worker's id")]


class WarmStart(Struct, frozen=True, kw_only=True):
    """This host's part of one generation of a warm pool (healer/agent/warm_host.py)."""

    control: Endpoint
    """The pool's store, where the coordinator writes each generation's plan."""
    formed_in: Count
    """The attempt that formed the pool (its workers' run id); a start with another one forms a new pool here."""
    assign: dict[WorkerId, Count] = {}
    """This host's workers that hold a rank in this generation -> global rank (those not running yet are started)."""
    local_rank: dict[WorkerId, Count] = {}
    standbys: Annotated[int, Meta(ge=0, le=64)] = 1
    """Idle workers this host keeps ready to take a rank."""


class ReplicaStart(Struct, frozen=True, kw_only=True):
    """This host's part as one replica group of a job that trains as several (train/ft/): a world of its own, joined
    to the others by the Lighthouse's per-step quorum. Its ranks are numbered over the whole job (`group` x the
    group's ranks + its own rank), and they meet the other groups with the run's key, which the agent derives from
    the run's token (wire/ft_env.py, ft_key)."""

    group: Annotated[int, Meta(ge=0, le=100_000)]
    """The group's index: a group started in a lost one's place takes its index (and so its ranks' numbers)."""
    lighthouse: Annotated[str, Meta(pattern=r"^http://[A-Za-z0-9.:\[\]-]{1,253}:[0-9]{1,5}\Z",
                                    description="http://HOST:PORT")]
    """The Lighthouse the groups agree on each step's quorum through (the healer runs it)."""
    at_least: Count = 0
    """The step the groups that train have reached: a group started with nothing trains in no quorum short of it (two
    groups started at once must not train on from step 0 by themselves while the others are busy)."""


_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
AbsPath = Annotated[str, Meta(pattern=r"^/[^\x00]{0,4095}\Z", description="an absolute path without NUL")]
Arg = Annotated[str, Meta(pattern=r"^[^\x00]{0,4096}\Z", description="an argument without NUL")]


class UserProgram(Struct, frozen=True, kw_only=True):
    """A user's training program, started on each rank as torchrun starts it (`megaheal run SCRIPT.py ARGS` or
    `megaheal run -m MODULE ARGS`), through megaheal/rank/bootstrap.py. Its words go into an argument list, never a
    shell."""

    module: bool = False
    """`target` is a module (python -m), not a script path."""
    target: Annotated[str, Meta(min_length=1, max_length=4096)]
    args: Annotated[list[Arg], Meta(max_length=4096)] = []
    cwd: AbsPath
    """Where the ranks run: the directory `megaheal run` was started in (a relative path in `args` means the same)."""

    def __post_init__(self) -> None:
        if self.module and not _MODULE.fullmatch(self.target):
            raise ValueError(f"program target {self.target!r} is not a module name (a.b.c)")
        if not self.module and (not self.target.startswith("/") or "\x00" in self.target):
            raise ValueError(f"program target {self.target!r} is not an absolute script path")


class StartOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="start"):
    """Start this host's part of an attempt: a torchrun agent with `node_rank` of `nnodes`, running megaheal's own
    trainer (`config`) or a user's program (`program`)."""

    id: OrderId
    epoch: Epoch
    job: Name
    attempt: Count
    nnodes: Annotated[int, Meta(ge=1, le=100_000)]
    node_rank: Count
    nproc_per_node: Annotated[int, Meta(ge=1, le=1024)]
    rdzv_endpoint: Endpoint | None = None
    """The attempt's rendezvous (the first host's); None on the first host: it picks a free port and says which."""
    config: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    """megaheal's trainer: its config's path; None with `program`."""
    program: UserProgram | None = None
    run_dir: Annotated[str, Meta(min_length=1, max_length=4096)]
    resume: Annotated[str, Meta(max_length=4096)] | None = "auto"
    overrides: list[Override] = []
    env: dict[EnvKey, EnvValue] = {}
    shutdown_timeout_s: Annotated[int, Meta(ge=0, le=300)] = 1
    warm: WarmStart | None = None
    """Start a generation of warm workers instead of a torchrun agent."""
    replica: ReplicaStart | None = None
    """Start this host's torchrun as one replica group of several (`nnodes` 1: the group is this host)."""
    skip_steps: Annotated[list[Count], Meta(max_length=4096)] = []
    """A program's steps to pass over after a rollback (MEGAHEAL_SKIP_STEPS; the trainer's are in `overrides`)."""
    resume_step: Count | None = None
    """A program's rollback: resume from its checkpoint of this step (MEGAHEAL_RESUME_STEP; the trainer's is
    `resume`)."""

    def __post_init__(self) -> None:
        if (self.config is None) == (self.program is None):
            raise ValueError("a start order runs either megaheal's trainer (config) or a user's program (program)")
        if refused := sorted(set(self.env) - ENV_KEYS):
            raise ValueError(f"env: an order may not set {', '.join(refused)} (the variables it may set: "
                             "wire/orders.py ENV_KEYS)")


class WorkersOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="workers"):
    """Say which warm workers run on this host, and which rank each holds now (the coordinator's view before a warm
    restart: survivors keep their ranks, a standby takes a dead one's)."""

    id: OrderId
    epoch: Epoch


class StopOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="stop"):
    id: OrderId
    epoch: Epoch
    attempt: Count
    """Stop this attempt, and nothing else: an order that named none stopped whatever ran, a later attempt too."""
    grace_s: Annotated[float, Meta(ge=0, le=3600)] = 30.0


class SignalOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="signal"):
    id: OrderId
    epoch: Epoch
    attempt: Count
    rank: Count
    signal: Literal["SIGKILL", "SIGTERM", "SIGSTOP", "SIGCONT"]


class RunbookOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="runbook"):
    id: OrderId
    epoch: Epoch
    runbook: RunbookName
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 90.0


class ReportOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="report"):
    """Send the batches here from now on (a healer that took the job over from one that died)."""

    id: OrderId
    epoch: Epoch
    healer_url: Annotated[str, Meta(pattern=r"^https?://[A-Za-z0-9.:\[\]-]{1,253}(:[0-9]{1,5})?\Z",
                                    description="an http(s) base URL")]


class AdoptOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="adopt"):
    """Take on this host's part of an attempt that runs without an agent (the one that started it died): its torchrun
    agent is found by the attempt's run id, its ranks under it, as if this agent had started them."""

    id: OrderId
    epoch: Epoch
    job: Name
    attempt: Count
    node_rank: Count


class EvidenceOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="evidence"):
    """Say what each rank of the attempt on this host is doing (state, phase, Python stack), touching none of them:
    a hang is looked at before anything is stopped."""

    id: OrderId
    epoch: Epoch
    attempt: Count
    timeout_s: Annotated[float, Meta(gt=0, le=120)] = 10.0
    """Per rank's stack dump."""


class ShutdownOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="shutdown"):
    """End the agent (its job is over; the ranks must already be stopped)."""

    id: OrderId
    epoch: Epoch


Order = (StartOrder | StopOrder | SignalOrder | RunbookOrder | ReportOrder | ShutdownOrder | AdoptOrder
         | EvidenceOrder | WorkersOrder)
decode_order = msgspec.json.Decoder(Order).decode


# ---- what the agent answers (OrderState.result, by the order's kind) ---------------------------------------------


class Started(Struct, frozen=True, kw_only=True):
    """A start: the rendezvous endpoint, and the torchrun agent's pid and start time (what a healer that takes over
    checks before it signals that pid); a warm generation has no torchrun agent (all None)."""

    attempt: Count
    rdzv_endpoint: str | None = None
    pid: int | None = None
    started: float | None = None


class Stopped(Struct, frozen=True, kw_only=True):
    stopped: Count | None = None
    """The attempt it stopped; None: it ran none (or another one)."""
    exit_code: int | None = None


class Signalled(Struct, frozen=True, kw_only=True):
    pid: int


class RunbookRun(Struct, frozen=True, kw_only=True):
    """`megaheal diagnose RUNBOOK --json` on the host: its exit status (None: it ran past its timeout) and output."""

    returncode: int | None
    stdout: str
    stderr: str
    timeout: bool = False


class Reporting(Struct, frozen=True, kw_only=True):
    healer_url: str


class Adopted(Struct, frozen=True, kw_only=True):
    adopted: Count
    pid: int | None = None


class Evidence(Struct, frozen=True, kw_only=True):
    """What each rank of the attempt on the host is doing (healer/agent/rank_evidence.py's payloads: free-form, for
    hang attribution and for display)."""

    node: str
    ranks: list[dict[str, Any]] = []
    took_s: float = 0.0


class Worker(Struct, frozen=True, kw_only=True):
    """One warm worker on the host."""

    id: WorkerId
    pid: int
    alive: bool
    rank: int | None = None
    """The rank it holds now (None: a standby)."""
    exit_code: int | None = None


class Workers(Struct, frozen=True, kw_only=True):
    node: str
    workers: list[Worker] = []


class ShuttingDown(Struct, frozen=True, kw_only=True):
    shutdown: bool = True


Result = Started | Stopped | Signalled | RunbookRun | Reporting | Adopted | Evidence | Workers | ShuttingDown
RESULT_OF: dict[type, type] = {StartOrder: Started, StopOrder: Stopped, SignalOrder: Signalled, RunbookOrder: RunbookRun,
                               ReportOrder: Reporting, AdoptOrder: Adopted, EvidenceOrder: Evidence,
                               WorkersOrder: Workers, ShutdownOrder: ShuttingDown}
"""The result each kind of order answers with."""


def result_of(order: Order, raw: Any) -> Any:
    """The agent's answer to `order` (as it came: JSON builtins) decoded into its result struct; a ValidationError
    names what does not fit."""
    return msgspec.convert(raw, RESULT_OF[type(order)])


class OrderState(Struct, kw_only=True):
    """An order as the agent holds it: the answer to POST /v1/orders and GET /v1/orders/{id}."""

    id: str
    kind: str
    status: Literal["accepted", "running", "done", "failed"] = "accepted"
    result: Any = None
    error: str | None = None
    received_at: Finite = 0.0
    finished_at: Finite | None = None

"""Orders a node agent takes from the healer (typed: no argument list, path or value from the healer reaches a
shell), and the book that makes every order idempotent: an order is known by its id, so a retried POST (the answer
was lost) returns the first one's state instead of starting a second attempt.

    {"kind": "start", "id": "job-7:start:n2", "job": ..., "attempt": 7, "nnodes": 2, "node_rank": 1, ...}
    {"kind": "stop", "id": ..., "attempt": 7, "grace_s": 0.5}
    {"kind": "signal", "id": ..., "attempt": 7, "rank": 3, "signal": "SIGKILL"}
    {"kind": "runbook", "id": ..., "runbook": "node-health", "timeout_s": 90}
    {"kind": "adopt", "id": ..., "job": ..., "attempt": 7, "node_rank": 1}
    {"kind": "evidence", "id": ..., "attempt": 7, "timeout_s": 10}
    {"kind": "workers", "id": ...}
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from exporters.schema import Count, Finite, Name

OrderId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,199}$", description="an order id")]
EnvKey = Annotated[str, Meta(pattern=r"^(GLOO|NCCL|TORCH|OMP|CUDA|MKL)_[A-Z0-9_]{1,64}$",
                             description="a GLOO_/NCCL_/TORCH_/OMP_/CUDA_/MKL_ variable")]
EnvValue = Annotated[str, Meta(pattern=r"^[^\x00]{0,4096}$", description="a value without NUL")]
Override = Annotated[str, Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*=[^\x00]{0,4096}$", description="KEY=VALUE")]
Endpoint = Annotated[str, Meta(pattern=r"^[A-Za-z0-9.:\[\]-]{1,253}:[0-9]{1,5}$", description="HOST:PORT")]
RunbookName = Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9_.-]{0,99}$", description="a shipped runbook's name")]
SIGNALS = ("SIGKILL", "SIGTERM", "SIGSTOP", "SIGCONT")
WorkerId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$", description="a warm worker's id")]


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


class StartOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="start"):
    """Start this host's part of an attempt: a torchrun agent with `node_rank` of `nnodes`."""

    id: OrderId
    job: Name
    attempt: Count
    nnodes: Annotated[int, Meta(ge=1, le=100_000)]
    node_rank: Count
    nproc_per_node: Annotated[int, Meta(ge=1, le=1024)]
    rdzv_endpoint: Endpoint | None = None
    """The attempt's rendezvous (the first host's); None on the first host: it picks a free port and says which."""
    config: Annotated[str, Meta(min_length=1, max_length=4096)]
    run_dir: Annotated[str, Meta(min_length=1, max_length=4096)]
    resume: Annotated[str, Meta(max_length=4096)] | None = "auto"
    overrides: list[Override] = []
    env: dict[EnvKey, EnvValue] = {}
    shutdown_timeout_s: Annotated[int, Meta(ge=0, le=300)] = 1
    warm: WarmStart | None = None
    """Start a generation of warm workers instead of a torchrun agent."""


class WorkersOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="workers"):
    """Say which warm workers run on this host, and which rank each holds now (the coordinator's view before a warm
    restart: survivors keep their ranks, a standby takes a dead one's)."""

    id: OrderId


class StopOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="stop"):
    id: OrderId
    attempt: Count | None = None
    """Stop this attempt (None: whatever runs)."""
    grace_s: Annotated[float, Meta(ge=0, le=3600)] = 30.0


class SignalOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="signal"):
    id: OrderId
    attempt: Count
    rank: Count
    signal: Literal["SIGKILL", "SIGTERM", "SIGSTOP", "SIGCONT"]


class RunbookOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="runbook"):
    id: OrderId
    runbook: RunbookName
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 90.0


class ReportOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="report"):
    """Send the batches here from now on (a healer that took the job over from one that died)."""

    id: OrderId
    healer_url: Annotated[str, Meta(pattern=r"^https?://[A-Za-z0-9.:\[\]-]{1,253}(:[0-9]{1,5})?$",
                                    description="an http(s) base URL")]


class AdoptOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="adopt"):
    """Take on this host's part of an attempt that runs without an agent (the one that started it died): its torchrun
    agent is found by the attempt's run id, its ranks under it, as if this agent had started them."""

    id: OrderId
    job: Name
    attempt: Count
    node_rank: Count


class EvidenceOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="evidence"):
    """Say what each rank of the attempt on this host is doing (state, phase, Python stack), touching none of them:
    a hang is looked at before anything is stopped."""

    id: OrderId
    attempt: Count
    timeout_s: Annotated[float, Meta(gt=0, le=120)] = 10.0
    """Per rank's stack dump."""


class ShutdownOrder(Struct, frozen=True, kw_only=True, tag_field="kind", tag="shutdown"):
    """End the agent (its job is over; the ranks must already be stopped)."""

    id: OrderId


Order = (StartOrder | StopOrder | SignalOrder | RunbookOrder | ReportOrder | ShutdownOrder | AdoptOrder
         | EvidenceOrder | WorkersOrder)
decode_order = msgspec.json.Decoder(Order).decode


class OrderState(Struct, kw_only=True):
    id: str
    kind: str
    status: Literal["accepted", "running", "done", "failed"] = "accepted"
    result: Any = None
    error: str | None = None
    received_at: Finite = 0.0
    finished_at: Finite | None = None


class Conflict(ValueError):
    """An order id already used for another order."""


class OrderBook:
    """Orders by id (the newest `keep`), carried out one after another on a worker thread."""

    def __init__(self, execute: Callable[[Order], Any], keep: int = 1000,
                 clock: Callable[[], float] = time.time) -> None:
        self._execute, self._keep, self._clock = execute, keep, clock
        self._orders: OrderedDict[str, tuple[Order, OrderState]] = OrderedDict()
        self._queue: list[str] = []
        self._lock = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="megaheal-agent-orders", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        self._thread.join(timeout=5)

    def submit(self, order: Order) -> tuple[OrderState, bool]:
        """The order's state, and whether it is new. Conflict when its id names another order."""
        with self._lock:
            known = self._orders.get(order.id)
            if known is not None:
                if known[0] != order:
                    raise Conflict(f"order id {order.id!r} is already used for another {known[1].kind} order")
                return known[1], False
            state = OrderState(id=order.id, kind=str(type(order).__struct_config__.tag), received_at=self._clock())
            self._orders[order.id] = (order, state)
            while len(self._orders) > self._keep:
                self._orders.popitem(last=False)
            self._queue.append(order.id)
            self._lock.notify_all()
            return state, True

    def get(self, order_id: str) -> OrderState | None:
        with self._lock:
            known = self._orders.get(order_id)
            return known[1] if known is not None else None

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    return
                order, state = self._orders[self._queue.pop(0)]
                state.status = "running"
            try:
                result = self._execute(order)
            except Exception as exc:  # noqa: BLE001 - NOTE: an order that fails is reported, never the agent's death
                with self._lock:
                    state.status, state.error, state.finished_at = "failed", f"{type(exc).__name__}: {exc}", self._clock()
                continue
            with self._lock:
                state.status, state.result, state.finished_at = "done", result, self._clock()

"""The healer's side of a node agent's API: orders with ids (a retry after a lost answer is the same order, so it is
never carried out twice), waiting for their result, and the agent's state. Every call has a timeout; an agent that
cannot be reached is an AgentUnreachable (transient: the host may come back)."""

from __future__ import annotations

import logging
import ssl
import time
from dataclasses import dataclass
from typing import Any, overload

import msgspec

from ground.httpclient import RequestFailed, request_json
from ground.tls import PeerTls
from healer.errors import HealerError
from wire.orders import (
    STALE_EPOCH,
    Adopted,
    AdoptOrder,
    Evidence,
    EvidenceOrder,
    Order,
    OrderState,
    Reporting,
    ReportOrder,
    Result,
    RunbookOrder,
    RunbookRun,
    ShutdownOrder,
    ShuttingDown,
    Signalled,
    SignalOrder,
    Started,
    StartOrder,
    StopOrder,
    Stopped,
    Workers,
    WorkersOrder,
    result_of,
)

log = logging.getLogger(__name__)


class AgentUnreachable(HealerError):
    """The node agent did not answer (down, partitioned, or busy past the timeout)."""


class OrderFailed(HealerError):
    """The node agent carried the order out and it failed; the message is the agent's."""


class Fenced(OrderFailed):
    """The agent refused the order for its stale epoch (wire/orders.py STALE_EPOCH): a newer healer drives the job,
    and this one must not act on it any more."""


class Fence:
    """Where a healer learns it was fenced off: the first Fenced any client holding it met. NOTE: orders go out on
    many threads whose failures are caught there as OrderFailed (a host taken as lost, a start that failed); the
    healer's loop looks here instead (Coordinator.fence)."""

    def __init__(self) -> None:
        self.by: Fenced | None = None

    def trip(self, exc: Fenced) -> None:
        if self.by is None:
            self.by = exc
            log.critical("FENCED: %s. A newer healer drives this job; this one stops acting on it", exc)

    def check(self) -> None:
        """Fenced when an agent refused one of this healer's orders for its epoch."""
        if self.by is not None:
            raise Fenced(str(self.by)) from self.by


@dataclass(slots=True)
class AgentClient:
    node: str
    url: str
    token: str
    timeout_s: float = 5.0
    attempts: int = 3
    """How often a call that got no answer is tried again (the same order id each time)."""
    tls: ssl.SSLContext | None = None
    """The healer's client context (ground/tls.py): the call goes over mutual TLS, to a peer whose certificate names
    host `node` (an agent at that address with another host's certificate is not reached)."""

    fence: Fence | None = None
    """Told when the agent refuses an order for its stale epoch (the coordinator's)."""

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        last: Exception | None = None
        for i in range(self.attempts):
            try:
                return request_json(method, f"{self.url}{path}", body,
                                    {"Authorization": f"Bearer {self.token}"}, self.timeout_s,
                                    PeerTls(self.tls, "host", self.node) if self.tls is not None else None)
            except RequestFailed as exc:
                if exc.permanent:
                    raise OrderFailed(f"agent {self.node}: {exc}") from exc
                last = exc
                time.sleep(0.2 * (i + 1))
        raise AgentUnreachable(f"agent {self.node} at {self.url}: {last}")

    def order(self, order: Order) -> OrderState:
        """Submit an order (its `id` makes it idempotent); the order's state as the agent took it. Fenced when the
        agent refuses its epoch (a newer healer drives the job)."""
        try:
            return self._state(self._call("POST", "/v1/orders", msgspec.to_builtins(order)))
        except OrderFailed as exc:
            # NOTE: known by the agent's words (its 409's error, quoted in the message), whatever the transport.
            if f'"{STALE_EPOCH} ' not in str(exc):
                raise
            raise self._fenced(f"{exc} (this healer's epoch {order.epoch})") from exc

    def _fenced(self, message: str) -> Fenced:
        fenced = Fenced(message)
        if self.fence is not None:
            self.fence.trip(fenced)
        return fenced

    def result(self, order: Order, timeout_s: float) -> Result:
        """Wait for the order to be carried out; its result, typed by the order's kind (wire/orders.py). OrderFailed
        with the agent's error when it failed, or when its answer does not fit the kind."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self._state(self._call("GET", f"/v1/orders/{order.id}"))
            if state.status == "done":
                try:
                    return result_of(order, state.result)  # type: ignore[no-any-return]
                except msgspec.ValidationError as exc:
                    raise OrderFailed(f"agent {self.node}: the answer to {state.kind} order {order.id}: {exc}") from exc
            if state.status == "failed" and (state.error or "").startswith(STALE_EPOCH):
                # A newer healer's order came while this one waited its turn on the agent.
                raise self._fenced(f"agent {self.node}: {state.kind} order {order.id}: {state.error}")
            if state.status == "failed":
                raise OrderFailed(f"agent {self.node}: {state.kind} order {order.id} failed: {state.error}")
            if time.monotonic() >= deadline:
                raise AgentUnreachable(f"agent {self.node}: order {order.id} still {state.status} after "
                                       f"{timeout_s:g} s")
            time.sleep(0.1)

    @overload
    def run(self, order: StartOrder, timeout_s: float) -> Started: ...

    @overload
    def run(self, order: StopOrder, timeout_s: float) -> Stopped: ...

    @overload
    def run(self, order: SignalOrder, timeout_s: float) -> Signalled: ...

    @overload
    def run(self, order: RunbookOrder, timeout_s: float) -> RunbookRun: ...

    @overload
    def run(self, order: ReportOrder, timeout_s: float) -> Reporting: ...

    @overload
    def run(self, order: AdoptOrder, timeout_s: float) -> Adopted: ...

    @overload
    def run(self, order: EvidenceOrder, timeout_s: float) -> Evidence: ...

    @overload
    def run(self, order: WorkersOrder, timeout_s: float) -> Workers: ...

    @overload
    def run(self, order: ShutdownOrder, timeout_s: float) -> ShuttingDown: ...

    def run(self, order: Order, timeout_s: float) -> Result:
        """Submit and wait: the order's result."""
        self.order(order)
        return self.result(order, timeout_s)

    def _state(self, raw: Any) -> OrderState:
        try:
            return msgspec.convert(raw, OrderState)
        except msgspec.ValidationError as exc:
            raise OrderFailed(f"agent {self.node}: not an order's state: {exc}") from exc

    def state(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/state"))

    def answers(self, timeout_s: float = 2.0, attempts: int = 1) -> bool:
        """Whether the agent answers a call now (its state), within `timeout_s` per try."""
        try:
            AgentClient(self.node, self.url, self.token, timeout_s, attempts, self.tls).state()
        except (AgentUnreachable, OrderFailed):
            return False
        return True

"""The healer's side of a node agent's API: orders with ids (a retry after a lost answer is the same order, so it is
never carried out twice), waiting for their result, and the agent's state. Every call has a timeout; an agent that
cannot be reached is an AgentUnreachable (transient: the host may come back)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from healer.errors import HealerError, SinkError
from healer.oncall.httpclient import request_json


class AgentUnreachable(HealerError):
    """The node agent did not answer (down, partitioned, or busy past the timeout)."""


class OrderFailed(HealerError):
    """The node agent carried the order out and it failed; the message is the agent's."""


@dataclass(slots=True)
class AgentClient:
    node: str
    url: str
    token: str
    timeout_s: float = 5.0
    attempts: int = 3
    """How often a call that got no answer is tried again (the same order id each time)."""

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        last: Exception | None = None
        for i in range(self.attempts):
            try:
                return request_json(method, f"{self.url}{path}", body,
                                    {"Authorization": f"Bearer {self.token}"}, self.timeout_s)
            except SinkError as exc:
                if exc.permanent:
                    raise OrderFailed(f"agent {self.node}: {exc}") from exc
                last = exc
                time.sleep(0.2 * (i + 1))
        raise AgentUnreachable(f"agent {self.node} at {self.url}: {last}")

    def order(self, body: dict[str, Any]) -> dict[str, Any]:
        """Submit an order (its `id` makes it idempotent); the order's state as the agent took it."""
        return dict(self._call("POST", "/v1/orders", body))

    def result(self, order_id: str, timeout_s: float) -> Any:
        """Wait for the order to be carried out; its result. OrderFailed with the agent's error when it failed."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = self._call("GET", f"/v1/orders/{order_id}")
            if state["status"] == "done":
                return state["result"]
            if state["status"] == "failed":
                raise OrderFailed(f"agent {self.node}: {state['kind']} order {order_id} failed: {state['error']}")
            if time.monotonic() >= deadline:
                raise AgentUnreachable(f"agent {self.node}: order {order_id} still {state['status']} after "
                                       f"{timeout_s:g} s")
            time.sleep(0.1)

    def run(self, body: dict[str, Any], timeout_s: float) -> Any:
        """Submit and wait: the order's result."""
        self.order(body)
        return self.result(body["id"], timeout_s)

    def state(self) -> dict[str, Any]:
        return dict(self._call("GET", "/v1/state"))

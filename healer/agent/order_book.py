"""The node agent's book of orders: every order by its id (the newest `keep`), carried out one after another on a
worker thread. An order whose id is known returns the first one's state instead of running twice."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from wire.orders import Order, OrderState


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

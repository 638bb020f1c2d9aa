"""The node agent's book of orders: every order by its id (the newest `keep`), carried out one after another on a
worker thread. An order whose id is known returns the first one's state instead of running twice; an order of an
epoch below the highest taken (its healer was fenced off by a newer one) is refused. With a directory, the book and
the epoch floor are kept there (healer/agent/order_log.py, epoch_floor.py) and outlive the agent."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from healer.agent.epoch_floor import EpochFloor
from healer.agent.order_log import OrderLog, digest
from wire.orders import STALE_EPOCH, Order, OrderState

log = logging.getLogger(__name__)


class Conflict(ValueError):
    """An order id already used for another order."""

    field = "id"
    """The order's field the refusal names (the API's 409)."""


class StaleEpoch(Conflict):
    """An order of an epoch below the highest taken: a newer healer drives the job."""

    field = "epoch"


class OrderBook:
    """Orders by id (the newest `keep`), carried out one after another on a worker thread."""

    def __init__(self, execute: Callable[[Order], Any], keep: int = 1000,
                 clock: Callable[[], float] = time.time, directory: Path | None = None) -> None:
        """`directory`: where the book and the epoch floor are kept (the agent's work directory, which must exist);
        None: in memory only."""
        self._execute, self._keep, self._clock = execute, keep, clock
        self._log = OrderLog(directory / "orders.jsonl", keep) if directory is not None else None
        self.floor = EpochFloor(directory / "epoch" if directory is not None else None)
        self._orders: OrderedDict[str, tuple[str, OrderState]] = OrderedDict()
        """id -> (the order's digest, its state)."""
        self._queued: dict[str, Order] = {}
        self._queue: list[str] = []
        self._lock = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="megaheal-agent-orders", daemon=True)
        for entry in self._log.load() if self._log is not None else []:
            self._orders[entry.state.id] = (entry.digest, entry.state)

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
        """The order's state, and whether it is new. StaleEpoch when its epoch is below the floor, Conflict when its
        id names another order. A new order is on disk (and its epoch the floor) before this returns."""
        with self._lock:
            self._check_epoch(order.epoch)
            known = self._orders.get(order.id)
            mine = digest(order)
            if known is not None:
                if known[0] != mine:
                    raise Conflict(f"order id {order.id!r} is already used for another {known[1].kind} order")
                return known[1], False
            self.floor.raise_to(order.epoch)
            state = OrderState(id=order.id, kind=str(type(order).__struct_config__.tag), received_at=self._clock())
            self._record(mine, state, durable=True)
            self._orders[order.id] = (mine, state)
            while len(self._orders) > self._keep:
                self._orders.popitem(last=False)
            self._queued[order.id] = order
            self._queue.append(order.id)
            self._lock.notify_all()
            return state, True

    def _check_epoch(self, epoch: int) -> None:
        if epoch < self.floor.epoch:
            raise StaleEpoch(f"{STALE_EPOCH} {epoch} < {self.floor.epoch}: a newer healer drives this host's job")

    def get(self, order_id: str) -> OrderState | None:
        with self._lock:
            known = self._orders.get(order_id)
            return known[1] if known is not None else None

    def _record(self, order_digest: str, state: OrderState, durable: bool = False) -> None:
        """Write the order's state to the book on disk. `durable`: an error is raised (an order is acknowledged only
        once it is on disk); else it is logged (a state change of an order already taken: the worker goes on)."""
        if self._log is None:
            return
        try:
            self._log.append(order_digest, state)
        except OSError:
            if durable:
                raise
            log.error("the state of order %s could not be written to %s", state.id, self._log.path, exc_info=True)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._stopped:
                    self._lock.wait()
                if self._stopped:
                    return
                order = self._queued.pop(self._queue.pop(0))
                order_digest, state = self._orders.get(order.id, (digest(order), OrderState(id=order.id, kind="?")))
                try:
                    # NOTE: a newer healer's order may have come while this one waited its turn.
                    self._check_epoch(order.epoch)
                except StaleEpoch as exc:
                    self._finish(order_digest, state, "failed", error=str(exc))
                    continue
                state.status = "running"
                self._record(order_digest, state)
            try:
                result = self._execute(order)
            except Exception as exc:  # noqa: BLE001 - NOTE: an order that fails is reported, never the agent's death
                with self._lock:
                    self._finish(order_digest, state, "failed", error=f"{type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self._finish(order_digest, state, "done", result=result)

    def _finish(self, order_digest: str, state: OrderState, status: str, result: Any = None,
                error: str | None = None) -> None:
        """Called with the lock held."""
        state.status, state.error, state.finished_at = status, error, self._clock()  # type: ignore[assignment]
        state.result = msgspec.to_builtins(result) if result is not None else None
        self._record(order_digest, state)

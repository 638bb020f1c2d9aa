"""The node agent's order book on disk and its epoch floor: an agent started again in the same work directory answers
a retried order with what became of it (never carrying it out twice), refuses an id reused for another order, and
refuses an order of a stale epoch; an order it was running when it died reads as failed."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from healer.agent.order_book import Conflict, OrderBook, StaleEpoch
from tests.support import wait_for
from wire.orders import Order, StopOrder, Stopped, WorkersOrder

pytestmark = pytest.mark.unit


class Executed:
    """The book's `execute`: records what it carried out; `hold` keeps an order running until set."""

    def __init__(self) -> None:
        self.orders: list[Order] = []
        self.hold = threading.Event()
        self.hold.set()

    def __call__(self, order: Order) -> Any:
        self.orders.append(order)
        self.hold.wait(10)
        return Stopped(stopped=getattr(order, "attempt", None))


def book(tmp_path: Path, executed: Executed, keep: int = 1000) -> OrderBook:
    b = OrderBook(executed, keep=keep, directory=tmp_path)
    b.start()
    return b


def stop(order_id: str = "j-3:stop:n1@1", epoch: int = 1, attempt: int = 3) -> StopOrder:
    return StopOrder(id=order_id, epoch=epoch, attempt=attempt, grace_s=0)


def done(b: OrderBook, order_id: str) -> Any:
    return wait_for(f"order {order_id} carried out",
                    lambda: (s := b.get(order_id)) is not None and s.status in ("done", "failed") and s, 10,
                    every_s=0.01)


def test_a_retried_order_after_the_agent_restarted_gets_its_recorded_state_and_is_not_carried_out_again(
        tmp_path: Path) -> None:
    first = Executed()
    old = book(tmp_path, first)
    old.submit(stop())
    assert done(old, "j-3:stop:n1@1").result == {"stopped": 3, "exit_code": None}
    old.stop()
    again = Executed()
    new = book(tmp_path, again)  # a replaced agent, in the same work directory
    state, is_new = new.submit(stop())
    assert not is_new and state.status == "done" and state.result == {"stopped": 3, "exit_code": None}
    with pytest.raises(Conflict, match="already used for another stop order") as refused:
        new.submit(stop(attempt=4))  # the same id for another order: still a 409
    assert refused.value.field == "id"
    new.stop()
    assert len(first.orders) == 1 and again.orders == []


def test_an_order_of_a_stale_epoch_is_refused_also_by_the_agent_after_a_restart(tmp_path: Path) -> None:
    executed = Executed()
    b = book(tmp_path, executed)
    b.submit(stop("a@2", epoch=2))
    done(b, "a@2")
    with pytest.raises(StaleEpoch, match=r"^stale epoch 1 < 2") as refused:
        b.submit(stop("b@1", epoch=1))
    assert refused.value.field == "epoch"
    b.submit(stop("c@5", epoch=5))  # a newer healer: its epoch becomes the floor
    assert json.loads((tmp_path / "epoch").read_text()) == {"epoch": 5}
    done(b, "c@5")
    b.stop()
    restarted = book(tmp_path, executed)
    with pytest.raises(StaleEpoch, match="stale epoch 2 < 5"):
        restarted.submit(stop("a@2", epoch=2))  # even an id it knows: its healer is fenced off
    restarted.stop()
    assert [o.id for o in executed.orders] == ["a@2", "c@5"]


def test_an_order_queued_behind_a_newer_healers_is_not_carried_out(tmp_path: Path) -> None:
    executed = Executed()
    executed.hold.clear()
    b = book(tmp_path, executed)
    b.submit(stop("busy@1", epoch=1))
    wait_for("the first order running", lambda: b.get("busy@1").status == "running", 10, every_s=0.01)
    b.submit(stop("queued@1", epoch=1, attempt=4))
    b.submit(WorkersOrder(id="w@2", epoch=2))
    executed.hold.set()
    assert done(b, "queued@1").error.startswith("stale epoch 1 < 2")
    assert done(b, "w@2").status == "done"
    b.stop()
    assert [o.id for o in executed.orders] == ["busy@1", "w@2"]


def test_an_order_running_when_the_agent_died_reads_as_failed(tmp_path: Path) -> None:
    executed = Executed()
    executed.hold.clear()
    b = book(tmp_path, executed)
    b.submit(stop("running@1"))
    wait_for("the order running", lambda: b.get("running@1").status == "running", 10, every_s=0.01)
    b.submit(stop("queued@1", attempt=4))
    # The agent dies here: the next one reads the book as it was left on disk.
    after = Executed()
    new = book(tmp_path, after)
    assert new.get("running@1").status == "failed"
    assert new.get("running@1").error == "the agent restarted while it ran"
    assert new.get("queued@1").error == "the agent restarted before it ran"
    state, is_new = new.submit(stop("running@1"))
    assert not is_new and state.status == "failed" and after.orders == []
    executed.hold.set()
    b.stop()
    new.stop()


def test_the_book_on_disk_keeps_the_newest_orders_only_and_skips_a_line_cut_short(tmp_path: Path) -> None:
    executed = Executed()
    b = book(tmp_path, executed, keep=3)
    for i in range(10):
        b.submit(stop(f"o{i}@1", attempt=i))
        done(b, f"o{i}@1")
    b.stop()
    lines = (tmp_path / "orders.jsonl").read_text().splitlines()
    assert len(lines) <= 2 * 3 + 1
    with (tmp_path / "orders.jsonl").open("a") as f:
        f.write('{"digest": "cut sh')  # the agent died while writing
    new = book(tmp_path, Executed(), keep=3)
    assert [new.get(f"o{i}@1") is not None for i in range(10)] == [False] * 7 + [True] * 3
    assert new.get("o9@1").result == {"stopped": 9, "exit_code": None}
    assert len((tmp_path / "orders.jsonl").read_text().splitlines()) == 3  # compacted when loaded
    new.stop()


def test_a_floor_that_cannot_be_read_stops_the_agent_from_starting(tmp_path: Path) -> None:
    (tmp_path / "epoch").write_text("not json")
    with pytest.raises(ValueError, match="epoch floor cannot be read"):
        OrderBook(Executed(), directory=tmp_path)

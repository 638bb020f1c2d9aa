"""The coordinator's side of fencing and take-over: its orders carry its epoch (in their ids too), a coordinator whose
fence tripped starts nothing, stops nothing and writes nothing to the run's journal, and a take-over asks a host that
missed its state check again before it decides, adopting on a majority."""

from __future__ import annotations

from pathlib import Path

import pytest

from healer.launchers.agent_client import AgentClient, Fenced
from healer.launchers.coordinator import Coordinator
from healer.launchers.takeover_vote import HostSays
from healer.observe.processes import ProcessView
from wire import journal
from wire.run_paths import RunPaths

pytestmark = pytest.mark.unit
TOKEN = "t" * 16


def coordinator(run_dir: Path, epoch: int = 3) -> Coordinator:
    return Coordinator(Coordinator.Config(job="j", config="configs/demo.yaml", run_dir=run_dir), ProcessView(), TOKEN,
                       epoch=epoch)


def test_its_orders_carry_its_epoch(tmp_path: Path) -> None:
    c = coordinator(tmp_path)
    order = c.start_order(2, ("n1", "n2"), 1, "h:1", "auto", ())
    assert (order.epoch, order.id) == (3, "j-2:start:n2@3")
    with pytest.raises(ValueError, match="epoch must be >= 0"):
        coordinator(tmp_path, epoch=-1)


def test_a_fenced_coordinator_starts_and_stops_nothing_and_leaves_the_journal_alone(tmp_path: Path) -> None:
    c = coordinator(tmp_path)
    c.agents["n1"] = AgentClient("n1", "http://127.0.0.1:9", TOKEN)  # nothing listens: no order may be tried
    c.fence.trip(Fenced("agent n1: stale epoch 3 < 4"))
    with pytest.raises(Fenced, match="stale epoch 3 < 4"):
        c.start(TOKEN, ("n1",))
    with pytest.raises(Fenced):
        c.take_over(TOKEN)
    c.stop(TOKEN)
    assert not RunPaths(tmp_path).journal.exists()


def test_a_take_over_asks_a_host_that_missed_its_check_again_and_adopts_on_a_majority(tmp_path: Path) -> None:
    journal.append(RunPaths(tmp_path).journal, journal.Start(job="j", attempt=4, at=1.0, nodes=["n1", "n2", "n3"]))
    c = coordinator(tmp_path)
    c.ASK_AGAIN_S = (0.0, 0.0)
    answers = {"n1": [HostSays.RUNS], "n2": [HostSays.UNREACHED, HostSays.RUNS], "n3": [HostSays.UNREACHED] * 3}
    asked: list[str] = []

    def says(node: str, attempt: int) -> HostSays:
        asked.append(node)
        return answers[node].pop(0)

    c._host_says = says  # type: ignore[method-assign]
    assert c.take_over(TOKEN) == (True, ())
    assert c.attempt is not None and c.attempt.number == 4
    assert sorted(asked) == ["n1", "n2", "n2", "n3", "n3"]  # asked again until the majority was there

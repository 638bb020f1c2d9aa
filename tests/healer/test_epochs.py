"""Healer epochs in the database (healer/incidents/epochs.py), on SQLite and PostgreSQL: each claim is one above every
epoch before it, claims racing on one job all get epochs of their own, and a claim that keeps losing its race is an
error naming the job; the healer's loop stops acting on the job once a newer healer claimed its epoch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import sqlalchemy as sa

from healer.incidents import db, epochs
from healer.incidents.models import HealerEpoch
from healer.launchers.agent_client import Fenced
from healer.launchers.coordinator import Coordinator
from healer.observe.processes import ProcessView
from healer.runner.loop import SelfHealingJob

pytestmark = pytest.mark.services


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    yield engine
    engine.dispose()


def test_each_claim_is_one_above_every_epoch_before_it(engine: sa.Engine) -> None:
    assert epochs.current(engine, "a") is None
    assert [epochs.claim(engine, "a", "healer-1"), epochs.claim(engine, "a", "healer-2")] == [1, 2]
    # Another job's first healer is above them too: an agent's floor outlives the name of the job it served.
    assert epochs.claim(engine, "b", "healer-3") == 3
    assert epochs.claim(engine, "a", "healer-4") == 4
    assert (epochs.current(engine, "a"), epochs.current(engine, "b")) == (4, 3)
    with engine.connect() as conn:
        assert conn.execute(sa.select(HealerEpoch.claimed_by).where(HealerEpoch.job == "a")).scalar() == "healer-4"


def test_claims_racing_on_one_job_all_get_an_epoch_of_their_own(engine: sa.Engine) -> None:
    got: list[int] = []
    errors: list[BaseException] = []

    def claim(i: int) -> None:
        try:
            for _ in range(5):
                got.append(epochs.claim(engine, "raced", f"healer-{i}", tries=100))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert sorted(got) == list(range(1, 21)) and epochs.current(engine, "raced") == 20


def test_a_claim_that_keeps_losing_its_race_is_an_error_naming_the_job(engine: sa.Engine,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert epochs.claim(engine, "j", "first") == 1
    real_update = epochs.update
    # Another healer's claim lands between this one's read and its conditional UPDATE, every time.
    monkeypatch.setattr(epochs, "update", lambda table: real_update(table).where(HealerEpoch.epoch == -1))
    with pytest.raises(epochs.EpochRace, match="job j: 3 claims of its healer epoch were all lost"):
        epochs.claim(engine, "j", "second", tries=3)
    assert epochs.current(engine, "j") == 1


def test_the_loop_stops_acting_once_a_newer_healer_claimed_the_jobs_epoch(engine: sa.Engine, tmp_path: Path) -> None:
    older = Coordinator(Coordinator.Config(job="j", config="configs/demo.yaml", run_dir=tmp_path), ProcessView(),
                        "t" * 16, epoch=epochs.claim(engine, "j", "older"))
    loop = SimpleNamespace(healer=SimpleNamespace(store=SimpleNamespace(engine=engine)), job="j", sup=older,
                           _epoch_read_at=-10.0)
    SelfHealingJob._check_epoch(loop)  # type: ignore[arg-type]  # it is the newest: nothing happens
    assert older.fence.by is None
    epochs.claim(engine, "j", "newer")
    loop._epoch_read_at = -10.0
    with pytest.raises(Fenced, match="a newer healer claimed epoch 2 of job j"):
        SelfHealingJob._check_epoch(loop)  # type: ignore[arg-type]
    with pytest.raises(Fenced):
        older.start("t" * 16, ("n1",))

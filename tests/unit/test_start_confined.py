"""A start order points its ranks inside the run directory its agent was started for (healer/agent/confine.py): its
run directory, the checkpoint it resumes from and its config; anything else is refused, naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from healer.agent.confine import OutsideRunDir, check_start
from wire.orders import StartOrder, UserProgram

pytestmark = pytest.mark.unit


def start(run_dir: Path, **kw: object) -> StartOrder:
    fields: dict[str, object] = {"config": "configs/demo.yaml"} | kw
    return StartOrder(id="j-0:start:n1@1", epoch=1, job="j", attempt=0, nnodes=1, node_rank=0, nproc_per_node=1,
                      run_dir=str(run_dir), **fields)  # type: ignore[arg-type]


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    run, checkout = tmp_path / "runs" / "r1", tmp_path / "checkout"
    (checkout / "configs").mkdir(parents=True)
    (run / "checkpoints" / "step-5").mkdir(parents=True)
    return run, checkout


def test_it_takes_what_lies_in_the_run_directory_and_the_shipped_configs(dirs: tuple[Path, Path]) -> None:
    run, checkout = dirs
    check_start(start(run), run, checkout)
    check_start(start(run, resume=str(run / "checkpoints" / "step-5")), run, checkout)
    for word in ("auto", "none", None):
        check_start(start(run, resume=word), run, checkout)
    check_start(start(run, config=str(run / "launcher" / "config.yaml")), run, checkout)  # a copy (build.py)
    program = UserProgram(target="/home/u/train.py", cwd="/home/u")  # the user's own: left free
    check_start(start(run, config=None, program=program, resume=None), run, checkout)


@pytest.mark.parametrize("field, order", [
    ("run_dir", lambda run: start(run.parent / "r2")),
    ("run_dir", lambda run: start(run / ".." / "r2")),
    ("run_dir", lambda run: start(run.parent / "r1-and-more")),
    ("resume", lambda run: start(run, resume="/tmp/elsewhere/step-5")),
    ("resume", lambda run: start(run, resume=str(run / ".." / "r2" / "checkpoints" / "step-5"))),
    ("config", lambda run: start(run, config="/etc/passwd")),
    ("config", lambda run: start(run, config="../outside.yaml")),
])
def test_it_refuses_a_path_outside_naming_the_field(dirs: tuple[Path, Path], field: str, order: object) -> None:
    run, checkout = dirs
    with pytest.raises(OutsideRunDir, match=f"^{field}: ") as refused:
        check_start(order(run), run, checkout)  # type: ignore[operator]
    assert refused.value.field == field


def test_a_link_out_of_the_run_directory_does_not_lead_out(dirs: tuple[Path, Path], tmp_path: Path) -> None:
    run, checkout = dirs
    (tmp_path / "elsewhere").mkdir()
    (run / "checkpoints" / "sneaky").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OutsideRunDir, match="^resume: "):
        check_start(start(run, resume=str(run / "checkpoints" / "sneaky")), run, checkout)

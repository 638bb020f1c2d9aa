"""A user's program in torchrun's shape: `megaheal run`'s arguments, the start order that carries the program to
a host (checked when decoded), and the torchrun command a node agent makes of it (an argument list)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

from healer.agent.rank_start import HostPlaces, rank_environment, torchrun_argv
from healer.launchers.coordinator_base import skipped_steps
from healer.runner.run import ProgramLaunch
from megaheal.cli import _program_launch, app
from wire import rank_env
from wire.orders import StartOrder, UserProgram

pytestmark = pytest.mark.unit


def order(program: UserProgram, **kw: object) -> StartOrder:
    return StartOrder(id="mine-2:start:n1", epoch=1, job="mine", attempt=2, nnodes=2, node_rank=0, nproc_per_node=4,
                      program=program, run_dir="/runs/r", **kw)


def test_a_program_becomes_torchruns_command_through_the_bootstrap_and_nothing_else_of_the_trainers() -> None:
    script = order(UserProgram(target="/home/u/train.py", args=["--lr", "3e-4", "; rm -rf /"], cwd="/home/u"))
    argv = torchrun_argv(script, "h:29500", "/venv/bin/python", Path("/logs"))
    assert argv[:3] == ["/venv/bin/python", "-m", "torch.distributed.run"]
    assert argv[argv.index("--max-restarts") + 1] == "0"  # the healer restarts, not torchrun
    assert argv[-6:] == ["-m", "megaheal.rank.bootstrap", "/home/u/train.py", "--lr", "3e-4", "; rm -rf /"]
    assert "--config" not in argv and "--set" not in argv
    module = order(UserProgram(module=True, target="pkg.train", args=["x"], cwd="/home/u"))
    assert torchrun_argv(module, "h:1", "py", Path("/l"))[-5:] == ["-m", "megaheal.rank.bootstrap", "-m", "pkg.train",
                                                                   "x"]


def test_a_programs_ranks_are_told_who_they_are_and_an_older_orders_skips_and_resume_do_not_linger(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The agent's own environment is what the ranks inherit: a step to skip or resume from that it holds (an agent
    # started from a rank's shell, say) must not reach an attempt that was given none.
    monkeypatch.setenv(rank_env.SKIP_STEPS, "5")
    monkeypatch.setenv(rank_env.RESUME_STEP, "4")
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    host = HostPlaces(node="n1", scratch_dir=tmp_path / "scratch", socket_path="/s/ranks.sock",
                      extra_env={"EXTRA": "1"})
    program = UserProgram(target="/home/u/train.py", cwd="/home/u")
    env = rank_environment(order(program, env={"OMP_NUM_THREADS": "4"}), host, tmp_path / "phase")
    assert (env[rank_env.NODE], env[rank_env.JOB], env[rank_env.ATTEMPT], env[rank_env.RESTART_COUNT]) == \
        ("n1", "mine", "2", "2")
    assert env["TMPDIR"] == str((tmp_path / "scratch").absolute()) and env["MEGAHEAL_SIDECAR_SOCKET"] == "/s/ranks.sock"
    assert env["OMP_NUM_THREADS"] == "4" and env["EXTRA"] == "1" and env["PYTHONSAFEPATH"] == "1"
    assert rank_env.SKIP_STEPS not in env and rank_env.RESUME_STEP not in env
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"  # the flight recorder on: what a hang's evidence reads
    told = rank_environment(order(program, skip_steps=[7, 8], resume_step=6), host, tmp_path / "phase")
    assert rank_env.decode_steps(told) == {7, 8} and told[rank_env.RESUME_STEP] == "6"
    # A host that sizes NCCL's older buffer itself keeps its own size, with no second one beside it.
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "10")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    assert "TORCH_FR_BUFFER_SIZE" not in rank_environment(order(program), host, tmp_path / "phase")


@pytest.mark.parametrize("body, error", [
    ({"program": {"target": "train.py", "cwd": "/u"}}, "not an absolute script path"),
    ({"program": {"module": True, "target": "os; rm", "cwd": "/u"}}, "not a module name"),
    ({"program": {"target": "/u/t.py", "cwd": "relative"}}, r"matching regex .* at `\$.program.cwd`"),
    ({"program": {"target": "/u/t.py", "cwd": "/u"}, "config": "c.yaml"}, "either megaheal's trainer"),
    ({}, "either megaheal's trainer"),
])
def test_a_start_order_with_a_bad_program_is_refused_naming_what_is_wrong(body: dict, error: str) -> None:
    base = {"kind": "start", "id": "j-0:start:n1", "epoch": 1, "job": "j", "attempt": 0, "nnodes": 1, "node_rank": 0,
            "nproc_per_node": 1, "run_dir": "/r"}
    with pytest.raises(msgspec.ValidationError, match=error):
        msgspec.json.decode(msgspec.json.encode(base | body), type=StartOrder)


def test_megaheal_runs_arguments_are_torchruns_and_the_scripts_own_pass_through(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    launch = _program_launch(["train.py", "--config", "mine.yaml", "-m"], False, 4, "1:3", None)
    assert launch is not None and launch.program.args == ["--config", "mine.yaml", "-m"]
    assert launch.program.target == str(tmp_path / "train.py") and launch.program.cwd == str(tmp_path)
    assert (launch.nproc_per_node, launch.nnodes, launch.min_nodes) == (4, 3, 1)
    assert ProgramLaunch.parse_nnodes("2") == (2, None)
    for args, error in [((["missing.py"], False, 1, None, None), "no script at missing.py"),
                        ((["train.py"], False, 1, None, "c.yaml"), "--config is megaheal's own trainer"),
                        (([], True, 1, None, None), "give SCRIPT.py or -m MODULE"),
                        ((["train.py"], False, 1, "3:2", None), "--nnodes must be"),
                        ((["train.py"], False, 0, None, None), "--nproc-per-node must be >= 1"),
                        (([], False, 2, None, None), "give SCRIPT.py or -m MODULE")]:
        with pytest.raises(ValueError, match=error):
            _program_launch(*args)
    result = CliRunner().invoke(app, ["run", "--config", "c.yaml", "train.py"])
    assert result.exit_code == 2 and "--config is megaheal's own trainer" in result.output


def test_a_rollbacks_skipped_steps_reach_a_program_from_the_attempts_items() -> None:
    assert skipped_steps(("job=mine", "skip_steps=[8,9]")) == [8, 9] and skipped_steps(("job=mine",)) == []


def test_a_programs_nonfinite_rule_waits_for_every_hosts_first_bad_step_and_the_trainers_does_not() -> None:
    from healer.decide.rules import DEFAULT_RULES, load_rule_set
    from healer.detect.nonfinite import PROGRAM_SETTLE
    from healer.runner.build import _settled_nonfinite

    shipped = load_rule_set([DEFAULT_RULES])
    settled = _settled_nonfinite(shipped)
    settle = {r.name: r.condition.params.settle for r in (*shipped.rules, *settled.rules)
              if getattr(r.condition, "detector", None) == "nonfinite"}
    assert [r.condition.params.settle for r in shipped.rules if r.name == "nonfinite"] == [timedelta(0)]
    assert settle == {"nonfinite": PROGRAM_SETTLE}
    assert [r.name for r in settled.rules] == [r.name for r in shipped.rules] and settled.limits == shipped.limits

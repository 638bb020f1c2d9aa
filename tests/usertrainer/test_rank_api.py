"""megaheal.rank, the public API a user's trainer calls, and the bootstrap that runs an unchanged script: what reaches
a node's socket (a real datagram socket standing in for the sidecar), what a script sees of torchrun's contract, and
that nothing raises into the training loop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import megaheal.rank as mh
from megaheal.rank.reporter import Reporter
from wire import rank_env
from wire.telemetry import Event, Hello, StepRecord, decode

pytestmark = pytest.mark.unit


@pytest.fixture()
def node_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, dict[str, str]]]:
    """A bound datagram socket where the sidecar's would be, and the environment a node agent gives rank 1 of 2."""
    path = tmp_path / "s.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    env = {rank_env.SIDECAR_SOCKET: str(path), rank_env.JOB: "mine", rank_env.NODE: "n1", "RANK": "1",
           "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    yield sock, env
    sock.close()


def received(sock: socket.socket) -> list[object]:
    out = []
    sock.settimeout(0.5)
    try:
        while True:
            out.append(decode(sock.recv(65536)))
    except TimeoutError:
        return out


def test_watch_and_step_send_each_step_with_its_phases_loss_and_tokens(node_socket, monkeypatch) -> None:
    sock, env = node_socket
    reporter = Reporter.from_env(env)
    assert reporter is not None
    monkeypatch.setattr(mh, "_reporter", reporter)
    monkeypatch.setattr(mh, "_looked", True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = mh.watch(model, opt)
    try:
        for step in range(3):
            loss = model(torch.randn(2, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with mh.phase("checkpoint"):
                pass
            mh.step(loss=loss, tokens=2)
        mh.step(7, loss=float("nan"))
    finally:
        handle.remove()
        mh._watches.clear()
    records = received(sock)
    assert isinstance(records[0], Hello) and records[0].body.node == "n1" and records[0].rank == 1
    steps = [r.body for r in records if isinstance(r, StepRecord)]
    assert [s.step for s in steps] == [0, 1, 2, 7] and all(r.job == "mine" for r in records)
    first = steps[0]
    assert {"forward_backward", "optimizer", "checkpoint"} <= set(first.phases) and first.loss is not None
    assert first.tokens_per_second is not None and first.tokens_per_second > 0
    assert "data_wait" in steps[1].phases  # from one optimizer step to the next forward
    assert steps[3].loss != steps[3].loss and steps[3].grad_norm is None  # NaN as it is; what is not told is absent


def test_no_call_raises_into_training_and_outside_megaheal_every_call_does_nothing(node_socket, monkeypatch,
                                                                                   caplog) -> None:
    _, env = node_socket
    monkeypatch.setattr(mh, "_reporter", Reporter.from_env(env))
    monkeypatch.setattr(mh, "_looked", True)
    assert mh.step(loss="not a number") is None  # a bad value: logged once, dropped
    assert "megaheal.rank.step failed" in caplog.text
    assert mh.enabled()
    monkeypatch.setattr(mh, "_reporter", None)
    assert not mh.enabled() and mh.watch(torch.nn.Linear(1, 1)) is None and mh.step(loss=1.0) is None
    for name in ("RANK", rank_env.JOB):
        assert Reporter.from_env({k: v for k, v in env.items() if k != name}) is None


def test_skip_steps_and_restart_count_read_what_the_agent_set(monkeypatch) -> None:
    monkeypatch.setenv(rank_env.SKIP_STEPS, "9,8")
    monkeypatch.setenv(rank_env.RESTART_COUNT, "2")
    assert mh.skip_steps() == {8, 9} and mh.restart_count() == 2
    monkeypatch.setenv(rank_env.SKIP_STEPS, "8,x")
    with pytest.raises(ValueError, match="MEGAHEAL_SKIP_STEPS='8,x': expected integers"):
        mh.skip_steps()


SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "main", __name__, "path0", sys.path[0] == os.path.dirname(os.path.abspath(__file__)))
print("restart", os.environ.get("TORCHELASTIC_RESTART_COUNT"))
if sys.argv[1] == "raise":
    raise RuntimeError("the script's own error")
sys.exit(int(sys.argv[1]))
"""


def bootstrap(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "user.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "megaheal.rank.bootstrap", str(script), *args],
                          env={**os.environ, **env, rank_env.RESTART_COUNT: "3"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_bootstrap_runs_a_script_as_python_would_with_torchruns_restart_count(node_socket, tmp_path) -> None:
    sock, env = node_socket
    done = bootstrap(tmp_path, env, "5", "--flag")
    assert done.returncode == 5, done.stderr
    assert "argv ['5', '--flag'] main __main__ path0 True" in done.stdout and "restart 3" in done.stdout
    failed = bootstrap(tmp_path, env, "raise")
    assert failed.returncode == 1 and "RuntimeError: the script's own error" in failed.stderr
    events = [r.body for r in received(sock) if isinstance(r, Event)]
    assert [(e.name, e.fields["type"]) for e in events] == [("exception", "RuntimeError")]
    usage = subprocess.run([sys.executable, "-m", "megaheal.rank.bootstrap"], capture_output=True, text=True,
                           timeout=60, check=False)
    assert usage.returncode == 2 and "usage:" in usage.stderr


def test_a_step_with_only_its_number_passes_the_sidecar_with_nothing_made_up() -> None:
    from exporters.heartbeat import rank_summary
    from exporters.ranks import RankState
    from wire.telemetry import build_record, encode

    record = decode(encode(build_record("step", "mine", 0, 1, 0, {"step": 41, "time": 1.0, "step_seconds": 1.0})))
    assert isinstance(record, StepRecord)
    entry = rank_summary(RankState(job="mine", rank=0, pid=1, last_step=record.body))
    assert (entry.step, entry.loss, entry.grad_norm, entry.nonfinite, entry.phases, entry.mfu) == (41, None, None, {},
                                                                                                  {}, None)


def test_a_users_module_named_as_one_of_megaheals_does_not_break_the_bootstrap(node_socket, tmp_path) -> None:
    # The agent starts a program's ranks on a safe path (PYTHONSAFEPATH): the bootstrap's imports do not see the
    # user's directory; their script then does, first, as under `python SCRIPT`.
    _, env = node_socket
    (tmp_path / "exporters.py").write_text("raise ImportError('the user exporters module was imported')\n")
    (tmp_path / "helper.py").write_text("NAME = 'mine'\n")
    (tmp_path / "user.py").write_text("import os, helper\nprint('helper', helper.NAME, os.environ.get('PYTHONSAFEPATH'))\n")
    done = subprocess.run([sys.executable, "-m", "megaheal.rank.bootstrap", str(tmp_path / "user.py")],
                          env={**os.environ, **env, "PYTHONSAFEPATH": "1", rank_env.SAFE_PATH_SET: "1"},
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "helper mine None" in done.stdout, done.stderr[-2000:]
    # Without the safe path the user's module stands in for megaheal's: why the agent sets it.
    shadowed = subprocess.run([sys.executable, "-m", "megaheal.rank.bootstrap", str(tmp_path / "user.py")],
                              env={**os.environ, **env}, cwd=tmp_path, capture_output=True, text=True, timeout=60,
                              check=False)
    assert shadowed.returncode != 0 and "the user exporters module was imported" in shadowed.stderr

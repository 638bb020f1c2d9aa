"""The node agent keeps its eyes open: a look at the host's ranks that raises is logged and the next one goes on, a
loop thread that dies anyway is said in /healthz and started again, and an agent left with neither its healer nor
a rank exits by itself, saying why."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from healer.agent.node import NodeAgent
from healer.compose_agent import node_agent
from tests.conftest import REPO
from tests.support import wait_for

pytestmark = pytest.mark.services

TOKEN = "agent-survives-token-0123456789"


class _Attempt:
    """A host's part of an attempt whose looks fail as a real one's did: the first with the FileNotFoundError of a
    rank's phase file removed under it, a later one with what ends a thread whatever it catches."""

    attempt = 0
    ended = False

    def __init__(self, fail_with: list[BaseException | None]) -> None:
        self.fail_with, self.looks = fail_with, 0
        self.exits: dict[int, Any] = {}

    def poll(self) -> None:
        self.looks += 1
        error = self.fail_with.pop(0) if self.fail_with else None
        if error is not None:
            raise error

    def report(self) -> None:
        return None

    def wait_for_exit(self, timeout: float) -> None:
        time.sleep(timeout)


@pytest.fixture
def agent(tmp_path: Path) -> Any:
    node = node_agent(NodeAgent.Config(node="n1", token=TOKEN, work_dir=tmp_path / "agent", scratch_dir=tmp_path / "tmp",
                                      socket_path=str(tmp_path / "r.sock"), cwd=REPO, poll_interval_s=0.02,
                                      orphan_exit_s=0), nvml=None)
    node.start()
    yield node
    node.stop()


def _health(node: NodeAgent) -> tuple[int, dict[str, Any]]:
    answer = httpx.get(f"{node.url}/healthz", timeout=5)
    return answer.status_code, answer.json()


def test_a_look_that_raises_is_logged_and_the_agent_goes_on_looking(agent: NodeAgent, caplog) -> None:
    gone = FileNotFoundError(2, "No such file or directory", "/scratch/megaheal-phase/j/0/4242.phase")
    attempt = _Attempt([gone])
    agent.attempt = attempt  # type: ignore[assignment]
    wait_for("ten more looks after the failed one", lambda: attempt.looks > 10, 10)
    assert agent.poll_failures == 1 and agent.threads()["poll"]
    assert any("a look at the host's ranks failed" in r.message and r.exc_info for r in caplog.records)
    assert _health(agent)[1]["status"] == "ok"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death it is about
def test_a_loop_thread_that_dies_is_said_in_healthz_and_started_again(agent: NodeAgent) -> None:
    attempt = _Attempt([SystemExit("a thread's end, not an Exception")])
    agent.attempt = attempt  # type: ignore[assignment]
    wait_for("the poll thread to die", lambda: not agent.threads()["poll"], 10)
    status, state = _health(agent)
    assert status == 503 and state["status"] == "degraded" and state["dead_threads"] == ["poll"]
    agent.batch(0, time.time())  # each heartbeat batch looks at the agent's threads
    assert agent.thread_restarts == 1
    looks = attempt.looks
    wait_for("the restarted poll thread to look again", lambda: attempt.looks > looks + 5, 10)
    assert agent.health()["status"] == "ok"


def test_an_agent_with_no_healer_and_no_ranks_exits_by_itself_saying_why(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    started = time.monotonic()
    # A healer URL nobody answers at: the agent of a `megaheal run` that was SIGKILLed.
    proc = subprocess.run(
        [sys.executable, "-m", "megaheal", "agent", "--token-file", str(token), "--work-dir", str(tmp_path / "w"),
         "--node", "n9", "--healer-url", "http://127.0.0.1:9/", "--orphan-exit-s", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agent n9 exits: nothing heard from the healer for" in proc.stderr
    assert "and no rank runs here" in proc.stderr
    assert time.monotonic() - started < 100

"""The local launcher's agents as separate processes: a healer that takes a run over and finds an agent alive but not
answering (frozen here with SIGSTOP; under load, starved) ends it before it starts the host's next one, so no host
ever has two agents; one that answers is kept as it is."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from ground import procfs
from healer.launchers.agent_client import AgentClient
from healer.launchers.local_agents import LocalAgents
from healer.launchers.run_token import write_token
from tests.conftest import REPO

pytestmark = pytest.mark.services


def _agents(run_dir: Path) -> LocalAgents:
    # healer_url: nobody listens there; the agents keep their batches until a healer does.
    return LocalAgents(run_dir=run_dir, healer_url="https://127.0.0.1:9", token_file=run_dir / "token", cwd=REPO)


def test_a_take_over_kills_a_frozen_agent_before_it_starts_the_hosts_next_one_and_keeps_one_that_answers(
        tmp_path: Path) -> None:
    token = write_token(tmp_path / "token")
    first = _agents(tmp_path)
    first.start(["n1", "n2"])
    frozen = first.agents["n1"].process
    kept = first.agents["n2"].process
    assert frozen is not None and kept is not None
    second = _agents(tmp_path)
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        urls = second.adopt(["n1", "n2"])
        frozen.wait(timeout=5)  # killed by the take-over (a frozen process ends only on SIGKILL)
        assert frozen.returncode == -signal.SIGKILL
        assert procfs.alive(kept.pid) and urls["n2"] == first.agents["n2"].url
        new_n1 = AgentClient("n1", urls["n1"], token, tls=second.healer_tls()).state()
        assert new_n1["node"] == "n1" and new_n1["pid"] not in (frozen.pid, kept.pid)
    finally:
        for proc in (frozen, kept):
            if proc.poll() is None:
                proc.kill()
        second.stop()
        first.stop()
    kept.wait(timeout=5)

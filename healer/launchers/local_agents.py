"""The local launcher: every "host" of the job is a node agent process on this machine (`megaheal agent`), each with
its own scratch directory as its local disk, reporting to the healer over loopback. The same agents, orders and
reports as on a cluster (healer/launchers/slurm_agents.py starts them with srun), so one code path is tested here.

The agents run in sessions of their own: a healer that dies leaves them (and the job) running, and the next one
(`megaheal run --take-over`) finds them again through the journal.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ground import procfs
from ground.names import name_path
from ground.secretfile import read_secret
from healer.launchers import agent_registry
from healer.launchers.agent_client import AgentClient
from healer.launchers.fleet import AgentSettings, Launch
from healer.launchers.job_diagnosis import local_env
from healer.launchers.run_token import read_token

log = logging.getLogger(__name__)
START_TIMEOUT_S = 60.0


@dataclass(slots=True)
class LocalAgent:
    node: str
    url: str
    process: subprocess.Popen[bytes] | None = None
    """The agent's process; None for an agent in this process (`in_process`)."""
    log_path: Path | None = None
    _log: IO[bytes] | None = None
    in_process: Any = None


@dataclass(kw_only=True, slots=True)
class LocalAgents(AgentSettings):
    """One `megaheal agent` process per host, on this machine."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """A run whose hosts are this machine's."""

        nvml: dict[str, Any] = field(default_factory=dict)
        """Per host, the NVML handle its sidecar reads (tests hand a recorded one; then the agents run in process);
        none by default: the local hosts share this machine."""

    @classmethod
    def for_run(cls, cfg: Config, run_dir: Path, token_file: Path) -> Launch:
        rank_env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        fleet = cls(run_dir=run_dir, healer_url="", token_file=token_file, in_process=bool(cfg.nvml),
                    nvml=dict(cfg.nvml), extra_env=rank_env)
        # Runbooks across the job's hosts run from here, over local ranks only.
        return Launch(fleet=fleet, listen="127.0.0.1:0", rank_env=rank_env, across_env=local_env(os.environ) | rank_env)

    in_process: bool = False
    """Run the agents as threads of this process (tests that hand one a recorded NVML): the same agents, orders and
    reports, but they die with the healer."""
    nvml: dict[str, Any] = field(default_factory=dict)
    """In-process agents only: per host, the NVML handle its sidecar reads (none by default)."""
    agents: dict[str, LocalAgent] = field(default_factory=dict)

    @staticmethod
    def scratch_dir(run_dir: Path, node: str) -> Path:
        """The host's local disk: its ranks' TMPDIR (what a node-local NVMe is on a cluster)."""
        return name_path(run_dir / "nodes", node) / "tmp"

    def start(self, nodes: list[str]) -> dict[str, str]:
        """Start an agent for each host and wait until they serve; their URLs."""
        if self.in_process:
            for node in nodes:
                self.agents[node] = self._in_process(node)
            return self._registered()
        started = [self._spawn(node) for node in nodes]
        deadline = time.monotonic() + START_TIMEOUT_S
        for node, url_file, agent_log, proc, log_path in started:
            while not url_file.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if not url_file.exists():
                proc.kill()
                tail = log_path.read_text(errors="replace").splitlines()[-5:] if log_path.exists() else []
                raise RuntimeError(f"the agent of {node} did not start: {' | '.join(tail) or 'no output'}")
            self.agents[node] = LocalAgent(node, read_secret(url_file, "agent's URL", private=True), proc, log_path,
                                           agent_log)
        return self._registered()

    hosts_are_local = True

    def restart(self, node: str) -> str:
        """A new agent for `node` (its old one died or hangs: it is killed first, if it is our child)."""
        old = self.agents.pop(node, None)
        if old is not None and old.in_process is not None:
            old.in_process.stop()
        elif old is not None and old.process is not None and old.process.poll() is None:
            old.process.kill()
            old.process.wait(timeout=15)
        if old is not None and old._log is not None:
            old._log.close()
        self.start([node])
        return self.agents[node].url

    def gone(self, node: str) -> bool:
        agent = self.agents.get(node)
        if agent is None or agent.in_process is not None:
            return False
        if agent.process is not None:
            return agent.process.poll() is not None
        return self._pid_of_run(node) is None  # adopted: gone once its recorded process is

    def drain(self, node: str, reason: str) -> bool:
        """No scheduler here to keep other work off a host: the healer's own exclusion is all there is."""
        return False

    def resume(self, node: str) -> bool:
        """No scheduler here: a host the healer takes back needs nothing else."""
        return False

    def host_states(self, nodes: list[str]) -> dict[str, dict[str, str | None]]:
        """No scheduler here: nothing to say of a host beyond what the healer itself knows."""
        return {}

    def scheduler_reaches(self, node: str) -> bool | None:
        return None

    def _registered(self) -> dict[str, str]:
        return agent_registry.save(self.run_dir, {n: a.url for n, a in self.agents.items()})

    def _in_process(self, node: str) -> LocalAgent:
        from healer.agent.node import NodeAgent, agent_socket_path
        from healer.compose_agent import node_agent

        work = self.work_dir(node)
        cfg = NodeAgent.Config(node=node, token=read_token(self.token_file), work_dir=work,
                               scratch_dir=self.scratch_dir(self.run_dir, node), healer_url=self.healer_url,
                               socket_path=agent_socket_path(node, work), tls_dir=self.host_tls(node), run_dir=self.run_dir,
                               python=self.python, cwd=self.cwd, extra_env=self.extra_env)
        agent = node_agent(cfg, nvml=self.nvml.get(node))
        return LocalAgent(node, agent.start(), in_process=agent)

    def _spawn(self, node: str) -> tuple[str, Path, IO[bytes], subprocess.Popen[bytes], Path]:
        work = self.work_dir(node)
        work.mkdir(parents=True, exist_ok=True)
        url_file = work / "url"
        url_file.unlink(missing_ok=True)
        log_path = work / "agent.log"
        agent_log = open(log_path, "ab")  # noqa: SIM115 - lives as long as the agent
        argv = [self.python, "-m", "megaheal", "agent", "--node", node, "--token-file", str(self.token_file),
                "--work-dir", str(work), "--run-dir", str(self.run_dir.absolute()), "--scratch-dir", str(self.scratch_dir(self.run_dir, node)),
                "--healer-url", self.healer_url, "--url-file", str(url_file), "--tls-dir", str(self.host_tls(node))]
        env = dict(os.environ) | self.extra_env
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen(argv, cwd=self.cwd, env=env, stdin=subprocess.DEVNULL, stdout=agent_log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        # Who the agent is, for a healer that takes the run over and finds it not answering (see _end_stale).
        (work / "pid.json").write_text(json.dumps({"pid": proc.pid, "started": procfs.start_time(proc.pid)}) + "\n")
        return node, url_file, agent_log, proc, log_path

    def adopt(self, nodes: list[str]) -> dict[str, str]:
        """After a healer died: its agents outlived it (sessions of their own). Those that still answer, with the run's
        token, are kept and told to report here; the hosts whose agent is gone get a new one. Their URLs."""
        known = self.known()
        token = read_token(self.token_file)
        for node in nodes:
            url = known.get(node)
            if url is not None and agent_registry.redirect(node, url, token, self.healer_url, self.healer_tls(),
                                                           epoch=self.epoch):
                self.agents[node] = LocalAgent(node, url)
            else:
                # An agent too slow to answer in time may still be alive: two agents must never serve one host.
                self._end_stale(node)
        missing = [n for n in nodes if n not in self.agents]
        if missing:
            self.start(missing)
        return {n: a.url for n, a in self.agents.items()}

    def _pid_of_run(self, node: str) -> int | None:
        """The pid of the agent this run last started on `node`, while that process runs (its pid.json holds its
        pid and start time, so a pid the kernel gave to a later process is not taken for it)."""
        try:
            rec = json.loads((self.work_dir(node) / "pid.json").read_text())
            pid, started = int(rec["pid"]), float(rec["started"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None
        return pid if procfs.alive(pid) and procfs.is_same_process(pid, started) else None

    def _end_stale(self, node: str) -> None:
        """Kill the agent this run last started on `node` if it still runs (it did not answer: hung, or starved of
        CPU); its ranks are in sessions of their own and live on, for the host's next agent to adopt or stop."""
        pid = self._pid_of_run(node)
        if pid is None:
            return
        log.warning("the agent of %s (pid %d) runs but does not answer: killing it", node, pid)
        try:
            os.killpg(pid, signal.SIGKILL)  # the agent leads its own session (see _spawn)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + 15
        while procfs.alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def known(self) -> dict[str, str]:
        """The agents this run's launcher last started (`agents.json` in the run's launcher directory)."""
        return agent_registry.load(self.run_dir)

    @property
    def registry(self) -> Path:
        return agent_registry.path(self.run_dir)

    def clients(self, token: str) -> dict[str, AgentClient]:
        tls = self.healer_tls()
        return {n: AgentClient(n, a.url, token, tls=tls) for n, a in self.agents.items()}

    def stop(self) -> None:
        """End the agents (the job's ranks must already be stopped: an agent leaves them as they are); twice is once."""
        token = read_token(self.token_file) if self.token_file.exists() else ""
        adopted: list[int] = []
        for agent in self.agents.values():
            if agent.in_process is not None:
                agent.in_process.stop()
            elif agent.process is not None and agent.process.poll() is None:
                agent.process.send_signal(signal.SIGTERM)
            elif agent.process is None:  # adopted from a healer that died: not our child, but it takes orders
                pid = self._pid_of_run(agent.node)
                if not agent_registry.shut_down(agent.node, agent.url, token, self.healer_tls(), epoch=self.epoch):
                    self._end_stale(agent.node)
                elif pid is not None:
                    adopted.append(pid)
        for agent in self.agents.values():
            if agent.process is not None:
                try:
                    agent.process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    agent.process.kill()
                    agent.process.wait(timeout=15)
            if agent._log is not None:
                agent._log.close()
        # The adopted ones are not ours to wait for; they are on this machine, so watch them leave (as for our own).
        deadline = time.monotonic() + 15
        while adopted and time.monotonic() < deadline:
            adopted = [p for p in adopted if procfs.alive(p)]
            time.sleep(0.1)
        if adopted:
            log.warning("adopted agent(s) still running 15 s after their shutdown: pid(s) %s", adopted)
        self.agents.clear()  # stopped once: a second stop (an error after the loop stopped them) has nothing to do


"""The Slurm launcher: `megaheal run --launcher slurm` inside an allocation (deploy/slurm/megaheal.sbatch). One node
agent per host of the allocation, each started as a job step of its own:

    srun --jobid=JOB --nodes=1 --ntasks=1 --nodelist=HOST --overlap --whole --mem=0 --job-name=megaheal-agent:HOST
         PYTHON -m megaheal agent --node HOST --listen NODEADDR:0 --token-file RUN_DIR/launcher/token ...

- `--overlap`: the agent's step shares the host with the other steps of the job (the runbooks' srun steps, a
  restarted agent), which would otherwise wait for its CPUs forever; `--whole --mem=0`: the agent's ranks are its
  children, inside its step, so the step gets every CPU and all the memory the job holds on the host.
- The agent binds the host's cluster address (Slurm's NodeAddr): the healer runs on another host. It finds the
  healer at the report endpoint's URL (bound to this machine's address towards the hosts), and writes its own
  URL to `RUN_DIR/nodes/HOST/agent/url` on the shared run directory, where the launcher reads it.
- The token travels as a file path only: never on a command line or in an environment, which every process of the
  job's user can read in /proc.
- One step per host, named after it, so an agent is found (and cancelled) by name with squeue and scancel, also by
  a healer that took the run over and never started it.

The srun clients run in sessions of their own, like the local agents: a healer that dies leaves the agents (and
the job) running for the next one (`megaheal run --launcher slurm --take-over`).
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

from ground import slurm
from ground.secretfile import read_secret
from ground.slurm import SlurmError
from healer.launchers import agent_registry
from healer.launchers.allocation import Allocation
from healer.launchers.fleet import AgentSettings, Launch
from healer.launchers.run_token import read_token

log = logging.getLogger(__name__)
STEP_PREFIX = "megaheal-agent:"


def step_name(node: str) -> str:
    return f"{STEP_PREFIX}{node}"


@dataclass(slots=True)
class AgentStep:
    node: str
    url: str = ""
    srun: subprocess.Popen[bytes] | None = None
    """The srun client of the agent's step; None for an agent adopted from a healer that died."""
    log: IO[bytes] | None = None


@dataclass(kw_only=True, slots=True)
class SlurmAgents(AgentSettings):
    """One `megaheal agent` per host of the allocation, each its own srun step."""

    allocation: Allocation
    scratch_root: str = "/tmp"
    """Node-local: each host's scratch directory (its ranks' TMPDIR) is SCRATCH_ROOT/megaheal-JOB/HOST there."""
    start_timeout_s: float = 180.0
    """srun, then the agent's imports: tens of seconds on a loaded host."""
    stop_timeout_s: float = 20.0
    agents: dict[str, AgentStep] = field(default_factory=dict)
    dcgm_url: str | None = None
    """Each host's agent reads its GPUs from the dcgm-exporter at this URL, as that host sees it (None: NVML)."""

    hosts_are_local = False

    @dataclass(kw_only=True, slots=True)
    class Config:
        """A run on the hosts of the Slurm allocation it runs in."""

        allocation: Allocation
        dcgm_url: str | None = None
        """Where each host's dcgm-exporter serves /metrics, as that host sees it (http://127.0.0.1:9400/metrics:
        its own); None: the agents read NVML."""

        def __post_init__(self) -> None:
            if self.dcgm_url is not None:
                check_dcgm_url(self.dcgm_url)

    @classmethod
    def for_run(cls, cfg: Config, run_dir: Path, token_file: Path) -> Launch:
        # The agents are on other hosts: the endpoint binds this machine's address towards them, and gloo finds each
        # host's own address from its name unless the operator chose an interface.
        rank_env = slurm.srun_env({k: v for k, v in os.environ.items() if k == "GLOO_SOCKET_IFNAME"})
        fleet = cls(run_dir=run_dir, healer_url="", token_file=token_file, allocation=cfg.allocation,
                    extra_env=rank_env, dcgm_url=cfg.dcgm_url)
        # Runbooks across the job's hosts run from here, inside the allocation (srun finds the job in our environment).
        return Launch(fleet=fleet, listen=f"{cfg.allocation.healer_address}:0", rank_env=rank_env,
                      across_env=slurm.srun_env(os.environ))

    def agent_argv(self, node: str) -> list[str]:
        """The srun step of `node`'s agent: an argument list (nothing reaches a shell); every value in it is the
        allocation's own (host names, addresses) or a path this launcher chose."""
        address = self.allocation.addresses[node]
        listen = f"[{address}]:0" if ":" in address else f"{address}:0"
        work = self.work_dir(node)
        return ["srun", f"--jobid={self.allocation.job_id}", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
                f"--nodelist={node}", "--overlap", "--whole", "--mem=0", f"--job-name={step_name(node)}",
                "--export=ALL", "--input=none",
                self.python, "-m", "megaheal", "agent", "--node", node, "--listen", listen,
                "--token-file", str(self.token_file.absolute()), "--work-dir", str(work),
                "--run-dir", str(self.run_dir.absolute()),
                "--scratch-dir", f"{self.scratch_root}/megaheal-{self.allocation.job_id}/{node}",
                "--healer-url", self.healer_url, "--url-file", str(work / "url"),
                "--tls-dir", str(self.host_tls(node).absolute()),
                *(["--dcgm-url", self.dcgm_url] if self.dcgm_url else [])]

    # ---- start -------------------------------------------------------------------------------------------

    def start(self, nodes: list[str]) -> dict[str, str]:
        """Start an agent on each of `nodes` and wait until each serves; their URLs."""
        if not self.healer_url:
            raise RuntimeError("the agents need the healer's URL (healer_url) before they start")
        started = [self._spawn(node) for node in nodes]
        deadline = time.monotonic() + self.start_timeout_s
        for step in started:
            self._wait_url(step, deadline)
        return self._registered()

    def _spawn(self, node: str) -> AgentStep:
        work = self.work_dir(node)
        work.mkdir(parents=True, exist_ok=True)
        (work / "url").unlink(missing_ok=True)
        log_file = open(work / "agent.log", "ab")  # noqa: SIM115 - lives as long as the step
        env = slurm.srun_env(os.environ) | self.extra_env
        env.setdefault("OMP_NUM_THREADS", "1")
        srun = subprocess.Popen(self.agent_argv(node), cwd=self.cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        step = AgentStep(node, srun=srun, log=log_file)
        self.agents[node] = step
        return step

    def _wait_url(self, step: AgentStep, deadline: float) -> None:
        url_file = self.work_dir(step.node) / "url"
        assert step.srun is not None
        while time.monotonic() < deadline and step.srun.poll() is None:
            url = read_secret(url_file, "agent's URL", private=True) if url_file.exists() else ""
            if url:
                step.url = url
                return
            time.sleep(0.1)
        self._cancel(step)
        tail = (self.work_dir(step.node) / "agent.log").read_text(errors="replace").splitlines()[-5:]
        raise RuntimeError(f"the agent of {step.node} did not start (srun {step.srun.returncode}): "
                           f"{' | '.join(tail) or 'no output'}")

    def _registered(self) -> dict[str, str]:
        return agent_registry.save(self.run_dir, {n: a.url for n, a in self.agents.items() if a.url})

    # ---- take-over, restart, drain -----------------------------------------------------------------------

    def adopt(self, nodes: list[str]) -> dict[str, str]:
        """After a healer died: the agents it started still run (their srun clients outlived it). Those that answer
        are told to report here; a host whose agent does not answer gets a new one (its old step, if any, is
        cancelled first: an agent that hangs must not hold the host's part twice)."""
        known = agent_registry.load(self.run_dir)
        token = read_token(self.token_file)
        missing = []
        for node in nodes:
            url = known.get(node)
            if url is not None and agent_registry.redirect(node, url, token, self.healer_url, self.healer_tls(),
                                                           epoch=self.epoch):
                self.agents[node] = AgentStep(node, url)
            else:
                missing.append(node)
        if missing:
            self._cancel_steps(missing)
            self.start(missing)
        return self._registered()

    def gone(self, node: str) -> bool:
        step = self.agents.get(node)
        return step is not None and step.srun is not None and step.srun.poll() is not None

    def restart(self, node: str) -> str:
        """A new agent on `node`: its step is cancelled if it still runs (an agent that hangs), then started again."""
        old = self.agents.pop(node, None)
        if old is not None:
            self._cancel(old)
        else:
            self._cancel_steps([node])
        self.start([node])
        return self.agents[node].url

    def drain(self, node: str, reason: str) -> bool:
        """`scontrol update NodeName=NODE State=DRAIN Reason=...` (the reason cut to a safe alphabet). SlurmError
        saying why when slurmctld refuses (draining needs a Slurm operator) or does not answer."""
        slurm.drain(node, reason)
        return True

    def resume(self, node: str) -> bool:
        """`scontrol update NodeName=NODE State=RESUME`; SlurmError saying why when slurmctld refuses or is silent."""
        slurm.resume(node)
        return True

    def host_states(self, nodes: list[str]) -> dict[str, dict[str, str | None]]:
        """`scontrol show node` of each host: its state and reason; a host Slurm does not know (or a slurmctld that
        does not answer) is left out."""
        try:
            found = slurm.nodes(sorted(nodes)) if nodes else {}
        except SlurmError:
            # NOTE: one name scontrol does not know fails the whole query: ask host by host.
            found = {}
            for node in sorted(nodes):
                try:
                    found |= slurm.nodes([node])
                except SlurmError as exc:
                    log.warning("the Slurm state of %s is unknown: %s", node, exc)
        return {n: {"state": i.state, "reason": i.reason} for n, i in found.items()}

    def scheduler_reaches(self, node: str) -> bool | None:
        """Whether a step of the allocation still starts on `node` (ground/slurm.py `step_runs_on`)."""
        return slurm.step_runs_on(self.allocation.job_id, node)

    # ---- stop --------------------------------------------------------------------------------------------

    def stop(self) -> None:
        """End every agent (the job's ranks must already be stopped): a shutdown order first, so each leaves
        cleanly; whatever step is left after `stop_timeout_s` is cancelled. Twice is once."""
        if not self.agents:
            return
        token = read_token(self.token_file) if self.token_file.exists() else ""
        for agent in self.agents.values():
            if agent.url:
                agent_registry.shut_down(agent.node, agent.url, token, self.healer_tls(), epoch=self.epoch)
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline and self._running():
            time.sleep(0.2)
        left = self._running()
        if left:
            log.warning("agent steps still running after their shutdown: %s; cancelling them", ", ".join(left))
            self._cancel_steps(left)
        for agent in self.agents.values():
            self._reap(agent)
        self.agents.clear()

    def _running(self) -> list[str]:
        """Hosts whose agent step still runs (ours: its srun client; adopted ones: as squeue lists them)."""
        ours = [a.node for a in self.agents.values() if a.srun is not None and a.srun.poll() is None]
        adopted = [a.node for a in self.agents.values() if a.srun is None]
        if adopted:
            steps = slurm.steps(self.allocation.job_id)
            ours += [n for n in adopted if step_name(n) in steps]
        return ours

    def _cancel(self, agent: AgentStep) -> None:
        """End one agent's step now, whatever it is doing."""
        if agent.srun is None or agent.srun.poll() is None:
            self._cancel_steps([agent.node])
        self._reap(agent)

    def _cancel_steps(self, nodes: list[str]) -> None:
        steps = slurm.steps(self.allocation.job_id)
        slurm.cancel_steps([s for n in nodes for s in steps.get(step_name(n), [])])

    def _reap(self, agent: AgentStep) -> None:
        """Wait for the agent's srun client to leave (srun waits for its step to end); close its log."""
        if agent.srun is not None:
            try:
                agent.srun.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.warning("the srun client of %s's agent did not leave: killed", agent.node)
                agent.srun.kill()
                agent.srun.wait(timeout=10)
        if agent.log is not None:
            agent.log.close()
            agent.log = None


def check_dcgm_url(url: str) -> str:
    """`url` if it is an http(s) URL without spaces or control characters; ValueError naming it otherwise (it goes
    into every agent's argument list)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or any(c.isspace() or ord(c) < 32 for c in url):
        raise ValueError(f"--dcgm-url must be an http(s) URL of a dcgm-exporter's /metrics, got {url!r}")
    return url

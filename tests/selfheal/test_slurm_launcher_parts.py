"""The Slurm launcher's parts that need no cluster: the agents' srun steps and the drain command as argument lists,
drain reasons cut to a safe alphabet, which left-out hosts count as proven bad, the allocation's hosts, spares and
dp degree, and a clear refusal outside an allocation. The launcher itself runs on the bed (tests/multihost/)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ground import slurm
from healer.incidents.timeline import IncidentTimeline
from healer.launchers.allocation import Allocation, NotInAllocation, route_address
from healer.launchers.drain import drain_reason, proven_bad
from healer.launchers.launchers import launch
from healer.launchers.local_agents import LocalAgents
from healer.launchers.slurm_agents import SlurmAgents
from tests.conftest import REPO
from train.config import load_config

pytestmark = pytest.mark.unit

ALLOC = Allocation(job_id="41", hosts=("h1", "h2", "h3", "h4"), ranks_per_node=2, healer_address="10.0.0.1",
                   addresses={"h1": "10.0.0.11", "h2": "10.0.0.12", "h3": "10.0.0.13", "h4": "10.0.0.14"})


def test_an_agent_step_binds_its_hosts_address_overlaps_the_jobs_other_steps_and_carries_no_token(tmp_path) -> None:
    token_file = tmp_path / "supervisor" / "token"
    agents = SlurmAgents(run_dir=tmp_path, healer_url="http://10.0.0.1:4242", token_file=token_file,
                         allocation=ALLOC, python="/venv/bin/python")
    argv = agents.agent_argv("h2")
    srun, agent = argv[:argv.index("/venv/bin/python")], argv[argv.index("/venv/bin/python"):]
    assert srun[0] == "srun" and {"--jobid=41", "--nodes=1", "--ntasks=1", "--nodelist=h2", "--overlap", "--whole",
                                   "--job-name=megaheal-agent:h2"} <= set(srun)
    options = dict(zip(agent[4::2], agent[5::2]))
    assert agent[:4] == ["/venv/bin/python", "-m", "megaheal", "agent"]
    assert options["--node"] == "h2" and options["--listen"] == "10.0.0.12:0"
    assert options["--token-file"] == str(token_file.absolute()) and options["--healer-url"] == "http://10.0.0.1:4242"
    assert options["--scratch-dir"] == "/tmp/megaheal-41/h2", "node-local, not the shared run directory"
    assert Path(options["--url-file"]).parent == Path(options["--work-dir"]) == (tmp_path / "nodes/h2/agent").absolute()
    assert options["--run-dir"] == str(tmp_path.absolute()), "start orders are confined to it"
    assert options["--tls-dir"] == str((tmp_path / "launcher/tls/hosts/h2").absolute()), "its host's certificate"
    assert (tmp_path / "launcher/tls/hosts/h2/key.pem").stat().st_mode & 0o077 == 0


def test_agents_read_the_dcgm_exporter_they_are_given_and_a_url_that_is_not_one_is_refused(tmp_path) -> None:
    agents = SlurmAgents(run_dir=tmp_path, healer_url="http://10.0.0.1:4242", token_file=tmp_path / "token",
                         allocation=ALLOC, python="/venv/bin/python", dcgm_url="http://127.0.0.1:9400/metrics")
    argv = agents.agent_argv("h3")
    assert argv[argv.index("--dcgm-url") + 1] == "http://127.0.0.1:9400/metrics"
    for bad in ("file:///etc/passwd", "http://h:1/m --token-file x", "127.0.0.1:9400"):
        with pytest.raises(ValueError, match="--dcgm-url must be an http"):
            SlurmAgents.Config(allocation=ALLOC, dcgm_url=bad)


# What `scontrol -o show job` printed for a job of the bed's (Slurm 22.05), cut to the fields that matter and one
# before them that a node's parser would have taken as the start of a free-text reason.
JOB_LINE = ("JobId=1 JobName=megaheal UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) Requeue=0 "
            "NodeList=mht[2-4] BatchHost=mht1 NumNodes=3 Command=/work/main/deploy/slurm/megaheal.sbatch "
            "WorkDir=/work/main StdErr=/tmp/j/slurm.out StdIn=/dev/null StdOut=/tmp/j/slurm.out Power=")


def test_a_jobs_fields_are_read_past_its_reason() -> None:
    fields = slurm._job_fields(JOB_LINE)
    assert fields["Command"] == "/work/main/deploy/slurm/megaheal.sbatch" and fields["StdOut"] == "/tmp/j/slurm.out"
    assert fields["JobState"] == "RUNNING" and fields["NodeList"] == "mht[2-4]" and fields["Reason"] == "None"
    with pytest.raises(ValueError, match="job id"):
        slurm.job("1;scancel -u root")


def test_a_drain_reason_keeps_only_a_safe_alphabet_on_one_line_and_is_clipped() -> None:
    assert slurm.safe_reason('a "quoted" = $(x) `y`\n\x00z') == "a quoted (x) y z"
    assert len(slurm.safe_reason("x" * 1000)) == slurm.REASON_MAX
    reason = drain_reason(7, "crash", "failed diagnosis: " + "disk full; " * 30)
    assert reason.startswith("megaheal: incident 7: crash (failed diagnosis: disk full;") and reason.endswith("...)")
    assert reason == slurm.safe_reason(reason)


def test_the_drain_command_is_an_argument_list_with_a_checked_node_name() -> None:
    assert slurm.drain_argv("h2", 'megaheal: incident 3: hang (lemon: "x")') == [
        "scontrol", "update", "NodeName=h2", "State=DRAIN", "Reason=megaheal: incident 3: hang (lemon: x )"]
    for bad in ("h2 State=RESUME", "-h2", "h2,h3", ""):
        with pytest.raises(ValueError, match="node must be a name"):
            slurm.drain_argv(bad, "megaheal")


def test_only_a_host_that_failed_diagnosis_or_is_a_lemon_counts_as_proven_bad() -> None:
    t = IncidentTimeline(id=1, kind="crash", rule="crash", summary="", state="remediating", attempt=0,
                         suspect_nodes=["h1", "h2", "h3"], suspect_ranks=[], evidence={}, detected_at=0.0,
                         diagnosis=[{"node": "h1", "status": "fail", "summary": "disk: not writable"},
                                    {"node": "h2", "status": "pass", "summary": "ok"},
                                    {"node": "h3", "status": "error", "summary": "timed out"}],
                         plan={"decision_basis": {"lemons": {"h4": 3}}})
    assert proven_bad(t, "h1") == "failed diagnosis: disk: not writable"
    assert proven_bad(t, "h4") == "lemon: named in 3 incidents"
    assert proven_bad(t, "h2") is None and proven_bad(t, "h3") is None, "a runbook that could not run proves nothing"


def test_a_lost_host_counts_as_proven_bad_and_its_silent_peers_do_not() -> None:
    t = IncidentTimeline(id=2, kind="host_lost", rule="host-lost", summary="", state="remediating", attempt=0,
                         suspect_nodes=["h3"], suspect_ranks=[4, 5], evidence={"silent_s": 21.4}, detected_at=0.0)
    assert proven_bad(t, "h3") == "host lost: silent 21 s"
    assert proven_bad(t, "h1") is None


def test_the_allocation_keeps_its_last_hosts_as_spares_and_dp_follows_from_the_ranks() -> None:
    assert ALLOC.split(1) == (("h1", "h2", "h3"), ("h4",))
    assert ALLOC.split(0) == (ALLOC.hosts, ())
    with pytest.raises(ValueError, match="at least one must train"):
        ALLOC.split(4)
    demo = load_config(str(REPO / "configs/demo.yaml"), ["global_batch=24"])
    assert ALLOC.dp(demo, 3) == 3 and ALLOC.dp(demo, 2) == 2, "pp 2: 3 hosts x 2 ranks = dp 3"
    with pytest.raises(ValueError, match=r"(?s)3 host\(s\) x 2 ranks give dp 3: .*global_batch \(16\) must be a multiple of parallel.dp \(3\)"):
        ALLOC.dp(load_config(str(REPO / "configs/demo.yaml"), []), 3)


def test_outside_an_allocation_the_slurm_launcher_refuses_saying_where_it_runs() -> None:
    with pytest.raises(NotInAllocation, match="inside a Slurm allocation"):
        Allocation.from_environment({})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", "megaheal", "run", "--launcher", "slurm"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--launcher slurm runs inside a Slurm allocation (sbatch or salloc" in proc.stderr


def test_scontrols_one_line_node_records_are_read_with_a_reason_that_has_spaces() -> None:
    line = ("NodeName=h2 Arch=x86_64 CoresPerSocket=1 NodeAddr=10.0.0.12 NodeHostName=h2 State=IDLE+DRAIN "
            "Reason=megaheal: incident 3: crash (lemon: named in 3 incidents) [root@2026-11-30T21:00:00]")
    fields = slurm._fields(line)
    assert fields["NodeAddr"] == "10.0.0.12" and fields["State"] == "IDLE+DRAIN"
    assert fields["Reason"].startswith("megaheal: incident 3: crash (lemon: named in 3 incidents)")


def test_the_healer_listens_on_its_address_towards_the_hosts() -> None:
    assert route_address("127.0.0.1") == "127.0.0.1"


def test_the_launcher_is_the_one_whose_config_the_run_holds(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    slurm = launch(SlurmAgents.Config(allocation=ALLOC), tmp_path, tmp_path / "token")
    assert isinstance(slurm.fleet, SlurmAgents) and slurm.listen == "10.0.0.1:0" and not slurm.fleet.hosts_are_local
    assert "GLOO_SOCKET_IFNAME" not in slurm.rank_env, "across hosts gloo must not be pinned to loopback"
    local = launch(LocalAgents.Config(), tmp_path, tmp_path / "token")
    assert isinstance(local.fleet, LocalAgents) and local.listen == "127.0.0.1:0" and local.fleet.hosts_are_local
    assert local.rank_env == {"GLOO_SOCKET_IFNAME": "lo"}

    @dataclass
    class KubernetesConfig:
        namespace: str = "training"

    with pytest.raises(ValueError, match=r"no launcher takes a .*KubernetesConfig; known: LocalAgents.Config, "
                                         r"SlurmAgents.Config"):
        launch(KubernetesConfig(), tmp_path, tmp_path / "token")  # type: ignore[arg-type]

"""`megaheal testbed up/down` on beds of their own: idempotent, and nothing left behind, also after
`kill -9` of the process that ran `up`; a non-root user is told plainly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.multihost.conftest import need_root
from tests.support import wait_for
from testbed.bed import Bed
from testbed.cmd import BedError

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(90)]

MEGAHEAL = [sys.executable, "-m", "megaheal", "testbed"]


def traces(prefix: str) -> list[str]:
    """Everything named with `prefix` on this machine, looked up independently of testbed's own code."""
    found = []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout.split()
    found += [f"netns {n}" for n in netns if n.startswith(prefix) and n[len(prefix):].isdigit()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    found += [f"link {ln.split(':')[1].strip()}" for ln in links.splitlines()
              if ln.split(":")[1].strip().split("@")[0] in {f"{prefix}br0", *(f"{prefix}v{i}" for i in range(1, 9))}]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            zombie = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if f"/run/{prefix}-testbed" in cmd and not zombie:
            found.append(f"process {pid} {cmd[:80]}")
    found += [f"mount {ln.split()[4]}" for ln in Path("/proc/self/mountinfo").read_text().splitlines()
              if f"/run/{prefix}-testbed" in ln.split()[4]]
    for path in (Path(f"/run/{prefix}-testbed"), Path(f"/sys/fs/cgroup/freezer/{prefix}-testbed")):
        if path.exists():
            found.append(str(path))
    return found


def test_up_twice_keeps_what_is_there_and_down_leaves_nothing() -> None:
    need_root()
    bed = Bed(Bed.Config(hosts=2, prefix="mhu", subnet="10.215.0.0/24", slurmctld_port=6837))
    bed.down()
    machine_hosts = Path("/etc/hosts").read_text()
    try:
        first = bed.up()
        assert first.made and "slurmd on mhu2" in first.made
        assert traces("mhu"), "the bed exists"
        assert Path("/etc/hosts").read_text() == machine_hosts, "hosts resolve through their own /etc/hosts"
        again = bed.up()
        assert again.made == [] and set(again.kept) == set(first.made)
        with pytest.raises(BedError, match="already up with another configuration"):
            Bed(Bed.Config(hosts=3, prefix="mhu", subnet="10.215.0.0/24", slurmctld_port=6837)).up()
    finally:
        report = bed.down()
    assert "mhu1" in report.removed and "mhubr0" in report.removed
    assert traces("mhu") == []
    assert Path("/etc/hosts").read_text() == machine_hosts


def test_down_after_kill_9_of_up_leaves_nothing() -> None:
    need_root()
    args = ["--prefix", "mhk", "--hosts", "2", "--subnet", "10.216.0.0/24", "--slurmctld-port", "6847"]
    subprocess.run([*MEGAHEAL, "down", "--prefix", "mhk"], cwd=REPO, capture_output=True, timeout=60)
    up = subprocess.Popen([*MEGAHEAL, "up", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        # Kill it half-way: once slurmctld runs, before every slurmd has registered.
        wait_for("slurmctld of bed mhk", lambda: Path("/run/mhk-testbed/slurmctld.pid").exists() or up.poll(), 60,
                 every_s=0.01)
        up.send_signal(signal.SIGKILL)
        up.wait(10)
    finally:
        if up.poll() is None:
            up.kill()
    assert up.returncode == -signal.SIGKILL, "the test must kill `up` before it finished"
    left = traces("mhk")
    assert any(t.startswith("netns") for t in left) and any(t.startswith("process") for t in left), left
    down = subprocess.run([*MEGAHEAL, "down", "--prefix", "mhk"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert down.returncode == 0, down.stderr
    assert traces("mhk") == []


def test_a_non_root_user_is_told_that_the_bed_needs_root() -> None:
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is needed to run as another user"
        proc = subprocess.run([setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", *MEGAHEAL, "up",
                               "--prefix", "mhn"], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"})
        code, err = proc.returncode, proc.stderr
    else:  # already unprivileged: the command itself, in this process
        from typer.testing import CliRunner

        from megaheal.cli import app

        result = CliRunner().invoke(app, ["testbed", "up", "--prefix", "mhn"])
        code, err = result.exit_code, result.output
    assert code == 2, err
    assert "the test bed needs root" in err and "run it as root" in err, err
    assert traces("mhn") == []


def test_status_shows_each_host_with_its_faults_and_fails_while_a_link_is_down(healthy_bed) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*MEGAHEAL, *args, "--prefix", healthy_bed.config.prefix], cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    host = healthy_bed.hosts[1].name
    assert cli("fault", "slow-link", host, "--rate", "100mbit").returncode == 0
    ok = cli("status", "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    hosts = {h["name"]: h for h in json.loads(ok.stdout)["hosts"]}
    assert set(hosts) == {h.name for h in healthy_bed.hosts} and all(h["slurm_state"] == "idle" for h in hosts.values())
    assert hosts[host]["rate_limit"] == "100Mbit" and hosts[host]["link"] == "up"
    assert cli("fault", "cut-link", host).returncode == 0
    cut = cli("status", "--json")
    assert cut.returncode == 1 and {h["name"]: h["link"] for h in json.loads(cut.stdout)["hosts"]}[host] == "down"
    bad = cli("fault", "slow-link", host, "--rate", "fast")
    assert bad.returncode == 2 and "--rate must be a rate such as 100mbit" in bad.stderr

"""The hostile tier (issue 34): a job of deploy/slurm/megaheal.sbatch on the bed's 4 hosts, and while it trains,
what a peer of the network or a host of the run tries against its control plane, and a healer that loses every
host at once. The job must finish as if none of it happened: no host left out, drained or restarted.

- a heartbeat batch for another host, sent with a host's own certificate: refused (403), never stored;
- an order to an agent with a host's certificate (which holds the run's token too): refused (403);
- a start order that sets a variable which loads code into every rank (CUDA_INJECTION64_PATH): refused (400);
- an order of a stale healer epoch, with the healer's own certificate: refused (409);
- a connection flood on the healer's report port from one address: no host looks lost;
- the healer cut off from every host for 30 s (a firewall rule on its report port in its host, then lifted): it
  says it is blind and acts on no host."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.parse
from collections.abc import Iterator

import msgspec
import pytest

from ground import procfs
from ground.tls import PeerTls, TlsFiles, https
from healer.launchers import agent_registry
from testbed.bed import Bed
from tests.multihost.conftest import bed_env
from tests.multihost.slurm_job import SlurmJob
from tests.support import wait_for
from wire.run_paths import RunPaths
from wire.telemetry import HeartbeatBatch, encode_batch

pytestmark = pytest.mark.multihost


def _healer_url(bed: Bed, host: str) -> str:
    """Where the agent of `host` sends its batches (its --healer-url)."""
    for pid in bed.pids(host):
        argv = procfs.cmdline(pid)
        if "agent" in argv and "--healer-url" in argv:
            return argv[argv.index("--healer-url") + 1]
    raise AssertionError(f"no agent running on {host}")


@contextlib.contextmanager
def _report_port_blocked(bed: Bed, host: str, port: int) -> Iterator[None]:
    """Every packet to the healer's report port dropped in `host` (its own agent's included), until the block ends."""
    rule = ["INPUT", "-p", "tcp", "--dport", str(port), "-j", "DROP"]
    subprocess.run([*bed.enter(host), "iptables", "-I", *rule], check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run([*bed.enter(host), "iptables", "-D", *rule], check=True, timeout=30)


@contextlib.contextmanager
def _flood(host: str, port: int, connections: int) -> Iterator[int]:
    """`connections` idle TCP connections to host:port from this machine, held open; how many the server took."""
    held: list[socket.socket] = []
    try:
        for _ in range(connections):
            s = socket.socket()
            s.settimeout(2)
            with contextlib.suppress(OSError):
                s.connect((host, port))
                held.append(s)
        yield len(held)
    finally:
        for s in held:
            s.close()


@pytest.mark.timeout(900)
def test_a_hostile_peer_cannot_drive_the_job_and_a_blind_healer_acts_on_no_host(healthy_bed, tmp_path,
                                                                                 monkeypatch) -> None:
    monkeypatch.setenv("SLURM_CONF", bed_env(healthy_bed)["SLURM_CONF"])
    bed = healthy_bed
    hosts = [h.name for h in bed.hosts]
    job = SlurmJob.submit(bed, tmp_path, steps=45)
    try:
        job.wait_step(5, 300)
        tls = RunPaths(job.run_dir).launcher / "tls"
        healer = _healer_url(bed, hosts[1])
        where = urllib.parse.urlsplit(healer)
        assert where.scheme == "https" and where.hostname and where.port
        mine = TlsFiles(tls / "hosts" / hosts[1]).client()

        # A host speaks for another: refused whole, with why.
        forged = encode_batch(HeartbeatBatch(schema=1, node=hosts[2], seq=1, sent_at=time.time(), ranks=[]))
        status, body = https("POST", f"{healer}/v1/heartbeats", forged, {"Content-Type": "application/json"}, 10,
                             PeerTls(mine, "healer"), 4096)
        assert status == 403 and f"certificate of host '{hosts[1]}'".encode() in body, body

        # A host orders another's agent: it holds the run's token, not the healer's certificate.
        agents = agent_registry.load(job.run_dir)
        token = RunPaths(job.run_dir).token.read_text().strip()
        auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        stop = msgspec.json.encode({"kind": "stop", "id": "hostile:stop", "attempt": 0, "grace_s": 0.5, "epoch": 99})
        status, body = https("POST", f"{agents[hosts[2]]}/v1/orders", stop, auth, 10, PeerTls(mine, "host", hosts[2]),
                             4096)
        assert status == 403 and b"only the run's healer" in body, body

        # The healer's own certificate cannot make a rank load code through the environment.
        healer_tls = TlsFiles(tls / "healer").client()
        start = msgspec.json.encode({
            "kind": "start", "id": "hostile:start", "job": "hostile", "attempt": 9, "nnodes": 1, "node_rank": 0,
            "nproc_per_node": 1, "config": "/nonexistent.yaml", "run_dir": str(job.run_dir), "epoch": 99,
            "env": {"CUDA_INJECTION64_PATH": "/tmp/evil.so"}})
        status, body = https("POST", f"{agents[hosts[2]]}/v1/orders", start, auth, 10,
                             PeerTls(healer_tls, "host", hosts[2]), 4096)
        assert status == 400 and b"CUDA_INJECTION64_PATH" in body, body

        # An order of a healer older than the one that drives the job (epoch 0: every healer claims 1 or more).
        stale = msgspec.json.encode({"kind": "stop", "id": "hostile:stale", "attempt": 0, "grace_s": 0.5, "epoch": 0})
        status, body = https("POST", f"{agents[hosts[2]]}/v1/orders", stale, auth, 10,
                             PeerTls(healer_tls, "host", hosts[2]), 4096)
        assert status == 409 and b"stale epoch 0" in body, body

        # One address holds a flood of idle connections to the report endpoint: the hosts still get through.
        with _flood(where.hostname, where.port, 400) as held:
            assert held > 0
            at = max(job.steps().values())
            job.wait_step(at + 3, 120)
            time.sleep(10)  # past host_lost's and healer_blind's waits, with the flood held
        assert not [i for i in job.incidents() if i["kind"] in ("host_lost", "healer_blind")], job.incidents()

        # The healer hears from no host for 30 s.
        with _report_port_blocked(bed, hosts[0], where.port):
            time.sleep(30)
        job.finish(600)
    finally:
        job.stop()
    kinds = [(i["kind"], i["summary"]) for i in job.incidents()]
    assert "healer_blind" in {k for k, _ in kinds}, kinds
    assert not {k for k, _ in kinds} & {"host_lost", "hang", "crash"}, kinds
    assert job.attempts() == [0], "nothing was restarted"
    assert not any("DRAIN" in job.slurm_state(h).state for h in hosts)
    job.assert_nothing_left()
    wait_for("the bed's hosts idle again", lambda: not job.leftovers(), 60)

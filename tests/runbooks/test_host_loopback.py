"""Host and loopback checks, run in this process against the real machine (and a local NTP responder)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from runbooks.checks import rdma_loopback
from runbooks.checks.clock import ntp_timestamp
from runbooks.checks.host import HostCheck
from runbooks.checks.loopback import LoopbackCheck
from runbooks.registry import CheckContext
from testbed import freezer
from testbed.layout import FREEZER_ROOT
from wire.verdict import Status

pytestmark = pytest.mark.services

CTX = CheckContext(hostname="node-a", timeout_s=20)


def test_a_process_holding_a_gpu_is_named(tmp_path) -> None:
    device = tmp_path / "nvidia0"
    device.write_bytes(b"")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(device)!r}); import time; time.sleep(60)"])
    try:
        check = HostCheck(gpu_device=re.compile("^" + re.escape(str(device)) + "$"))
        deadline = time.monotonic() + 20
        while True:  # until the child has opened the file
            result = check.run(
                HostCheck.Config(
                    checkpoint_dir=str(tmp_path),
                    min_free_gib=0,
                    write_test_mib=1,
                    min_shm_free_gib=0,
                    fail_on_gpu_holders=True,
                ),
                CTX,
            )
            if result.status is not Status.PASS or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        holder.kill()
        holder.wait()
    assert result.status is Status.FAIL
    assert [(s.kind, s.name) for s in result.suspects] == [("process", str(holder.pid))]
    assert f"GPU held by pid {holder.pid} (python" in result.summary
    assert result.details["gpu_holders"][0]["devices"] == [str(device)]


def test_a_rank_frozen_in_the_kernel_fails_its_own_node_and_only_while_it_is_stuck(tmp_path, monkeypatch) -> None:
    # A "rank" as torchrun starts them (its run id in the environment), of node n7, frozen by the cgroup v1 freezer:
    # state D, and SIGKILL waits until it is thawed.
    env = {"PATH": "/usr/bin:/bin", "TORCHELASTIC_RUN_ID": "test-run", "MEGAHEAL_NODE": "n7"}
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)
    root = FREEZER_ROOT / f"mh-hostcheck-{rank.pid}"
    config = HostCheck.Config(checkpoint_dir=str(tmp_path), min_free_gib=0, write_test_mib=0, min_shm_free_gib=0,
                              fail_on_stuck_ranks=True)
    try:
        group = freezer.freeze(root, [rank.pid], "rank")
        rank.kill()  # pending: it cannot die while frozen
        monkeypatch.setenv("MEGAHEAL_NODE", "n7")
        result = HostCheck().run(config, CTX)
        assert result.status is Status.FAIL and f"pid {rank.pid}" in result.summary and "state D" in result.summary
        assert [(s.kind, s.name) for s in result.suspects] == [("process", str(rank.pid))]
        monkeypatch.setenv("MEGAHEAL_NODE", "n8")  # another host's check: not its rank
        assert HostCheck().run(config, CTX).status is Status.PASS
        freezer.thaw(group)
        rank.wait(10)  # the pending SIGKILL lands
        monkeypatch.setenv("MEGAHEAL_NODE", "n7")
        assert HostCheck().run(config, CTX).status is Status.PASS
    finally:
        freezer.remove_all(root)
        rank.kill()
        rank.wait(10)


def test_a_small_shm_fails_and_the_write_probe_leaves_nothing_behind(tmp_path) -> None:
    result = HostCheck().run(
        HostCheck.Config(
            checkpoint_dir=str(tmp_path / "not" / "yet"), min_free_gib=0, write_test_mib=2, min_shm_free_gib=1e6
        ),
        CTX,
    )
    assert result.status is Status.FAIL
    assert "/dev/shm" in result.summary and "NCCL and data loaders need shared memory" in result.summary
    assert list(tmp_path.iterdir()) == [], "the probe file was removed (and nothing was created)"
    speed = [m for m in result.measurements if m.name == "checkpoint_write_speed"]
    assert speed and speed[0].value > 0


def test_a_clock_two_seconds_off_an_ntp_server_is_degraded() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))
    server.settimeout(10)

    def answer() -> None:  # an SNTP server whose clock is 2 s ahead of ours
        data, addr = server.recvfrom(512)
        now = ntp_timestamp(time.time() + 2.0)
        reply = bytes([(0 << 6) | (4 << 3) | 4, 1, 0, 0]) + bytes(20) + data[40:48] + now + now
        server.sendto(reply, addr)

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        port = server.getsockname()[1]
        result = HostCheck().run(
            HostCheck.Config(
                checkpoint_dir="/tmp",
                min_free_gib=0,
                write_test_mib=0,
                min_shm_free_gib=0,
                ntp_server=f"127.0.0.1:{port}",
                ntp_timeout=timedelta(seconds=5),
            ),
            CTX,
        )
    finally:
        thread.join()
        server.close()
    assert result.status is Status.DEGRADED
    [offset] = [m for m in result.measurements if m.name == "clock_offset"]
    assert offset.value == pytest.approx(-2.0, abs=0.5)
    # NOTE: the offset is -2 s give or take half the round trip (the reply's timestamps are taken when the server
    # thread runs): -1.998 s on a loaded machine, so the summary is checked against the measured value.
    assert f"clock offset {offset.value:+.3f}s" in result.summary and "exceeds 0.25s" in result.summary
    assert [(s.kind, s.name) for s in result.suspects] == [("host", "node-a")]


@pytest.mark.parametrize("broken", ["file", "missing"])
def test_a_scratch_directory_that_is_a_file_or_gone_fails_and_names_the_path(tmp_path, monkeypatch, broken) -> None:
    scratch = tmp_path / "scratch"
    if broken == "file":
        scratch.write_text("the node's local disk is gone\n")
    monkeypatch.setenv("TMPDIR", str(scratch))  # the default: the node's TMPDIR
    config = HostCheck.Config(checkpoint_dir=str(tmp_path), min_free_gib=0, write_test_mib=0, min_shm_free_gib=0)
    result = HostCheck().run(config, CTX)
    assert result.status is Status.FAIL
    what = "not a directory" if broken == "file" else "missing"
    assert f"scratch directory {scratch} is {what}" in result.summary
    assert [(s.kind, s.name) for s in result.suspects] == [("path", str(scratch))]
    scratch.unlink(missing_ok=True)
    scratch.mkdir()
    healthy = HostCheck().run(config, CTX)
    assert healthy.status is Status.PASS, healthy.summary
    assert f"scratch {scratch}:" in healthy.summary and list(scratch.iterdir()) == []


def test_tcp_loopback_measures_and_rdma_says_why_it_was_skipped() -> None:
    result = LoopbackCheck().run(LoopbackCheck.Config(tcp_mib=32, pings=50), CTX)
    names = {m.name: m.value for m in result.measurements}
    assert names["tcp_throughput"] > 0 and 0 < names["tcp_latency_p50"] <= names["tcp_latency_p99"]
    if rdma_loopback.skip_reason(rdma_loopback.available_devices()):
        assert "RDMA loopback skipped: " in result.summary
        assert result.details["rdma"]["skipped"]
    assert result.status in (Status.PASS, Status.DEGRADED), result.summary  # degraded: a very loaded machine


def test_ib_write_bw_output_is_parsed_in_either_unit() -> None:
    table = (
        "---------------------------------------------------------------------------------------\n"
        " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]\n"
        " 65536      183872           0.00               385.52             0.735306\n"
        "---------------------------------------------------------------------------------------\n"
    )
    assert rdma_loopback.parse_bw_average(table) == pytest.approx(385.52)
    assert rdma_loopback.parse_bw_average(table.replace("Gb/sec", "MB/sec")) == pytest.approx(385.52 * 8 / 1000)
    assert rdma_loopback.parse_bw_average("Couldn't connect to 127.0.0.1:18515") is None

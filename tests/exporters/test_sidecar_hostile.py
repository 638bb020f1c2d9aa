"""The sidecar's rank socket against hostile local writers (issue 12, finding 7), over real sockets.

Another user is played by a child process that drops to nobody (uid 65534): it needs root to do that, so those
tests are skipped, saying why, when the suite does not run as root.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from exporters.client import RankClient
from exporters.receiver import UnsafeSocketDirError
from exporters.sidecar import Sidecar
from tests.exporters.helpers import step_record
from tests.support import wait_for
from wire.telemetry import build_record, encode

pytestmark = pytest.mark.services

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another local user needs root (setuid to nobody)")
# A pid the forger's child writes its own over (msgspec encodes it as uint32: 0xce + 4 bytes).
PLACEHOLDER_PID = 0xDEADBEEF
# The forger: sends each hex line of stdin on the socket it inherited, as its own pid, and says who it is.
FORGER = r"""
import os, socket, struct, sys
sock = socket.socket(fileno=int(sys.argv[1]))
me = b"\xce" + struct.pack(">I", os.getpid())
sent = 0
for line in sys.stdin:
    sock.send(bytes.fromhex(line).replace(b"\xce\xde\xad\xbe\xef", me))
    sent += 1
print(os.getuid(), sent)
"""


def make_sidecar(socket_path, **kw) -> Sidecar:
    cfg = Sidecar.Config(node="node-1", socket_path=str(socket_path), metrics_addr="127.0.0.1:0", **kw)
    return Sidecar(cfg, nvml=None)


@contextmanager
def running_sidecar(tmp_path, **kw) -> Iterator[tuple[Sidecar, Callable[[int], RankClient]]]:
    """A started sidecar on tmp_path/s.sock and a maker of rank clients of job-a (this process) for it; all closed
    and stopped on the way out."""
    sidecar = make_sidecar(tmp_path / "s.sock", **kw)
    sidecar.start()
    clients: list[RankClient] = []

    def client(rank: int) -> RankClient:
        clients.append(RankClient(str(tmp_path / "s.sock"), "job-a", rank, rank, 2, {"pp": 0, "dp": rank, "tp": 0}))
        return clients[-1]

    try:
        yield sidecar, client
    finally:
        for c in clients:
            c.close()
        sidecar.stop()


def metrics(sidecar: Sidecar) -> str:
    return urllib.request.urlopen(sidecar.metrics_url, timeout=5).read().decode()


def forged_records() -> list[bytes]:
    """300 fake ranks of a fake job, and a NaN loss for rank 0 of the real job (what makes the healer roll back)."""
    hellos = [encode(build_record("hello", "forged-job", r, PLACEHOLDER_PID, 0,
                                  {"local_rank": 0, "node": "n", "world_size": 300, "mesh": {}})) for r in range(300)]
    nan = encode(build_record("step", "job-a", 0, PLACEHOLDER_PID, 0, step_record(5, loss=float("nan"))))
    return [*hellos, nan]


@as_root
def test_it_refuses_every_datagram_another_user_sends(tmp_path) -> None:
    records = forged_records()
    # NOTE: the private directory already keeps nobody away from the socket; the forger is handed a socket connected
    # to it, as a looser directory or a leaked descriptor would, so that the kernel's credentials are what is tested.
    with running_sidecar(tmp_path) as (sidecar, client), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as conn:
        conn.connect(str(tmp_path / "s.sock"))
        forger = subprocess.run(["/usr/bin/python3", "-c", FORGER, str(conn.fileno())], pass_fds=[conn.fileno()],
                                user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", capture_output=True, text=True,
                                input="".join(r.hex() + "\n" for r in records), timeout=60)
        assert forger.returncode == 0, forger.stderr
        assert forger.stdout.split() == [str(NOBODY), str(len(records))]
        wait_for("every forged datagram refused", lambda: (t := metrics(sidecar)) and
                 f'megaheal_sidecar_rejected_senders_total{{node="node-1"}} {float(len(records))}' in t, timeout_s=20)
        # NOTE: only now: while the forged datagrams fill the socket's queue (net.unix.max_dgram_qlen: 10 here) a
        # rank's non-blocking send is dropped, as it should be, and the hello sent right after the forger once never
        # arrived (twice: in CI and in a make test-fast here).
        client(1).hello()
        text = wait_for("our own hello read", lambda: sidecar.table.snapshot() and metrics(sidecar), timeout_s=20)
        assert sidecar.receiver.refused == {"other-user": len(records)}
        assert [(s.job, s.rank) for s in sidecar.table.snapshot()] == [("job-a", 1)], "only our own rank is known"
        assert "forged-job" not in text and 'megaheal_loss{' not in text, "no forged rank, no forged NaN loss"
        assert sidecar.heartbeat_batch(1, time.time()).ranks[0].nonfinite == {}


def test_it_refuses_a_record_that_claims_a_pid_other_than_its_senders(tmp_path) -> None:
    with running_sidecar(tmp_path) as (sidecar, client):
        honest, liar = client(0), client(1)
        liar.pid = 1  # speaks for init: alive forever, so such a rank would never look dead
        honest.step(step_record(3, rank=0))
        liar.step(step_record(3, rank=1, loss=float("nan")))
        wait_for("the lie refused", lambda: sidecar.receiver.refused.get("pid-mismatch") == 2, timeout_s=10)
        assert [(s.rank, s.pid) for s in sidecar.table.snapshot()] == [(0, os.getpid())]


def test_it_creates_its_socket_directory_private_and_the_socket_for_its_user_only(tmp_path) -> None:
    sidecar = make_sidecar(tmp_path / "fresh" / "s.sock")
    try:
        assert stat.S_IMODE(os.stat(tmp_path / "fresh").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(tmp_path / "fresh" / "s.sock").st_mode) == 0o600
    finally:
        sidecar.stop()


@as_root
def test_it_refuses_a_socket_directory_another_user_owns_or_may_write(tmp_path) -> None:
    planted = tmp_path / "planted"  # as another user would plant /tmp/megaheal-<uid> before the sidecar starts
    planted.mkdir(mode=0o700)
    os.chown(planted, NOBODY, NOBODY)
    with pytest.raises(UnsafeSocketDirError, match=f"belongs to uid {NOBODY}"):
        make_sidecar(planted / "s.sock")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeSocketDirError, match="writable by others .mode 0777.: they could replace the socket"):
        make_sidecar(shared / "s.sock")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeSocketDirError, match="is not a directory"):
        make_sidecar(tmp_path / "link" / "s.sock")
    assert not (planted / "s.sock").exists() and not (shared / "s.sock").exists()


def test_it_forgets_a_rank_that_goes_silent_though_its_process_lives(tmp_path) -> None:
    with running_sidecar(tmp_path, forget_after_s=1.0) as (sidecar, client):
        client(0).hello()  # then silence, from this very live process
        wait_for("the rank to be seen", lambda: 'megaheal_rank_up{job="job-a"' in metrics(sidecar), timeout_s=10)
        text = wait_for("the silent rank forgotten", lambda: (t := metrics(sidecar)) and
                        'megaheal_rank_up{' not in t and t, timeout_s=10)
        assert 'megaheal_sidecar_forgotten_ranks_total{node="node-1"} 1.0' in text
        assert sidecar.heartbeat_batch(1, time.time()).ranks == []


def test_it_keeps_only_the_trainers_phase_names_and_counts_the_rest(tmp_path) -> None:
    with running_sidecar(tmp_path) as (sidecar, client):
        rank = client(0)
        for step in range(5):  # five new names every step: five new series a step, were they taken
            phases = {"forward_backward": 0.25, **{f"made_up_{step}_{i}": 0.001 for i in range(5)}}
            rank.step(step_record(step, phases=phases))
        wait_for("every step received", lambda: sidecar.receiver.received == 6, timeout_s=10)
        text = metrics(sidecar)
        seconds = [line for line in text.splitlines() if line.startswith("megaheal_step_seconds{")]
        assert {line.split('phase="')[1].split('"')[0] for line in seconds} == {"total", "forward_backward"}
        assert 'megaheal_sidecar_rejected_phases_total{node="node-1"} 25.0' in text
        assert sidecar.heartbeat_batch(1, time.time()).ranks[0].phases == {"forward_backward": 0.25}

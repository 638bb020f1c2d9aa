"""Secrets as files, not environment variables: a real `megaheal healer` logs in to a password-protected
PostgreSQL with the password from its file and a real `megaheal sidecar` authenticates with the token from its
file, so neither value sits in /proc/PID/environ, where every process of the same uid (the ranks, on a node) can
read it; and a process that made itself non-dumpable is closed to such processes altogether."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from tests.healer.services import MEGAHEAL, TOKEN, HealerProcess, Postgres, http, wait_for

pytestmark = pytest.mark.services


def _private(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def _exposed(pid: int, secret: str) -> bool:
    """Whether `secret` shows in the process's environment or command line."""
    return any(secret.encode() in Path(f"/proc/{pid}/{name}").read_bytes() for name in ("environ", "cmdline"))


def test_the_healer_logs_in_to_postgresql_with_the_password_from_its_file(tmp_path: Path) -> None:
    pg = Postgres(password="pw-" + secrets.token_hex(12))
    pg.start()
    try:
        url = pg.create_database("secrets")
        assert pg.password and pg.password not in url
        (tmp_path / "rules.yaml").write_text("")
        config = {"db": url, "rules": [str(tmp_path / "rules.yaml")], "probe_interval": "500ms"}
        healer = HealerProcess(tmp_path / "right", {**config, "db_password_file": _private(tmp_path / "pw", pg.password)})
        healer.start()  # ready: it logged in
        try:
            assert healer.proc is not None and not _exposed(healer.proc.pid, pg.password)
            assert http("GET", f"{healer.url}/v1/incidents") == (200, {"incidents": []})
        finally:
            healer.stop()
        wrong = HealerProcess(tmp_path / "wrong", {**config, "db_password_file": _private(tmp_path / "bad", "nope")})
        wrong.start(wait_ready=False)
        try:
            status, body = http("GET", f"{wrong.url}/readyz")
            assert status == 503 and "password authentication failed" in body["database"], body
        finally:
            wrong.stop()
        # The report of a run whose healer used this database: the same password file, and nowhere else.
        from wire.journal import Start, append
        from wire.run_paths import RunPaths

        run = tmp_path / "run"
        run.mkdir()
        append(RunPaths(run).journal, Start(job="run", attempt=0, at=1.0, nodes=["n1"]))
        report = subprocess.run([MEGAHEAL, "report", str(run), "--db", url, "--db-password-file",
                                 _private(tmp_path / "pw2", pg.password)], capture_output=True, text=True, timeout=120)
        assert report.returncode == 0 and (run / "report.json").exists(), report.stderr[-2000:]
        refused = subprocess.run([MEGAHEAL, "report", str(run), "--db", url], capture_output=True, text=True,
                                 timeout=120)
        assert refused.returncode == 2 and "password" in refused.stderr, refused.stderr[-2000:]
    finally:
        pg.stop()


def test_the_sidecar_authenticates_to_the_healer_with_the_token_from_its_file(tmp_path: Path) -> None:
    token_file = _private(tmp_path / "token", TOKEN + "\n")
    (tmp_path / "rules.yaml").write_text("")
    healer = HealerProcess(tmp_path / "healer", {"db": f"sqlite:///{tmp_path / 'h.db'}", "token_file": token_file,
                                                 "rules": [str(tmp_path / "rules.yaml")]}).start()
    env = {k: v for k, v in os.environ.items() if k != "MEGAHEAL_TOKEN"}
    sidecar = subprocess.Popen([MEGAHEAL, "sidecar", "--node", "n1", "--socket", str(tmp_path / "s.sock"),
                                "--metrics-addr", "127.0.0.1:0", "--healer-url", healer.url,
                                "--healer-token-file", token_file], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for("a heartbeat batch the healer accepted", lambda: _accepted(healer.url) >= 2, 30)
        assert not _exposed(sidecar.pid, TOKEN)
        assert _rejected_401(healer.url) == 0
    finally:
        sidecar.terminate()
        out, _ = sidecar.communicate(timeout=20)
        healer.stop()
    assert "Traceback" not in out


def test_the_sidecar_refuses_a_token_file_others_can_write(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o622)
    proc = subprocess.run([MEGAHEAL, "sidecar", "--node", "n1", "--socket", str(tmp_path / "s.sock"),
                           "--metrics-addr", "127.0.0.1:0", "--healer-url", "http://127.0.0.1:9",
                           "--healer-token-file", str(token_file)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is writable by its group and other users" in proc.stderr, proc.stderr


def _metric(url: str, pattern: str) -> float:
    status, text = http("GET", f"{url}/metrics")
    found = re.search("^" + pattern + "$", text, re.M) if status == 200 else None
    return float(found.group(1)) if found else 0.0


def _accepted(url: str) -> float:
    return _metric(url, r"megaheal_healer_heartbeat_batches_total (\S+)")


def _rejected_401(url: str) -> float:
    return _metric(url, r'megaheal_healer_requests_rejected_total\{endpoint="/v1/heartbeats",status="401"\} (\S+)')


# NOTE: runs as `nobody` to be a process "of the same uid" as another one; root can read anything, and the venv's
# interpreter may sit where nobody cannot exec it, so each child imports what it needs before dropping root.
_TARGET = """
import os, sys, ctypes
from ground.secretfile import forbid_inspection
os.setgid(65534); os.setuid(65534)
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again: changing uid made it non-dumpable by itself
print("open", flush=True); sys.stdin.readline()
forbid_inspection()
print("closed", flush=True); sys.stdin.readline()
"""
_READER = """
import os, sys
os.setgid(65534); os.setuid(65534)
try:
    print("read" if b"SECRET_FOR_TEST" in open(f"/proc/{sys.argv[1]}/environ", "rb").read() else "empty")
except PermissionError:
    print("denied")
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run two processes as another user")
def test_a_non_dumpable_process_is_closed_to_processes_of_its_own_uid() -> None:
    env = {**os.environ, "SECRET_FOR_TEST": "x" * 20, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    target = subprocess.Popen([sys.executable, "-c", _TARGET], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert target.stdin is not None and target.stdout is not None

    def read() -> str:
        return subprocess.run([sys.executable, "-c", _READER, str(target.pid)], capture_output=True, text=True,
                              timeout=30, env={k: v for k, v in env.items() if k != "SECRET_FOR_TEST"}).stdout.strip()

    try:
        assert target.stdout.readline().strip() == "open"
        assert read() == "read"  # what MEGAHEAL_TOKEN in a sidecar's environment was open to
        target.stdin.write("\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "closed"
        assert read() == "denied"
    finally:
        target.kill()
        target.wait(timeout=10)

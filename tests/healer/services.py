"""Real services for the healer tests, each on 127.0.0.1 in a temp dir, started and stopped by the tests:
PostgreSQL 15, Prometheus and Alertmanager (Debian packages, installed by scripts/install-system-deps.sh),
and the healer itself as a `megaheal healer` process.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from tests.support import free_port, service_ready, wait_for  # noqa: F401 - also used through this module

MEGAHEAL = str(Path(sys.executable).parent / "megaheal")
TOKEN = "test-token-0123456789abcdef"


def http(method: str, url: str, body: Any = None, token: str | None = TOKEN, raw: bytes | None = None,
         timeout: float = 10) -> tuple[int, Any]:
    """(status, decoded JSON or text) of one request; never raises on an HTTP error status."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def status_of(url: str, timeout: float = 2) -> int | None:
    """The status of GET `url`; None while nothing answers (not started yet, or refusing connections)."""
    try:
        return http("GET", url, timeout=timeout)[0]
    except OSError:
        return None


def post_oversized(url: str, size: int, token: str = TOKEN) -> int:
    """POST `size` bytes and return the status line's code. The server may answer 413 (and close) before the body is
    sent, which a plain client reports as a broken pipe, so this one sends what it can and then reads the answer."""
    from urllib.parse import urlparse

    parsed = urlparse(url)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
        head = (f"POST {parsed.path} HTTP/1.1\r\nHost: {parsed.netloc}\r\nAuthorization: Bearer {token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n")
        sock.sendall(head.encode())
        try:
            sock.sendall(b" " * size)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = sock.recv(4096).decode(errors="replace")
    return int(answer.split(" ", 2)[1])


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- PostgreSQL ------------------------------------------------------------------------------------------------

def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if not found:
        raise AssertionError(f"PostgreSQL's {name} is missing: run scripts/install-system-deps.sh (apt-get install postgresql)")
    return found


class Postgres:
    """A throwaway PostgreSQL cluster. initdb refuses to run as root, so as root it runs as `postgres`. With a
    `password`, clients must give it (scram-sha-256); without one, any client is trusted."""

    def __init__(self, password: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="megaheal-pg-"))
        self.port = free_port()
        self.user = "megaheal"
        self.password = password
        self._as: list[str] = []
        self._owner: tuple[int, int] | None = None
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            self._owner = (owner.pw_uid, owner.pw_gid)
            os.chown(self.dir, *self._owner)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, argv: list[str]) -> None:
        proc = subprocess.run(self._as + argv, capture_output=True, text=True, timeout=60, cwd="/")
        if proc.returncode != 0:
            raise AssertionError(f"{argv[0]} failed ({proc.returncode}): {proc.stdout}\n{proc.stderr}")

    def start(self) -> None:
        data = self.dir / "data"
        auth = ["--auth=trust"]
        if self.password is not None:
            pwfile = self.dir / "pwfile"
            pwfile.write_text(self.password + "\n")
            if self._owner:
                os.chown(pwfile, *self._owner)
            auth = ["--auth=scram-sha-256", f"--pwfile={pwfile}"]
        self._run([_pg_bin("initdb"), "-D", str(data), "-U", self.user, *auth, "--no-sync", "-E", "UTF8"])
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off -c full_page_writes=off"
        self._run([_pg_bin("pg_ctl"), "-D", str(data), "-w", "-t", "60", "-l", str(self.dir / "log"), "-o", opts, "start"])

    def stop(self) -> None:
        try:
            self._run([_pg_bin("pg_ctl"), "-D", str(self.dir / "data"), "-m", "immediate", "stop"])
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(dbname="postgres", **self._login(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(dbname="postgres", **self._login(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _login(self) -> dict[str, Any]:
        login: dict[str, Any] = {"host": "127.0.0.1", "port": self.port, "user": self.user}
        return login if self.password is None else {**login, "password": self.password}


# ---- Prometheus and Alertmanager -------------------------------------------------------------------------------



class Alertmanager:
    def __init__(self, tmp: Path, webhook_url: str, token: str = TOKEN) -> None:
        self.dir, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "route": {"receiver": "healer", "group_by": ["alertname", "incident", "node"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h",
                      # The healer's own incidents come back through Alertmanager; real configs route them to on-call.
                      "routes": [{"matchers": ['alertname="MegahealIncident"'], "receiver": "null"}]},
            "receivers": [{"name": "healer", "webhook_configs": [{
                "url": webhook_url, "send_resolved": True,
                "http_config": {"authorization": {"type": "Bearer", "credentials": token}}}]},
                {"name": "null"}],
        }
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["prometheus-alertmanager", f"--config.file={self.dir / 'alertmanager.yml'}",
             f"--storage.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--cluster.listen-address="],
            stdout=subprocess.DEVNULL, stderr=(self.dir / "alertmanager.log").open("w"))
        wait_for("Alertmanager to be ready", lambda: service_ready(self.url, self.proc, "alertmanager"), 30)

    def stop(self) -> None:
        if self.proc:
            _stop(self.proc)


class Prometheus:
    def __init__(self, tmp: Path, target: str, alertmanager: str, rules: list[dict[str, Any]]) -> None:
        self.dir, self.port = tmp, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "test", "interval": "1s", "rules": rules}]}))
        config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(tmp / "rules.yml")],
                  "alerting": {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]},
                  "scrape_configs": [{"job_name": "faults", "honor_labels": True,
                                      "static_configs": [{"targets": [target]}]}]}
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=(self.dir / "prometheus.log").open("w"))
        wait_for("Prometheus to be ready", lambda: service_ready(self.url, self.proc, "prometheus"), 30)

    def stop(self) -> None:
        if self.proc:
            _stop(self.proc)


# ---- the healer ----------------------------------------------------------------------------------------------

class HealerProcess:
    """`megaheal healer` with a config file written from `config` (a mapping)."""

    def __init__(self, tmp: Path, config: dict[str, Any], name: str = "healer") -> None:
        self.dir = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = int(config["listen"].rsplit(":", 1)[1]) if "listen" in config else free_port()
        config = {"listen": f"127.0.0.1:{self.port}", "instance": name, **config}
        self.config_path = tmp / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait_ready: bool = True) -> HealerProcess:
        env = {**os.environ, "MEGAHEAL_TOKEN": TOKEN, "XDG_STATE_HOME": str(self.dir / "state")}
        env.pop("MEGAHEAL_DB", None)
        self.proc = subprocess.Popen([MEGAHEAL, "healer", "--config", str(self.config_path)], env=env,
                                     stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        wait_for(f"{self.url}/healthz", self._answers, 30)
        if wait_ready:
            wait_for(f"{self.url}/readyz", lambda: http("GET", f"{self.url}/readyz")[0] == 200, 30)
        return self

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"healer exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            return http("GET", f"{self.url}/healthz", timeout=2)[0] == 200
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc:
            _stop(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        if self.proc:
            _stop(self.proc)

    def incidents(self, *states: str) -> list[dict[str, Any]]:
        query = "&".join(f"state={s}" for s in states)
        status, body = http("GET", f"{self.url}/v1/incidents?{query}")
        assert status == 200, body
        return list(body["incidents"])

    def incident(self, incident_id: int) -> dict[str, Any]:
        status, body = http("GET", f"{self.url}/v1/incidents/{incident_id}")
        assert status == 200, body
        return dict(body)


def webhook(alerts: list[dict[str, Any]]) -> dict[str, Any]:
    """An Alertmanager webhook payload (version 4) around `alerts` (each: status, labels[, annotations])."""
    return {"version": "4", "groupKey": "{}:{}", "truncatedAlerts": 0, "status": "firing", "receiver": "healer",
            "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am",
            "alerts": [{"annotations": {}, "startsAt": "2024-01-01T00:00:00Z", "endsAt": "0001-01-01T00:00:00Z",
                        "generatorURL": "http://prom", "fingerprint": f"{i:016x}", **a} for i, a in enumerate(alerts)]}

"""docker-compose.yml brought up for real: compose v1 against podman's Docker API, with the images of
scripts/build-images.sh.

What the tier changes, and only that, lives in the project's own directory (Stack.dir):
- secret files and an env file (free loopback ports, the host's socket directory, runc for the sidecar);
- deploy/prometheus with 2 s scrape and evaluation intervals and each alert's `for:` cut to ALERT_FOR: the rules'
  expressions, labels and routing are the shipped ones, a node-down alert just does not take two minutes; its
  sidecar target file is put in place once the sidecar serves;
- deploy/alertmanager with the on-call receiver's PagerDuty URL set to a closed port inside its own container:
  pages are attempted (and counted) but nothing leaves the machine.
Grafana, Tempo and the OpenTelemetry Collector have no image here (no Debian package): the tier starts the named
services only, and the sidecar's OTLP exports fail quietly as they do when a collector is down."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.containers.engine import PROJECT_LABEL, REPO, podman, podman_json
from tests.deploy.configs import ALERTMANAGER_DIR, PROMETHEUS_DIR
from tests.support import free_port

COMPOSE_FILE = REPO / "docker-compose.yml"
IMAGES_ENV = REPO / "build" / "images.env"
SERVICES = ("prometheus", "alertmanager", "postgres", "healer", "sidecar")
SECRETS = ("megaheal_token", "postgres_password", "grafana_admin_password", "oncall_routing_key")
# The sidecar's uid (MEGAHEAL_UID) and the ranks': the sidecar takes records from its own uid only. root here, not
# the image's 10001: the host's Python (and so the ranks') lives under root's private home, which 10001 cannot enter.
RANK_UID = 0
ALERT_FOR = "6s"
INTERVAL = "2s"
CLOSED_PORT_URL = "http://127.0.0.1:9/v2/enqueue"


@dataclass
class Stack:
    project: str
    dir: Path
    docker_host: str
    log_dir: Path
    ports: dict[str, int] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict)

    @property
    def socket_dir(self) -> Path:
        return self.dir / "sock"

    @classmethod
    def prepare(cls, project: str, docker_host: str, log_dir: Path) -> Stack:
        # Outside pytest's tmp_path: compose's bind mounts and the ranks' socket path must stay short and plain.
        root = Path(tempfile.mkdtemp(prefix=f"{project}-"))
        root.chmod(0o755)
        stack = cls(project, root, docker_host, log_dir, ports={s: free_port() for s in ("prometheus", "alertmanager", "healer")})
        stack._write_secrets()
        stack._write_prometheus()
        stack._write_alertmanager()
        stack.socket_dir.mkdir(mode=0o700)
        os.chown(stack.socket_dir, RANK_UID, RANK_UID)
        stack._write_env()
        return stack

    def _write_secrets(self) -> None:
        sdir = self.dir / "secrets"
        sdir.mkdir(mode=0o700)
        for name in SECRETS:
            self.secrets[name] = secrets.token_urlsafe(24)
            path = sdir / name
            path.write_text(self.secrets[name])
            path.chmod(0o644)  # read by each container's own user (docs/operations.md, "Secrets")

    def _write_prometheus(self) -> None:
        conf = self.dir / "prometheus"
        shutil.copytree(PROMETHEUS_DIR, conf, ignore=shutil.ignore_patterns("tests"))
        config = yaml.safe_load((conf / "prometheus.yml").read_text())
        config["global"].update(scrape_interval=INTERVAL, evaluation_interval=INTERVAL)
        (conf / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        # No sidecar target until the sidecar serves (scrape_sidecar): with `for:` cut to seconds, the half minute the
        # sidecar waits for the healer's health check would be a node-down alert of its own.
        (conf / "targets" / "sidecars.yml").write_text("[]\n")
        alerts = conf / "rules" / "alerts.yml"
        alerts.write_text(re.sub(r"(?m)^(\s+for:) \S+$", rf"\1 {ALERT_FOR}", alerts.read_text()))
        _world_readable(conf)

    def _write_alertmanager(self) -> None:
        conf = self.dir / "alertmanager"
        shutil.copytree(ALERTMANAGER_DIR, conf)
        config = yaml.safe_load((conf / "alertmanager.yml").read_text())
        (oncall,) = [r for r in config["receivers"] if r["name"] == "oncall"]
        for pd in oncall["pagerduty_configs"]:
            pd["url"] = CLOSED_PORT_URL
        (conf / "alertmanager.yml").write_text(yaml.safe_dump(config, sort_keys=False))
        _world_readable(conf)

    def _write_env(self) -> None:
        assert IMAGES_ENV.exists(), f"{IMAGES_ENV} missing: scripts/build-images.sh writes it"
        lines = [IMAGES_ENV.read_text(),
                 f"MEGAHEAL_TOKEN_FILE={self.dir}/secrets/megaheal_token",
                 f"POSTGRES_PASSWORD_FILE={self.dir}/secrets/postgres_password",
                 f"GRAFANA_ADMIN_PASSWORD_FILE={self.dir}/secrets/grafana_admin_password",
                 f"MEGAHEAL_ONCALL_ROUTING_KEY_FILE={self.dir}/secrets/oncall_routing_key",
                 f"PROMETHEUS_PORT={self.ports['prometheus']}",
                 f"ALERTMANAGER_PORT={self.ports['alertmanager']}",
                 f"HEALER_PORT={self.ports['healer']}",
                 f"MEGAHEAL_SOCKET_DIR={self.socket_dir}",
                 f"MEGAHEAL_UID={RANK_UID}",
                 "MEGAHEAL_SIDECAR_RUNTIME=runc",
                 "MEGAHEAL_NODE=node-1"]
        (self.dir / "env").write_text("\n".join(lines) + "\n")
        override = {"services": {
            "prometheus": {"volumes": [f"{self.dir}/prometheus:/etc/prometheus:ro", "prometheus-data:/prometheus"]},
            "alertmanager": {"volumes": [f"{self.dir}/alertmanager:/etc/alertmanager:ro",
                                         "alertmanager-data:/alertmanager"]}}}
        (self.dir / "override.yml").write_text(yaml.safe_dump(override))

    def scrape_sidecar(self) -> None:
        """Give Prometheus deploy/'s sidecar target file (file discovery picks it up at once)."""
        target = self.dir / "prometheus" / "targets" / "sidecars.yml"
        shutil.copyfile(PROMETHEUS_DIR / "targets" / "sidecars.yml", target)
        target.chmod(0o644)

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        argv = ["docker-compose", "--env-file", str(self.dir / "env"), "-f", str(COMPOSE_FILE),
                "-f", str(self.dir / "override.yml"), "-p", self.project, *args]
        done = subprocess.run(argv, cwd=REPO, env=dict(os.environ) | {"DOCKER_HOST": self.docker_host},
                              capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"docker-compose {' '.join(args)}: exit {done.returncode}:\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-3000:]}\n{self.logs()}")
        return done

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def containers(self) -> list[dict[str, Any]]:
        """Every container of the project, running or not (podman inspect of each)."""
        ids = podman("ps", "-a", "-q", "--filter", f"label={PROJECT_LABEL}={self.project}").stdout.split()
        return podman_json("inspect", "--type", "container", *ids) if ids else []

    def volumes(self) -> list[str]:
        return podman("volume", "ls", "-q", "--filter", f"label={PROJECT_LABEL}={self.project}").stdout.split()

    def networks(self) -> list[str]:
        return [n["name"] for n in podman_json("network", "ls", "--format", "json")
                if n["name"].startswith(f"{self.project}_")]

    def health(self) -> dict[str, str]:
        """service -> podman's health status, for the services that have a check."""
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c["State"]["Health"]["Status"]
                for c in self.containers() if c["Config"].get("Healthcheck")}

    def psql(self, sql: str) -> list[list[str]]:
        """Rows of `sql` in the healer's database, read with psql inside the postgres container."""
        out = podman("exec", self.container("postgres"), "psql", "-U", "megaheal", "-d", "megaheal", "-AtF", "\t",
                     "-c", sql).stdout
        return [line.split("\t") for line in out.splitlines() if line]

    def get(self, service: str, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[service]}{path}", timeout=5) as r:
            body = r.read()
        return json.loads(body) if body.startswith((b"{", b"[")) else body.decode()

    def save_logs(self) -> None:
        """Every service's whole log into log_dir (SERVICE.log)."""
        for service in SERVICES:
            done = podman("logs", self.container(service), check=False)
            (self.log_dir / f"{service}.log").write_text(done.stdout + done.stderr)

    def logs(self) -> str:
        parts = []
        for service in SERVICES:
            done = podman("logs", "--tail", "15", self.container(service), check=False)
            parts.append(f"--- {service}\n{(done.stdout + done.stderr).strip()}")
        return "\n".join(parts)


def _world_readable(tree: Path) -> None:
    """Prometheus and Alertmanager run as nobody in their containers."""
    for path in [tree, *tree.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)

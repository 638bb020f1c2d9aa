"""What a local user on the monitoring host or a node can reach through the deployment (docs/operations.md,
"What a local user can and cannot do"): Prometheus cannot be stopped or reloaded over HTTP (checked on a real
Prometheus started with the compose file's own flags), and no secret reaches a container through its environment
or its command line, where every process of the same uid could read it in /proc."""

from __future__ import annotations

import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from healer.service.config import load_config
from tests.deploy.configs import COMPOSE, DEPLOY, load_yaml
from tests.support import free_port, service_ready, wait_for

pytestmark = pytest.mark.services

SECRET_NAME = re.compile(r"PASSWORD|TOKEN|SECRET|KEY", re.I)
# Flags of the compose command that only say where things are: replaced by this test's own.
PLACES = ("--config.file", "--storage.tsdb.path", "--storage.tsdb.retention.time", "--web.listen-address")


def _post(url: str) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=b"", method="POST"), timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_prometheus_run_with_the_compose_flags_cannot_be_stopped_or_reloaded_over_http(tmp_path: Path) -> None:
    flags = [f for f in load_yaml(COMPOSE)["services"]["prometheus"]["command"] if not f.startswith(PLACES)]
    (tmp_path / "prometheus.yml").write_text("global: {scrape_interval: 1m}\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                             *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for("Prometheus", lambda: service_ready(url, proc, "prometheus"), 30)
        assert _post(f"{url}/-/quit") == 403  # any local user could otherwise stop it with one request
        assert _post(f"{url}/-/reload") == 403
        assert proc.poll() is None and service_ready(url, proc, "prometheus")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def _command(service: dict[str, Any]) -> str:
    parts = [service.get("entrypoint") or [], service.get("command") or []]
    return " ".join(p if isinstance(p, str) else " ".join(map(str, p)) for p in parts)


def test_no_secret_reaches_a_container_through_its_environment_or_command_line() -> None:
    services = load_yaml(COMPOSE)["services"]
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            assert not SECRET_NAME.search(key) or key.endswith("__FILE") or key.endswith("_FILE"), (
                f"{name}: {key} passes a secret as an environment variable")
            assert "/run/secrets" not in str(value) or key.endswith("_FILE"), f"{name}: {key}"
        command = _command(service)
        assert "$(cat" not in command and "$$(cat" not in command, f"{name}: a secret read into a shell variable"
    healer = load_config(str(DEPLOY / "healer" / "healer.yaml"))
    assert healer.db_password_file == "/run/secrets/postgres_password" and healer.token_file == "/run/secrets/megaheal_token"
    assert {"postgres_password", "megaheal_token"} <= set(services["healer"]["secrets"])
    sidecar = _command(services["sidecar"])
    assert "--token-file /run/secrets/megaheal_token" in sidecar and "megaheal_token" in services["sidecar"]["secrets"]

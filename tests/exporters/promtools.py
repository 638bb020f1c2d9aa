"""Real Prometheus for the tests: a server on loopback with its own storage, and promtool's metrics lint.

Prometheus and promtool come from Debian (scripts/install-system-deps.sh, run by `make test`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.support import free_port, service_ready, stop_process, wait_for  # noqa: F401 - also used through this module


def promtool_check_metrics(exposition: str) -> tuple[int, list[str]]:
    """promtool's verdict on a text exposition: (exit code, problems). 0 is clean, 3 lint problems only."""
    proc = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"], input=exposition,
                          capture_output=True, text=True, timeout=30)
    return proc.returncode, [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; the result vector ([] when nothing matches yet)."""
        qs = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{qs}", timeout=5) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]["result"]


@contextmanager
def running_prometheus(tmp: Path, targets: list[str], scrape_interval: str = "1s") -> Iterator[Prometheus]:
    config = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
              # NOTE: honor_labels keeps the sidecar's own `job` label (the training job) instead of renaming it
              # exported_job under the scrape job's name; production scrape configs of sidecars need it too.
              "scrape_configs": [{"job_name": "megaheal-sidecar", "honor_labels": True,
                                  "static_configs": [{"targets": targets}]}]}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("prometheus") or "prometheus", f"--config.file={tmp / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("Prometheus to be ready", lambda: service_ready(url, proc, "prometheus"), timeout_s=30)
        yield Prometheus(url)
    finally:
        stop_process(proc)



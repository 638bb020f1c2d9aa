"""A promql rule's incident names the node the series is about, under whichever label the exporter gave it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from healer.decide.promql import PrometheusClient, PromqlEvaluator
from healer.decide.rules import load_rules

pytestmark = pytest.mark.unit

RULE = "- name: gpu-hot\n  when: {promql: 'DCGM_FI_DEV_GPU_TEMP > 90', for: 0s}\n"


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A Prometheus query API on loopback answering every instant query with the series the test puts in."""
    series: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                {"metric": labels, "value": [0, "95"]} for labels in series]}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", series
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(("labels", "node"), [
    ({"node": "n1", "Hostname": "h1", "instance": "n1:9471"}, "n1"),
    ({"Hostname": "gpu-node-7", "gpu": "0", "instance": "10.0.0.7:9400"}, "gpu-node-7"),
    ({"hostname": "gpu-node-8", "gpu": "0", "instance": "10.0.0.8:9400"}, "gpu-node-8"),
    ({"instance": "10.0.0.9:9400"}, "10.0.0.9:9400"),
])
def test_the_incident_names_the_node_from_node_then_dcgm_exporters_hostname_then_instance(
        tmp_path: Path, prometheus: tuple[str, list[dict[str, str]]], labels: dict[str, str], node: str) -> None:
    url, series = prometheus
    series.append({"__name__": "DCGM_FI_DEV_GPU_TEMP", **labels})
    (tmp_path / "rules.yaml").write_text(RULE)
    [rule] = load_rules([tmp_path / "rules.yaml"])
    result = PromqlEvaluator(PrometheusClient(url)).evaluate(rule, now=0.0)
    assert result.error is None and [s.node for s in result.firing] == [node]

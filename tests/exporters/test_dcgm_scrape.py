"""GPU readings from a site's dcgm-exporter: a real HTTP server on loopback serves a recorded dcgm-exporter scrape
(tests/fixtures/dcgm/), the sidecar reads it instead of NVML, and its heartbeat reaches the healer's gpu_fault
detector; failures leave the GPUs absent, are counted, and hold up nothing else."""

from __future__ import annotations

import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporters.dcgm_scrape import DcgmScrape, ScrapeError, parse
from exporters.nvml_collector import GPU_LABELS
from exporters.nvml_recorder import INHERITED_LINT
from exporters.sidecar import Sidecar
from ground.gpu_faults import CRITICAL_XIDS
from healer.detect.gpu_fault import GpuFault
from healer.observe.heartbeats import parse_batch
from tests.exporters.promtools import promtool_check_metrics, wait_for
from wire.telemetry import encode_batch

pytestmark = pytest.mark.unit

SCRAPE = Path(__file__).resolve().parents[1] / "fixtures" / "dcgm" / "dcgm_exporter_h100x2.prom"
RECORDED = SCRAPE.read_text()
GPU1 = {"gpu": "1", "UUID": "GPU-d2e94b07-81c6-4f3a-b5d8-0a7c3e9f1b26", "pci_bus_id": "00000000:2A:00.0",
        "device": "nvidia1", "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-node-7",
        "DCGM_FI_DRIVER_VERSION": "550.90.07"}


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a scraper that gave up on a slow answer closed the connection: what those tests do


class DcgmEndpoint:
    """A dcgm-exporter-shaped /metrics on loopback: serves `body` with `status`, after `delay_s`."""

    def __init__(self, body: str = RECORDED) -> None:
        self.body, self.status, self.delay_s = body, 200, 0.0
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                time.sleep(endpoint.delay_s)
                data = endpoint.body.encode()
                self.send_response(endpoint.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:
                pass

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint():
    e = DcgmEndpoint()
    yield e
    e.close()


def dcgm_sidecar(tmp_path, url: str, **dcgm) -> Sidecar:
    cfg = Sidecar.Config(node="node-7", socket_path=str(tmp_path / "s.sock"), metrics_addr="127.0.0.1:0",
                         dcgm=DcgmScrape.Config(url=url, **({"interval_s": 0.05, "timeout_s": 0.5} | dcgm)))
    return Sidecar(cfg, nvml=None)


def scrape_metrics(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    code, problems = promtool_check_metrics(text)
    assert code in (0, 3) and all(p.endswith(INHERITED_LINT) for p in problems), problems
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


# ---------------------------------------------------------------- parsing


def test_it_reads_every_gpu_of_a_recorded_scrape_under_dcgm_exporters_own_labels() -> None:
    scrape = parse(RECORDED)
    assert sorted(scrape.gpus) == [0, 1]
    gpu1 = scrape.gpus[1]
    assert list(gpu1.labels) == GPU_LABELS and gpu1.labels == GPU1, "the Xid gauge's err_code/err_msg are not the GPU's"
    assert gpu1.values["DCGM_FI_DEV_XID_ERRORS"] == 48 and gpu1.values["DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"] == 1
    assert gpu1.values["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == 7419983127, "a counter keeps dcgm's name"
    assert scrape.gpus[0].prof == {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.987613, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.462117,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.351904, "DCGM_FI_PROF_PCIE_TX_BYTES": 21873411,
        "DCGM_FI_PROF_PCIE_RX_BYTES": 98213377}


def test_dcgms_no_value_sentinels_and_non_finite_values_are_no_readings() -> None:
    text = RECORDED
    for field, sentinel in (("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "9223372036854775794"),
                            ("DCGM_FI_PROF_DRAM_ACTIVE", "140737488355328.000000"),
                            ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "NaN")):
        old = next(line for line in text.splitlines() if line.startswith(field + '{gpu="1"'))
        text = text.replace(old, old.rpartition(" ")[0] + " " + sentinel)
    gpu1 = parse(text).gpus[1].values
    assert not {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_PROF_DRAM_ACTIVE", "DCGM_FI_DEV_ROW_REMAP_FAILURE"} & set(gpu1)
    assert gpu1["DCGM_FI_DEV_XID_ERRORS"] == 48


@pytest.mark.parametrize("text", ["", "# HELP up x\n# TYPE up gauge\nup 1\n", "DCGM_FI_DEV_GPU_TEMP{gpu=\"0\" 41\n"])
def test_text_that_is_no_dcgm_exporter_scrape_is_refused(text: str) -> None:
    with pytest.raises(ScrapeError):
        parse(text)


def test_a_bad_config_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="url"):
        DcgmScrape.Config(url="localhost:9400/metrics")
    with pytest.raises(ValueError, match="timeout_s"):
        DcgmScrape.Config(url="http://127.0.0.1:9400/metrics", timeout_s=0)


def test_the_sidecar_does_not_take_the_port_of_dcgm_exporter_or_node_exporter(tmp_path) -> None:
    port = int(Sidecar.Config(node="n", socket_path=str(tmp_path / "s")).metrics_addr.rpartition(":")[2])
    assert port not in (9100, 9400)


# ---------------------------------------------------------------- the sidecar in dcgm mode


def test_the_sidecar_in_dcgm_mode_sends_the_scraped_gpus_and_the_healer_sees_the_xid(tmp_path, endpoint) -> None:
    sidecar = dcgm_sidecar(tmp_path, endpoint.url)
    sidecar.start()
    try:
        wait_for("the first scrape", lambda: sidecar.dcgm.up, timeout_s=10)
        batch = parse_batch(encode_batch(sidecar.heartbeat_batch(0, time.time())))  # the healer's own decoding
        metrics = scrape_metrics(sidecar.metrics_url)
    finally:
        sidecar.stop()
    assert batch.nvml == "ok" and [g.gpu for g in batch.gpus] == [0, 1]
    healthy, faulty = batch.gpus
    assert faulty.uuid == GPU1["UUID"] and faulty.last_xid == 48 and faulty.xid_counts == {"48": 1}
    assert faulty.ecc_dbe_volatile == 1 and faulty.uncorrectable_remapped_rows == 1
    detector = GpuFault(GpuFault.Config())
    assert detector.faults(healthy) == []
    assert "Xid 48 x1" in detector.faults(faulty)
    xid = {(s.labels["gpu"], s.labels["xid"]): s for s in metrics["megaheal_gpu_xid_errors"]}
    assert xid[("1", "48")].value == 1.0, "48 is critical: its 0 was served before it counted"
    assert xid[("1", "48")].labels == GPU1 | {"xid": "48"}, "dcgm-exporter's labels, so it joins with its series"
    assert {k: s.value for k, s in xid.items() if k[0] == "0"} == {("0", str(c)): 0.0 for c in CRITICAL_XIDS}
    assert metrics["megaheal_sidecar_dcgm_up"][0].value == 1 and metrics["megaheal_sidecar_nvml_up"][0].value == 1
    assert not [name for name in metrics if name.startswith("DCGM_FI_")], "not served twice unless asked"


def test_republish_serves_the_scraped_series_prof_included_under_dcgm_labels(tmp_path, endpoint) -> None:
    sidecar = dcgm_sidecar(tmp_path, endpoint.url, republish=True)
    sidecar.start()
    try:
        wait_for("the first scrape", lambda: sidecar.dcgm.up, timeout_s=10)
        metrics = scrape_metrics(sidecar.metrics_url)
    finally:
        sidecar.stop()
    tensor = {s.labels["gpu"]: s for s in metrics["DCGM_FI_PROF_PIPE_TENSOR_ACTIVE"]}
    assert tensor["1"].labels == GPU1 and tensor["0"].value == pytest.approx(0.462117)
    assert {s.name for s in metrics["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]} == {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"}
    xid_gauge = {s.labels["gpu"]: s.labels for s in metrics["DCGM_FI_DEV_XID_ERRORS"]}
    assert xid_gauge["1"]["err_code"] == "48", "served as dcgm-exporter serves it"


def test_a_failing_endpoint_leaves_the_gpus_absent_is_counted_and_recovers(tmp_path, endpoint) -> None:
    scraper = DcgmScrape(DcgmScrape.Config(url=endpoint.url, timeout_s=0.3, max_bytes=64 * 1024), "node-7")
    assert scraper.scrape_once() and scraper.up
    failures = {
        "server error": lambda: setattr(endpoint, "status", 500),
        "not an exposition": lambda: setattr(endpoint, "body", "<html>dcgm is restarting</html>"),
        "too large": lambda: setattr(endpoint, "body", RECORDED * 40),
        "too slow": lambda: setattr(endpoint, "delay_s", 0.6),
    }
    for n, (why, fail) in enumerate(failures.items(), start=1):
        fail()
        assert not scraper.scrape_once(), why
        assert (scraper.up, scraper.health(), scraper.failures) == (False, [], n), why
        endpoint.body, endpoint.status, endpoint.delay_s = RECORDED, 200, 0.0
    assert scraper.scrape_once() and [g.gpu for g in scraper.health()] == [0, 1]
    endpoint.close()
    assert not scraper.scrape_once() and scraper.failures == 5, "nothing listening"


def test_a_hung_endpoint_holds_up_neither_metrics_nor_heartbeats(tmp_path, endpoint) -> None:
    endpoint.delay_s = 3.0
    sidecar = dcgm_sidecar(tmp_path, endpoint.url, timeout_s=2.0)
    sidecar.start()
    try:
        started = time.monotonic()
        metrics = scrape_metrics(sidecar.metrics_url)
        batch = sidecar.heartbeat_batch(0, time.time())
        assert time.monotonic() - started < 1.0
    finally:
        endpoint.delay_s = 0.0
        sidecar.stop()
    assert metrics["megaheal_sidecar_dcgm_up"][0].value == 0 and "megaheal_gpu_xid_errors" not in metrics
    assert (batch.nvml, batch.gpus) == ("absent", [])


def test_each_change_of_the_last_xid_counts_one_event_and_a_new_code_is_seen_at_zero_first(endpoint) -> None:
    scraper = DcgmScrape(DcgmScrape.Config(url=endpoint.url), "node-7")

    def step(last_xid: int) -> tuple[dict[str, int], float | None]:
        endpoint.body = RECORDED.replace('err_code="48",err_msg="Double Bit ECC Error"} 48',
                                         f'err_code="{last_xid}",err_msg="x"}} {last_xid}')
        assert scraper.scrape_once()
        counts = scraper.health()[1].xid_counts
        served = {s.labels["xid"]: s.value for f in scraper.collect() if f.name == "megaheal_gpu_xid_errors"
                  for s in f.samples if s.labels["gpu"] == "1"}
        return counts, served.get("13")

    assert step(0) == ({}, None)
    assert step(48) == ({"48": 1}, None)
    assert step(48) == ({"48": 1}, None), "the same last Xid again is no new event"
    assert step(13) == ({"48": 1, "13": 1}, 0.0), "13 is no critical code: served at 0 first"
    assert step(13) == ({"48": 1, "13": 1}, 1.0), "then at its count"

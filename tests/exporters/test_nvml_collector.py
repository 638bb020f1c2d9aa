"""The NVML collector against a recorded device: dcgm-exporter's names, labels and values; failures stay local."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pynvml
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporters.nvml_collector import FAMILIES, GPU_LABELS, NvmlCollector, open_nvml
from exporters.nvml_recorder import INHERITED_LINT, lint, record_gpu, record_node
from exporters.xid import XidWatcher
from ground.gpu_faults import CRITICAL_XIDS
from tests.exporters.promtools import promtool_check_metrics
from tests.exporters.recorded_nvml import DCGM_SAMPLE, RecordedNvml

pytestmark = pytest.mark.unit

EXPECTED = [gpu["expected_dcgm"] for gpu in json.loads(DCGM_SAMPLE.read_text())["gpus"]]


def render(nvml: RecordedNvml, xid: XidWatcher | None = None) -> tuple[str, dict[str, list]]:
    registry = CollectorRegistry()
    NvmlCollector(nvml, "gpu-node-1", xid=xid, registry=registry)
    text = generate_latest(registry).decode()
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    return text, families


def by_gpu(samples) -> dict[str, float]:
    return {s.labels["gpu"]: s.value for s in samples}


def test_every_family_renders_dcgm_exporters_values_and_labels() -> None:
    text, families = render(RecordedNvml())
    assert set(families) == {f.name for f in FAMILIES}
    for name, samples in families.items():
        assert len(samples) == 2, name
        for s in samples:
            assert list(s.labels) == GPU_LABELS or set(s.labels) == set(GPU_LABELS), s.labels
    for gpu, expected in enumerate(EXPECTED):
        for name, want in expected.items():
            if name == "DCGM_FI_DEV_XID_ERRORS":
                continue  # needs the Xid watcher: below
            assert by_gpu(families[name])[str(gpu)] == pytest.approx(want), (name, gpu)
    h100 = families["DCGM_FI_DEV_GPU_TEMP"][0].labels
    assert h100 == {"gpu": "0", "UUID": "GPU-c4529c8d-69c4-b61d-e0bc-7b2460096005", "pci_bus_id": "00000000:53:00.0",
                    "device": "nvidia0", "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-node-1",
                    "DCGM_FI_DRIVER_VERSION": "550.90.07"}
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION untyped" in text, "dcgm's counter names are kept as-is"
    code, problems = promtool_check_metrics(text)
    assert code in (0, 3) and problems, problems
    assert all(p.startswith("DCGM_FI_") and p.endswith(INHERITED_LINT) for p in problems), problems


def test_a_failing_read_drops_only_its_own_samples() -> None:
    nvml = RecordedNvml()
    nvml.not_supported("nvmlDeviceGetRemappedRows")  # e.g. a GPU without row remapping: all GPUs
    nvml.not_supported("nvmlDeviceGetFieldValues", gpu=1)  # one GPU's field reads fail
    _, families = render(nvml)
    remap = {"DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
             "DCGM_FI_DEV_ROW_REMAP_PENDING", "DCGM_FI_DEV_ROW_REMAP_FAILURE"}
    assert set(families) == {f.name for f in FAMILIES} - remap
    assert by_gpu(families["DCGM_FI_DEV_MEMORY_TEMP"]) == {"0": 33.0}
    assert by_gpu(families["DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"]) == {"0": 0.0}
    assert by_gpu(families["DCGM_FI_DEV_SM_CLOCK"]) == {"0": 345.0, "1": 1215.0}, "other families are whole"


def test_an_injected_xid_moves_the_gauge_and_the_counter() -> None:
    nvml = RecordedNvml()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)]
    watcher = XidWatcher(nvml, handles)
    assert watcher.poll(0) == 0, "no event: a timeout, not an error"
    _, families = render(nvml, watcher)
    assert by_gpu(families["DCGM_FI_DEV_XID_ERRORS"]) == {"0": 0.0, "1": 0.0}
    assert {s.value for s in families["megaheal_gpu_xid_errors"]} == {0.0}, "critical codes are born at 0"
    for xid in (79, 79, 48):
        nvml.inject_xid(1, xid)
        assert watcher.poll(0) == 1
    text, families = render(nvml, watcher)
    assert by_gpu(families["DCGM_FI_DEV_XID_ERRORS"]) == {"0": 0.0, "1": 48.0}, "the gauge holds the last Xid"
    _, problems = promtool_check_metrics(text)
    # The Xid counter carries the GPU labels of dcgm-exporter (modelName included) so that it joins with them.
    assert all(p.startswith(("DCGM_FI_", "megaheal_gpu_xid_errors_total ")) and p.endswith(INHERITED_LINT)
               for p in problems), problems
    counts = {(s.labels["gpu"], s.labels["xid"]): s.value for s in families["megaheal_gpu_xid_errors"] if s.value}
    assert counts == {("1", "48"): 1.0, ("1", "79"): 2.0}, "two Xid 79 in a row are two"
    collector = NvmlCollector(nvml, "gpu-node-1", xid=watcher)
    health = {h.gpu: h for h in collector.health()}
    assert health[1].last_xid == 48 and health[1].xid_counts == {"79": 2, "48": 1}
    assert health[0].row_remap_failure == 0 and health[0].recovery_action == 0
    watcher.stop()


def test_a_gpu_without_xid_events_is_skipped_by_the_watcher() -> None:
    nvml = RecordedNvml()
    nvml.not_supported("nvmlDeviceRegisterEvents", gpu=0)
    watcher = XidWatcher(nvml, [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)])
    assert watcher.watched == [1]
    _, families = render(nvml, watcher)
    assert by_gpu(families["DCGM_FI_DEV_XID_ERRORS"]) == {"1": 0.0}


def test_without_a_driver_nvml_is_off_and_said_so_in_one_line(caplog) -> None:
    def no_driver() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    bindings = SimpleNamespace(nvmlInit=no_driver, NVMLError=pynvml.NVMLError)
    with caplog.at_level(logging.INFO, logger="exporters"):
        assert open_nvml(bindings) is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "no NVIDIA driver" in lines[0] and "training metrics are served" in lines[0]


def test_a_recording_replays_to_the_same_exposition(tmp_path) -> None:
    # What bench/gpu_check.sh does on a real GPU (exporters.nvml_recorder), done here on the recorded one.
    source = RecordedNvml()
    source.not_supported("nvmlDeviceGetPcieReplayCounter", gpu=1)
    source.not_supported("nvmlDeviceGetFieldValues", gpu=0)
    recording = record_node(source)
    assert recording["driver_version"] == "550.90.07"
    assert record_gpu(source, 1) == recording["gpus"][1]
    assert recording["gpus"][1]["pcie_replay"] == "NotSupported" and recording["gpus"][0]["field_values"] == {}
    (tmp_path / "rec.json").write_text(json.dumps(recording))
    original, _ = render(source)
    replayed, families = render(RecordedNvml(tmp_path / "rec.json"))
    assert replayed == original
    assert by_gpu(families["DCGM_FI_DEV_PCIE_REPLAY_COUNTER"]) == {"0": 0.0}
    assert lint(replayed) == [], "only dcgm-exporter's inherited naming lint"


def test_the_driver_label_is_left_out_where_the_driver_version_cannot_be_read(tmp_path) -> None:
    recording = json.loads(DCGM_SAMPLE.read_text())
    del recording["driver_version"]
    (tmp_path / "rec.json").write_text(json.dumps(recording))
    _, families = render(RecordedNvml(tmp_path / "rec.json"))
    assert set(families["DCGM_FI_DEV_GPU_TEMP"][0].labels) == set(GPU_LABELS[:-1]), "as dcgm-exporter does"


def xid_series(text_families: dict[str, list]) -> dict[tuple[str, str], float]:
    return {(s.labels["gpu"], s.labels["xid"]): s.value for s in text_families["megaheal_gpu_xid_errors"]}


def test_an_xid_counter_is_seen_at_zero_before_it_counts_so_increase_sees_the_first_event() -> None:
    nvml = RecordedNvml()
    watcher = XidWatcher(nvml, [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(2)])
    registry = CollectorRegistry()
    NvmlCollector(nvml, "gpu-node-1", xid=watcher, registry=registry)

    def scrape() -> dict[tuple[str, str], float]:
        return xid_series({f.name: f.samples for f in text_string_to_metric_families(
            generate_latest(registry).decode())})

    before = scrape()
    assert before == {(str(g), str(x)): 0.0 for g in (0, 1) for x in CRITICAL_XIDS}, "critical: at 0 from the start"
    for xid in (79, 13):  # 13 (graphics engine exception) is no critical code: it has no series yet
        nvml.inject_xid(0, xid)
        assert watcher.poll(0) == 1
    first = scrape()
    assert first[("0", "79")] == 1.0, "a critical code counts at once: its 0 was scraped before"
    assert first[("0", "13")] == 0.0, "a new code is shown at 0 first"
    assert scrape()[("0", "13")] == 1.0, "and counts from the next scrape"
    watcher.stop()

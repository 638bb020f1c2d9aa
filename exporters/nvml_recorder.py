"""Record a real GPU for the tests: what NVML answers, in the fixture format the recorded NVML replays.

Run on a machine with an NVIDIA driver (bench/gpu_check.sh does):

    .venv/bin/python -m exporters.nvml_recorder --out tests/fixtures/nvml

It writes `<model>.json` (the device's answers to every call the collector makes; NotSupported is
recorded as such) and `<model>.prom` (the collector's exposition), and, where promtool is installed, runs
`promtool check metrics` on the exposition, accepting only the lint that dcgm-exporter's own names and labels carry.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from exporters.nvml_collector import NvmlCollector, open_nvml

# promtool's complaints about names we keep on purpose (dcgm-exporter's), so dashboards work unchanged.
INHERITED_LINT = ("label names should be written in 'snake_case' not 'camelCase'",
                  "metric name should not include type 'counter'")
FIELDS = ("NVML_FI_DEV_MEMORY_TEMP", "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
          "NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
          "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION")
NOT_SUPPORTED = "NotSupported"


def _answer(nvml: Any, call: Any) -> Any:
    try:
        return call()
    except nvml.NVMLError as exc:
        return NOT_SUPPORTED if exc.value == nvml.NVML_ERROR_NOT_SUPPORTED else f"NVMLError {exc.value}"


def record_gpu(nvml: Any, index: int) -> dict[str, Any]:
    """One GPU's answers, keyed like tests/fixtures/nvml/*.json."""
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    text = (lambda v: v.decode() if isinstance(v, bytes) else str(v))
    util = _answer(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(h))
    mem = _answer(nvml, lambda: nvml.nvmlDeviceGetMemoryInfo(h))
    rows = _answer(nvml, lambda: nvml.nvmlDeviceGetRemappedRows(h))
    fields = {}
    for name in FIELDS:
        value = _answer(nvml, lambda: nvml.nvmlDeviceGetFieldValues(h, [getattr(nvml, name)])[0])
        if isinstance(value, str) or value.nvmlReturn != nvml.NVML_SUCCESS:
            continue  # absent from the recording = the device does not answer it
        member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
        fields[name] = {"type": value.valueType, "value": getattr(value.value, member[value.valueType])}
    ok = (lambda v: not isinstance(v, str))
    return {
        "name": text(nvml.nvmlDeviceGetName(h)), "uuid": text(nvml.nvmlDeviceGetUUID(h)),
        "pci_bus_id": text(nvml.nvmlDeviceGetPciInfo(h).busId), "minor_number": nvml.nvmlDeviceGetMinorNumber(h),
        "utilization": {"gpu": util.gpu, "memory": util.memory} if ok(util) else util,
        "memory_bytes": {"total": mem.total, "free": mem.free, "used": mem.used} if ok(mem) else mem,
        "temperature_gpu": _answer(nvml, lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
        "power_mw": _answer(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(h)),
        "energy_mj": _answer(nvml, lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h)),
        "clocks_mhz": {"sm": _answer(nvml, lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                       "mem": _answer(nvml, lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM))},
        "clocks_event_reasons": _answer(nvml, lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
        "pcie_replay": _answer(nvml, lambda: nvml.nvmlDeviceGetPcieReplayCounter(h)),
        "ecc_volatile": {
            kind: _answer(nvml, lambda t=t: nvml.nvmlDeviceGetTotalEccErrors(h, t, nvml.NVML_VOLATILE_ECC))
            for kind, t in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                            ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED))},
        "remapped_rows": dict(zip(("correctable", "uncorrectable", "pending", "failure"), rows)) if ok(rows) else rows,
        "violation_ns": {
            kind: _answer(nvml, lambda p=p: nvml.nvmlDeviceGetViolationStatus(h, p).violationTime)
            for kind, p in (("thermal", nvml.NVML_PERF_POLICY_THERMAL), ("power", nvml.NVML_PERF_POLICY_POWER))},
        "field_values": fields,
    }


def record_node(nvml: Any) -> dict[str, Any]:
    """The node's answers: its driver version (the DCGM_FI_DRIVER_VERSION label) and every GPU's (record_gpu)."""
    driver = _answer(nvml, lambda: nvml.nvmlSystemGetDriverVersion())
    return {"driver_version": driver.decode() if isinstance(driver, bytes) else driver,
            "gpus": [record_gpu(nvml, i) for i in range(nvml.nvmlDeviceGetCount())]}


def lint(exposition: str) -> list[str] | None:
    """promtool's problems with the exposition, minus those inherited from dcgm-exporter's naming; None where
    promtool is not installed (a GPU machine's image may have none: lint the .prom file elsewhere)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    proc = subprocess.run([promtool, "check", "metrics"], input=exposition, capture_output=True, text=True,
                          timeout=60)
    problems = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return [p for p in problems if not p.endswith(INHERITED_LINT)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/nvml"))
    args = parser.parse_args(argv)
    nvml = open_nvml()
    if nvml is None:
        return 2
    recording = {"about": f"Recorded from a real GPU on {socket.gethostname()} by exporters.nvml_recorder.",
                 **record_node(nvml)}
    registry = CollectorRegistry()
    NvmlCollector(nvml, socket.gethostname(), registry=registry)
    exposition = generate_latest(registry).decode()
    stem = re.sub(r"[^a-z0-9]+", "-", recording["gpus"][0]["name"].lower()).strip("-") if recording["gpus"] else "none"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(recording, indent=1) + "\n")
    (args.out / f"{stem}.prom").write_text(exposition)
    problems = lint(exposition)
    verdict = ("not on PATH, not linted (run `promtool check metrics < FILE.prom` where it is)" if problems is None
               else problems or "clean apart from dcgm-exporter naming")
    print(f"recorded {len(recording['gpus'])} GPU(s) to {args.out / stem}.json and .prom; promtool: {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

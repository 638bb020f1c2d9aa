"""The GPU dashboard, on dcgm-exporter's names and labels (Hostname, gpu, UUID; exporters/nvml_collector.py's
HOST_LABEL), so it also works on nodes that run dcgm-exporter instead of the megaheal sidecar; Xids come from the
sidecar's per-code counter.

Health panels (Xid, ECC, remapped rows, NVLink, clock event reasons) come first: they say whether a GPU must
leave the job. Utilisation, temperature, power, clocks and memory follow.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from dashboards.common import REF_IDS, datasource_variable, label_variable, link, prom, proms
from ground.gpu_faults import CRITICAL_XIDS

UID = "megaheal-gpus"
GPUS = 'Hostname=~"$node", gpu=~"$gpu"'

# NVML clock event reasons (DCGM_FI_DEV_CLOCKS_EVENT_REASONS is their bitmask): PromQL has no bitwise
# operators on values, so each bit is taken out arithmetically: floor(x / bit) % 2.
CLOCK_EVENT_BITS = (("SW power cap", 4), ("HW slowdown", 8), ("SW thermal", 32), ("HW thermal", 64),
                    ("Power brake", 128))


def _series(title: str, targets, unit: str, description: str, span: int = 12) -> timeseries.Panel:
    return (timeseries.Panel().title(title).description(description).targets(targets).unit(unit).height(8)
            .span(span).fill_opacity(10))


def _health_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Health: does a GPU have to leave the job?"))
    board.with_panel(
        table.Panel().title("Xid errors in range").height(8).span(12)
        .description("Xid events per GPU and code over the dashboard's range (from the per-code counter; "
                     f"DCGM_FI_DEV_XID_ERRORS only keeps the last code). {', '.join(map(str, CRITICAL_XIDS))} "
                     "need a reset or a drain (docs/operations.md).")
        .with_target(prom(f"sum by (Hostname, gpu, xid) (increase(megaheal_gpu_xid_errors_total{{{GPUS}}}[$__range]))"
                          " > 0", table=True)))
    board.with_panel(_series("Last Xid", proms((f"DCGM_FI_DEV_XID_ERRORS{{{GPUS}}}", "{{Hostname}} GPU {{gpu}}")),
                             "none", "The code of each GPU's most recent Xid (dcgm-exporter's gauge)."))
    board.with_panel(_series("ECC errors (per second)", proms(
        (f"rate(DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{{{GPUS}}}[$__rate_interval])", "uncorrectable {{Hostname}}/{{gpu}}"),
        (f"rate(DCGM_FI_DEV_ECC_SBE_VOL_TOTAL{{{GPUS}}}[$__rate_interval])", "corrected {{Hostname}}/{{gpu}}")),
        "cps", "Volatile ECC errors: any uncorrectable one is an alert; a rising corrected rate is a trend.", span=8))
    board.with_panel(_series("Remapped rows", proms(
        (f"DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS{{{GPUS}}}", "uncorrectable {{Hostname}}/{{gpu}}"),
        (f"DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS{{{GPUS}}}", "correctable {{Hostname}}/{{gpu}}"),
        (f"DCGM_FI_DEV_ROW_REMAP_PENDING{{{GPUS}}}", "pending {{Hostname}}/{{gpu}}"),
        (f"DCGM_FI_DEV_ROW_REMAP_FAILURE{{{GPUS}}}", "FAILED {{Hostname}}/{{gpu}}")),
        "none", "Rows of HBM retired by remapping; pending applies at the next GPU reset; a failure is an RMA.",
        span=8))
    board.with_panel(
        stat.Panel().title("Recovery action requested").height(8).span(8)
        .description("What the driver asks for (NVML field 230): 0 none, 1 GPU reset, 2 node reboot, "
                     "3 drain P2P, 4 drain and reset.")
        .with_target(prom(f"max by (Hostname, gpu) (DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION{{{GPUS}}})",
                          "{{Hostname}} GPU {{gpu}}", instant=True))
        .color_mode(common.BigValueColorMode.BACKGROUND))
    board.with_panel(_series("NVLink errors (per second)", proms(
        (f"sum by (Hostname, gpu) (rate(DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL{{{GPUS}}}[$__rate_interval]))",
         "CRC flit {{Hostname}}/{{gpu}}"),
        (f"sum by (Hostname, gpu) (rate(DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL{{{GPUS}}}[$__rate_interval]))",
         "CRC data {{Hostname}}/{{gpu}}"),
        (f"sum by (Hostname, gpu) (rate(DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL{{{GPUS}}}[$__rate_interval]))",
         "replay {{Hostname}}/{{gpu}}"),
        (f"sum by (Hostname, gpu) (rate(DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL{{{GPUS}}}[$__rate_interval]))",
         "recovery {{Hostname}}/{{gpu}}")),
        "cps", "NVLink CRC, replay and recovery errors: a link that keeps erring slows every collective over it."))
    board.with_panel(_series("Clock event reasons", [
        prom(f"floor(DCGM_FI_DEV_CLOCKS_EVENT_REASONS{{{GPUS}}} / {bit}) % 2 > 0", f"{name} {{{{Hostname}}}}/{{{{gpu}}}}",
             REF_IDS[i]) for i, (name, bit) in enumerate(CLOCK_EVENT_BITS)],
        "none", "Why the clocks are held down right now (1 while the reason holds); idle is left out."))
    board.with_panel(_series("Time throttled", proms(
        (f"rate(DCGM_FI_DEV_THERMAL_VIOLATION{{{GPUS}}}[$__rate_interval]) / 1e6", "thermal {{Hostname}}/{{gpu}}"),
        (f"rate(DCGM_FI_DEV_POWER_VIOLATION{{{GPUS}}}[$__rate_interval]) / 1e6", "power {{Hostname}}/{{gpu}}")),
        "percentunit", "Share of time the clocks were held down by temperature or by the power limit."))


def _usage_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Utilisation, temperature, power, clocks, memory"))
    board.with_panel(_series("GPU utilisation", proms((f"DCGM_FI_DEV_GPU_UTIL{{{GPUS}}}", "{{Hostname}}/{{gpu}}")),
                             "percent", "Share of time a kernel was running (not how busy the SMs were)."))
    board.with_panel(_series("Memory copy utilisation", proms(
        (f"DCGM_FI_DEV_MEM_COPY_UTIL{{{GPUS}}}", "{{Hostname}}/{{gpu}}")), "percent",
        "Share of time device memory was being read or written."))
    board.with_panel(_series("Temperature", proms(
        (f"DCGM_FI_DEV_GPU_TEMP{{{GPUS}}}", "GPU {{Hostname}}/{{gpu}}"),
        (f"DCGM_FI_DEV_MEMORY_TEMP{{{GPUS}}}", "HBM {{Hostname}}/{{gpu}}")), "celsius",
        "GPU and memory temperature.", span=8))
    board.with_panel(_series("Power", proms((f"DCGM_FI_DEV_POWER_USAGE{{{GPUS}}}", "{{Hostname}}/{{gpu}}")),
                             "watt", "Power draw.", span=8))
    board.with_panel(_series("Clocks", proms((f"DCGM_FI_DEV_SM_CLOCK{{{GPUS}}}", "SM {{Hostname}}/{{gpu}}"),
                                             (f"DCGM_FI_DEV_MEM_CLOCK{{{GPUS}}}", "memory {{Hostname}}/{{gpu}}")),
                             "MHz", "SM and memory clocks; a GPU below its peers is throttled.", span=8))
    board.with_panel(_series("Framebuffer used", proms(
        (f"DCGM_FI_DEV_FB_USED{{{GPUS}}} / (DCGM_FI_DEV_FB_USED{{{GPUS}}} + DCGM_FI_DEV_FB_FREE{{{GPUS}}})",
         "{{Hostname}}/{{gpu}}")), "percentunit", "Device memory in use."))
    board.with_panel(_series("PCIe replays (per second)", proms(
        (f"rate(DCGM_FI_DEV_PCIE_REPLAY_COUNTER{{{GPUS}}}[$__rate_interval])", "{{Hostname}}/{{gpu}}")), "cps",
        "PCIe retries: a rising rate points at a riser, a slot or a cable."))


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard("megaheal / GPUs").uid(UID).tags(["megaheal", "gpu"]).refresh("30s")
        .time("now-3h", "now").timezone("utc").tooltip(model.DashboardCursorSync.CROSSHAIR)
        .description("GPU health (Xid, ECC, remapped rows, NVLink, clock event reasons) and usage, "
                     "on dcgm-exporter's metric names.")
        .with_variable(datasource_variable("prometheus"))
        .with_variable(label_variable("node", "DCGM_FI_DEV_GPU_UTIL", "Hostname", multi=True, label_text="Node"))
        .with_variable(label_variable("gpu", 'DCGM_FI_DEV_GPU_UTIL{Hostname=~"$node"}', "gpu", multi=True,
                                      label_text="GPU"))
        # NOTE: the training dashboard's uid, written out: it links here, and importing it here would be a cycle.
        .link(link("Training", "/d/megaheal-training/megaheal-training?${datasource:queryparam}",
                   "The training dashboard (pick the job there)."))
    )
    _health_row(board)
    _usage_row(board)
    return board

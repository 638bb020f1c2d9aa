"""The fault catalogue (healer.decide.catalogue) is the one list of GPU Xids: the Prometheus alert rules, the shipped
runbooks' gpu_health steps, the operations guide and Alertmanager's inhibition agree with it.

NOTE: the alert rule is checked against the catalogue rather than generated from it: the Xid set is one regex in a
hand-written, commented rule file, and a failure here names the codes to add or drop.
"""

from __future__ import annotations

import re

import pytest

from ground.gpu_faults import CRITICAL_XIDS, DEGRADED_XIDS
from healer.decide.catalogue import CATALOGUE
from runbooks.checks.gpu_health import GpuHealthCheck
from runbooks.checks.xid_log import XidEvent
from runbooks.registry import CheckContext
from runbooks.spec import load_runbook, shipped_runbooks
from tests.deploy.configs import ALERTMANAGER, ALERTS, OPERATIONS, load_yaml, rules
from tests.runbooks.fake_nvml import FakeNvml, h200
from wire.verdict import Status

pytestmark = pytest.mark.unit

# A label matcher on `xid` inside a PromQL expression: xid=~"48|79", xid="79", xid!~"...".
XID_MATCHER = re.compile(r'\bxid\s*(=~|!~|!=|=)\s*"([^"]*)"')


def xid_matchers(expr: str) -> list[tuple[str, list[str]]]:
    return [(op, value.split("|")) for op, value in XID_MATCHER.findall(expr)]


def test_it_fires_the_xid_alert_on_exactly_the_catalogues_critical_xids() -> None:
    matched = {rule["alert"]: xid_matchers(rule["expr"]) for rule in rules(ALERTS) if "alert" in rule}
    assert matched.get("MegahealGpuCriticalXid"), "the critical-Xid alert is gone or no longer selects by xid"
    for alert, matchers in matched.items():
        for op, codes in matchers:
            # Plain codes only: a character class or a range would select codes this comparison cannot see.
            assert op == "=~" and all(c.isdigit() for c in codes), f"{alert}: xid{op}{'|'.join(codes)}"
            assert len(codes) == len(set(codes)), f"{alert}: a code given twice in {'|'.join(codes)}"
            extra, missing = set(map(int, codes)) - set(CRITICAL_XIDS), set(CRITICAL_XIDS) - set(map(int, codes))
            assert not extra and not missing, f"{alert}: not critical {sorted(extra)}, missing {sorted(missing)}"


def test_it_fails_a_gpu_in_every_shipped_runbook_on_the_catalogues_xids() -> None:
    gpu_steps = [(name, step) for name in shipped_runbooks() for step in load_runbook(name).steps
                 if step.check == "gpu_health"]
    assert {name for name, _ in gpu_steps} >= {"gpu-triage", "hang-triage"}
    for name, step in gpu_steps:
        assert sorted(step.config.fail_xids) == sorted(CRITICAL_XIDS), f"{name}.{step.name} fail_xids"
        assert sorted(step.config.degraded_xids) == sorted(DEGRADED_XIDS), f"{name}.{step.name} degraded_xids"


@pytest.mark.parametrize(("code", "status"), [*((x, Status.FAIL) for x in CRITICAL_XIDS),
                                              *((x, Status.DEGRADED) for x in DEGRADED_XIDS),
                                              (13, Status.PASS)])  # 13: an application's own fault
def test_it_judges_a_gpu_by_the_catalogue_class_of_its_xid(code: int, status: Status) -> None:
    gpu = h200(bus_id="00000000:3B:00.0")
    xid = XidEvent(bus="0000:3b:00", code=code, message=f"Xid {code}", monotonic_s=0.0)
    check = GpuHealthCheck(nvml=FakeNvml([gpu]), xid_reader=lambda window_s: [xid])
    result = check.run(GpuHealthCheck.Config(), CheckContext(hostname="gpu-node-7"))
    assert result.status is status, result.summary


def test_it_lists_the_catalogues_critical_xids_in_the_operations_guide() -> None:
    section = OPERATIONS.read_text().split("### MegahealGpuCriticalXid", 1)[1].split("\n#", 1)[0]
    # The first paragraph lists the codes, each followed by what it means: "(46 GPU stopped processing, 48 ...)".
    listed = re.search(r"\(([^)]*)\)", section)
    assert listed, "the section lists the critical Xids in parentheses"
    codes = {int(c) for c in re.findall(r"\b(\d{2,3})\b", listed.group(1))}
    assert codes == set(CRITICAL_XIDS), f"documented {sorted(codes)}, catalogue {sorted(CRITICAL_XIDS)}"


def test_it_holds_the_fleet_gpu_alerts_back_for_the_catalogues_gpu_fault_kind() -> None:
    inhibitions = load_yaml(ALERTMANAGER)["inhibit_rules"]
    kinds = [m.split("=", 1)[1].strip('"') for rule in inhibitions for m in rule["source_matchers"]
             if m.startswith("kind=")]
    assert kinds == ["gpu_fault"] and "gpu_fault" in CATALOGUE, kinds


def test_the_gpu_fault_detector_evicts_on_exactly_the_catalogues_critical_xids() -> None:
    from healer.detect.gpu_fault import GpuFault
    from wire.telemetry import GpuEntry

    assert sorted(GpuFault.Config().xids) == sorted(CRITICAL_XIDS)
    detector = GpuFault(GpuFault.Config())
    for code in CRITICAL_XIDS:
        assert detector.faults(GpuEntry(gpu=0, xid_counts={str(code): 1})), code
    for code in DEGRADED_XIDS:
        assert not detector.faults(GpuEntry(gpu=0, xid_counts={str(code): 1})), code

"""The deployment configs are valid for the tools that load them, and say what they promise: promtool
(config, rules, rule unit tests), amtool (config and routing), docker-compose v1 (the compose file)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from healer.decide.rules import load_rules
from healer.service.config import load_config
from tests.deploy.configs import (
    ALERT_TESTS,
    ALERTMANAGER,
    ALERTS,
    COMPOSE,
    DEPLOY,
    OPERATIONS,
    PROMETHEUS_DIR,
    RECORDING,
    RUNBOOK_TEMPLATE,
    load_yaml,
    markdown_anchors,
    rules,
    tool,
    unit_tests,
)

pytestmark = pytest.mark.services

# owner label -> the receiver Alertmanager sends the alert to, and only to it.
OWNERS = {"healer": "healer", "oncall": "oncall"}


def test_promtool_accepts_the_config_the_rules_and_their_unit_tests() -> None:
    config = tool("promtool", "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    assert "WARNING" not in config.stdout + config.stderr, "no target file glob may come up empty"
    checked = tool("promtool", "check", "rules", str(ALERTS), str(RECORDING))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert len(ALERT_TESTS) >= 2, "alerts_test.yml and ettr_test.yml"
    unit = tool("promtool", "test", "rules", *map(str, ALERT_TESTS))
    assert unit.returncode == 0 and unit.stdout.count("SUCCESS") == len(ALERT_TESTS), unit.stdout + unit.stderr


def test_every_alert_has_a_unit_test_a_runbook_and_an_owner() -> None:
    tested = {case["alertname"] for test in unit_tests() for case in test.get("alert_rule_test", [])
              if case.get("exp_alerts")}
    anchors = markdown_anchors(OPERATIONS)
    alerts = [r for r in rules(ALERTS) if "alert" in r]
    assert len(alerts) >= 7
    for rule in alerts:
        name = rule["alert"]
        assert name in tested, f"{name}: no promtool test shows it firing"
        runbook = rule["annotations"]["runbook_url"]
        assert runbook == f"{RUNBOOK_TEMPLATE}#{name.lower()}" and name.lower() in anchors, f"{name}: {runbook}"
        labels = rule["labels"]
        assert labels["component"] == "megaheal" and labels["owner"] in OWNERS, name
        assert labels["severity"] in ("warning", "critical") and labels["subsystem"], name
        # NOTE: routing is by owner alone; a `page` label beside it would be a second road that could contradict it.
        assert "page" not in labels, f"{name}: the owner decides who is told, not page"


def test_the_healer_is_sent_only_what_it_cannot_see_and_never_its_own_death() -> None:
    owners = {r["alert"]: r["labels"]["owner"] for r in rules(ALERTS) if "alert" in r}
    # The faults of a job under megaheal (a silent rank, an MFU drop, restarts) are the detectors' and the restart
    # budget's: no Prometheus alert duplicates them, and none of theirs is routed to the healer.
    assert {a for a, o in owners.items() if o == "healer"} == {"MegahealNodeDown", "MegahealTelemetryAbsent"}
    assert owners["MegahealHealerDown"] == "oncall"
    assert all(o == "oncall" for a, o in owners.items() if a.startswith("MegahealGpu"))
    # A job failing its ETTR objective while the healer heals every incident: the healer cannot mend that.
    assert {a: o for a, o in owners.items() if a.startswith("MegahealEttr")} == dict.fromkeys(
        ("MegahealEttrFastBurn", "MegahealEttrSlowBurn", "MegahealEttrBudgetBurn"), "oncall")


def test_the_healer_has_one_notify_or_escalate_rule_per_alert_it_is_sent_and_no_other() -> None:
    to_healer = {r["alert"] for r in rules(ALERTS) if "alert" in r and r["labels"]["owner"] == "healer"}
    loaded = load_rules([DEPLOY / "healer" / "rules"])
    named = [rule.condition.alert for rule in loaded]  # type: ignore[union-attr]
    assert sorted(named) == sorted(to_healer), "one rule per alert routed to the healer, none for the others"
    # The service has no launcher (it cannot restart or exclude), and a runbook would run on the healer's own host.
    assert all(rule.remediate in ("notify", "escalate") and rule.runbook is None for rule in loaded)
    config = load_config(str(DEPLOY / "healer" / "healer.yaml"))  # the healer's own loader: unknown keys fail
    assert config.token_file == "/run/secrets/megaheal_token" and config.alertmanager_urls
    assert "/etc/megaheal/rules" in config.rules and config.prometheus_url == "http://prometheus:9090"


def test_amtool_accepts_the_alertmanager_config() -> None:
    checked = tool("amtool", "check-config", str(ALERTMANAGER))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def routed(labels: dict[str, str]) -> str:
    """The receivers amtool's walk of the routing tree picks for an alert with `labels` (comma-separated)."""
    out = tool("amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER}",
               *(f"{k}={v}" for k, v in labels.items()))
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("rule", [r for r in rules(ALERTS) if "alert" in r], ids=lambda r: r["alert"])
def test_alertmanager_sends_each_alert_to_its_owner_alone(rule: dict[str, Any]) -> None:
    assert routed({"alertname": rule["alert"], **rule["labels"]}) == OWNERS[rule["labels"]["owner"]]


@pytest.mark.parametrize(("labels", "receivers"), [
    # The healer's own incidents never go back to the healer; those that page reach on-call.
    ({"alertname": "MegahealIncident", "kind": "gpu_fault", "page": "true"}, "oncall"),
    ({"alertname": "MegahealIncident", "kind": "gpu_fault", "page": "false"}, "blackhole"),
    # A megaheal alert without an owner reaches a person rather than nobody; someone else's is not swallowed.
    ({"alertname": "MegahealSomethingNew", "component": "megaheal"}, "oncall"),
    ({"alertname": "DiskFull"}, "oncall"),
])
def test_alertmanager_pages_the_healers_incidents_and_anything_unowned_to_oncall(labels: dict[str, str],
                                                                                  receivers: str) -> None:
    assert routed(labels) == receivers


def test_the_healer_webhook_is_authenticated_from_a_file_and_gpu_alerts_are_held_back_where_owned() -> None:
    config = load_yaml(ALERTMANAGER)
    healer = next(r for r in config["receivers"] if r["name"] == "healer")["webhook_configs"][0]
    assert healer["url"].endswith("/v1/alertmanager") and healer["send_resolved"]
    auth = healer["http_config"]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials_file"].startswith("/run/secrets/") and "credentials" not in auth
    node_down, gpu_fault, _ettr_ticket = config["inhibit_rules"]
    assert node_down["source_matchers"] == ['alertname="MegahealNodeDown"'] and node_down["equal"] == ["node"]
    assert gpu_fault["source_matchers"] == ['alertname="MegahealIncident"', 'kind="gpu_fault"']
    assert gpu_fault["equal"] == ["node"] and 'owner="oncall"' in gpu_fault["target_matchers"]
    gpu_alerts = [r for r in rules(ALERTS) if r.get("labels", {}).get("subsystem") == "gpu"]
    assert len(gpu_alerts) == 4
    assert all('subsystem="gpu"' in inhibit["target_matchers"] for inhibit in (node_down, gpu_fault))
    # The GPU alerts keep the node label the inhibitions match on (it comes from the target files).
    targets = load_yaml(PROMETHEUS_DIR / "targets" / "sidecars.yml")
    assert all("node" in group["labels"] for group in targets)
    assert all(" by (" not in r["expr"] or "node" in r["expr"] for r in gpu_alerts)


def test_each_ettr_alert_reads_burn_rates_that_are_recorded_over_a_long_and_a_twelfth_as_short_window() -> None:
    recorded = {r["record"]: r["expr"] for r in rules(RECORDING) if "record" in r}
    windows = {"5m": 300, "30m": 1800, "1h": 3600, "6h": 21600, "3d": 259200}
    for window, seconds in windows.items():
        ratio = recorded[f"job:megaheal_ettr_error:ratio_rate{window}"]
        assert f"[{window}]" in ratio and f", {seconds})" in ratio, f"{window}: the window and its clamp agree"
        assert f"job:megaheal_ettr_error_budget:burn_rate{window}" in recorded
    ettr = [r for r in rules(ALERTS) if r.get("labels", {}).get("subsystem") == "ettr"]
    assert {r["alert"]: r["labels"]["severity"] for r in ettr} == {
        "MegahealEttrFastBurn": "critical", "MegahealEttrSlowBurn": "critical", "MegahealEttrBudgetBurn": "warning"}
    for rule in ettr:
        (long, factor), (short, factor2) = re.findall(r"job:megaheal_ettr_error_budget:burn_rate(\w+) > ([\d.]+)",
                                                      rule["expr"])
        assert factor == factor2 and " and " in rule["expr"], rule["alert"]
        assert windows[long] == 12 * windows[short], f"{rule['alert']}: {long} and {short}"
        assert "for" not in rule, f"{rule['alert']}: the short window is the wait"


def test_a_jobs_ettr_burn_reaches_oncall_once_per_job_and_its_ticket_waits_while_it_pages() -> None:
    config = load_yaml(ALERTMANAGER)
    oncall = next(r for r in config["route"]["routes"] if r["matchers"] == ['component="megaheal"', 'owner="oncall"'])
    (ettr,) = oncall["routes"]
    assert ettr["matchers"] == ['subsystem="ettr"'] and ettr["group_by"] == ["alertname", "job"]
    assert "receiver" not in ettr, "on-call's, as the route above it"
    ticket = config["inhibit_rules"][2]
    assert ticket["source_matchers"] == ['component="megaheal"', 'subsystem="ettr"', 'severity="critical"']
    assert ticket["target_matchers"] == ['component="megaheal"', 'subsystem="ettr"', 'severity="warning"']
    assert ticket["equal"] == ["job"]


def test_docker_compose_v1_validates_the_stack() -> None:
    checked = tool("docker-compose", "-f", str(COMPOSE), "config", "--quiet")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    services = load_yaml(COMPOSE)["services"]  # also refuses a key given twice
    assert {"prometheus", "alertmanager", "grafana", "otel-collector", "tempo", "postgres", "healer",
            "sidecar"} <= set(services)
    for name, service in services.items():
        # `${PROMETHEUS_IMAGE:-prom/prometheus:v2.53.4}`: what make images built, else the pinned default.
        overridable = re.fullmatch(r"\$\{[A-Z_]+_IMAGE:-(.+)\}", service["image"])
        image = overridable.group(1) if overridable else service["image"]
        assert re.fullmatch(r"[\w./-]+:[\w.${}:-]+", image) and not image.endswith(":latest"), f"{name}: {image}"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        # NOTE: the collector's and Tempo's images are distroless: nothing inside can run a probe.
        assert "healthcheck" in service or name in ("otel-collector", "tempo"), f"{name} has no health check"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (COMPOSE.parent / source).exists(), f"{name} mounts missing {source}"
        env = " ".join(f"{k}={v}" for k, v in (service.get("environment") or {}).items())
        assert not re.search(r"(PASSWORD|TOKEN)=[^$/]", env), f"{name}: secret in env"
    assert services["sidecar"]["runtime"].endswith("nvidia}")


def test_traces_flow_from_the_sidecar_through_the_collector_to_tempo_and_grafana() -> None:
    """No Collector or Tempo binary can run here: check that the hops name each other's real endpoints."""
    services = load_yaml(COMPOSE)["services"]
    collector = load_yaml(DEPLOY / "otel" / "collector.yml")
    tempo = load_yaml(DEPLOY / "tempo" / "tempo.yml")
    sidecar_cmd = " ".join(services["sidecar"]["command"])
    http_port = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].rsplit(":", 1)[1]
    assert f"--otlp-endpoint http://otel-collector:{http_port}" in sidecar_cmd
    (exporter,) = collector["service"]["pipelines"]["traces"]["exporters"]
    tempo_grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1]
    assert collector["exporters"][exporter]["endpoint"] == f"tempo:{tempo_grpc}"
    assert collector["service"]["pipelines"]["traces"]["processors"][0] == "memory_limiter"
    sources = {d["type"]: d for d in
               load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "megaheal.yml")["datasources"]}
    assert sources["tempo"]["url"] == f"http://tempo:{tempo['server']['http_listen_port']}"
    assert sources["prometheus"]["url"] == "http://prometheus:9090"
    assert sources["grafana-postgresql-datasource"]["secureJsonData"]["password"].startswith("$__file{/run/secrets/")

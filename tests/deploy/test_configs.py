"""The deployment configs are valid for the tools that load them, and say what they promise: promtool
(config, rules, rule unit tests), amtool (config and routing), docker-compose v1 (the compose file)."""

from __future__ import annotations

import re

import pytest

from healer.service.config import load_config
from healer.core.rules import load_rules
from tests.deploy.configs import (ALERT_TESTS, ALERTMANAGER, ALERTS, COMPOSE, DEPLOY, OPERATIONS, PROMETHEUS_DIR,
                                  RECORDING, load_yaml, markdown_anchors, rules, tool)


def test_promtool_accepts_the_config_the_rules_and_their_unit_tests() -> None:
    config = tool("promtool", "check", "config", str(PROMETHEUS_DIR / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    assert "WARNING" not in config.stdout + config.stderr, "no target file glob may come up empty"
    checked = tool("promtool", "check", "rules", str(ALERTS), str(RECORDING))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    unit = tool("promtool", "test", "rules", str(ALERT_TESTS))
    assert unit.returncode == 0 and "SUCCESS" in unit.stdout, unit.stdout + unit.stderr


def test_every_alert_has_a_unit_test_a_runbook_and_routing_labels() -> None:
    tests = load_yaml(ALERT_TESTS)["tests"]
    tested = {case["alertname"] for test in tests for case in test.get("alert_rule_test", [])
              if case.get("exp_alerts")}
    anchors = markdown_anchors(OPERATIONS)
    alerts = [r for r in rules(ALERTS) if "alert" in r]
    assert len(alerts) >= 10
    for rule in alerts:
        name = rule["alert"]
        assert name in tested, f"{name}: no promtool test shows it firing"
        runbook = rule["annotations"]["runbook_url"]
        assert runbook == f"docs/operations.md#{name.lower()}" and name.lower() in anchors, f"{name}: {runbook}"
        labels = rule["labels"]
        assert labels["component"] == "megaheal" and labels["page"] in ("true", "false"), name
        assert labels["severity"] in ("warning", "critical") and labels["subsystem"], name


def test_the_healer_rules_of_the_stack_load_and_name_real_alerts() -> None:
    alert_names = {r["alert"] for r in rules(ALERTS) if "alert" in r}
    loaded = load_rules([DEPLOY / "healer" / "rules"])
    named = {rule.condition.alert for rule in loaded}  # type: ignore[union-attr]
    assert named <= alert_names, named - alert_names
    config = load_config(str(DEPLOY / "healer" / "healer.yaml"))  # the healer's own loader: unknown keys fail
    assert config.token_file == "/run/secrets/megaheal_token" and config.alertmanager_urls
    assert "/etc/megaheal/rules" in config.rules and config.prometheus_url == "http://prometheus:9090"


def test_amtool_accepts_the_alertmanager_config() -> None:
    checked = tool("amtool", "check-config", str(ALERTMANAGER))
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(("labels", "receivers"), [
    # megaheal alerts reach the healer; those a person must see reach on-call as well.
    ({"alertname": "MegahealGpuCriticalXid", "component": "megaheal", "page": "false"}, "healer"),
    ({"alertname": "MegahealHealerDown", "component": "megaheal", "page": "true"}, "healer,oncall"),
    # The healer's own incidents never go back to the healer; escalated ones page.
    ({"alertname": "MegahealIncident", "page": "true"}, "oncall"),
    ({"alertname": "MegahealIncident", "page": "false"}, "blackhole"),
    # Someone else's alert is not swallowed.
    ({"alertname": "DiskFull"}, "oncall"),
])
def test_alertmanager_routes_megaheal_alerts_to_the_healer_and_pages_to_oncall(labels: dict[str, str],
                                                                               receivers: str) -> None:
    routed = tool("amtool", "config", "routes", "test", f"--config.file={ALERTMANAGER}",
                  *(f"{k}={v}" for k, v in labels.items()))
    assert routed.stdout.strip() == receivers, routed.stdout + routed.stderr


def test_the_healer_webhook_is_authenticated_from_a_file_and_node_down_inhibits_gpu_alerts() -> None:
    config = load_yaml(ALERTMANAGER)
    healer = next(r for r in config["receivers"] if r["name"] == "healer")["webhook_configs"][0]
    assert healer["url"].endswith("/v1/alertmanager") and healer["send_resolved"]
    auth = healer["http_config"]["authorization"]
    assert auth["type"] == "Bearer" and auth["credentials_file"].startswith("/run/secrets/") and "credentials" not in auth
    (inhibit,) = config["inhibit_rules"]
    assert inhibit["source_matchers"] == ['alertname="MegahealNodeDown"'] and inhibit["equal"] == ["node"]
    gpu_alerts = [r for r in rules(ALERTS) if r.get("labels", {}).get("subsystem") == "gpu"]
    assert len(gpu_alerts) == 4 and 'subsystem="gpu"' in inhibit["target_matchers"]
    # The GPU alerts keep the node label the inhibition matches on (it comes from the target files).
    targets = load_yaml(PROMETHEUS_DIR / "targets" / "sidecars.yml")
    assert all("node" in group["labels"] for group in targets)
    assert all(" by (" not in r["expr"] or "node" in r["expr"] for r in gpu_alerts)


def test_docker_compose_v1_validates_the_stack() -> None:
    checked = tool("docker-compose", "-f", str(COMPOSE), "config", "--quiet")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    services = load_yaml(COMPOSE)["services"]  # also refuses a key given twice
    assert {"prometheus", "alertmanager", "grafana", "otel-collector", "tempo", "postgres", "healer",
            "sidecar"} <= set(services)
    for name, service in services.items():
        image = service["image"]
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
    sidecar_cmd = services["sidecar"]["command"][0]
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

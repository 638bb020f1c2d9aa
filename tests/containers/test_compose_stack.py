"""docker-compose.yml for real: its images built here (scripts/build-images.sh), brought up with compose v1 against
podman, a training job on the host writing to the sidecar's mounted socket. The tests share one stack and run in
file order: the stack's health and secrets, then the data path (Prometheus scrapes the sidecar, the recording rules
evaluate), then the two fault roads into the healer's PostgreSQL (a stopped rank through the sidecar's heartbeats,
a node down through Prometheus and Alertmanager), and last `down -v`."""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.parse
from typing import Any

import pytest

from ground import procfs
from tests.containers.conftest import RANKS
from tests.containers.engine import podman
from tests.containers.stack import SERVICES, Stack
from tests.support import wait_for

pytestmark = [pytest.mark.containers, pytest.mark.timeout(900)]


def query(stack: Stack, promql: str) -> list[dict[str, Any]]:
    result: list[dict[str, Any]] = stack.get("prometheus", "/api/v1/query?" + urllib.parse.urlencode({"query": promql}))["data"]["result"]
    return result


def incidents(stack: Stack, kind: str) -> list[list[str]]:
    return stack.psql(f"SELECT id, rule, state, node, summary FROM incidents WHERE kind = '{kind}' ORDER BY id")


def test_every_service_passes_its_own_health_check(stack: Stack) -> None:
    assert stack.health() == {s: "healthy" for s in SERVICES}, stack.logs()


def test_secrets_reach_the_containers_as_files_and_never_through_their_environment(stack: Stack) -> None:
    mounted: dict[str, set[str]] = {}
    for c in stack.containers():
        service = c["Config"]["Labels"]["com.docker.compose.service"]
        environment = "\n".join(c["Config"].get("Env") or [])
        for name, value in stack.secrets.items():
            assert value not in environment, f"{service}: the {name} secret is in its environment"
        mounted[service] = {m["Destination"] for m in c["Mounts"] if m["Destination"].startswith("/run/secrets/")}
    assert mounted["healer"] == {"/run/secrets/megaheal_token", "/run/secrets/postgres_password"}
    assert mounted["sidecar"] == {"/run/secrets/megaheal_token"}
    assert mounted["alertmanager"] == {"/run/secrets/megaheal_token", "/run/secrets/oncall_routing_key"}
    # The healer reached PostgreSQL with the password from its file (readyz checks the database).
    assert stack.get("healer", "/readyz") == {"ready": True, "database": "ok"}


def test_prometheus_scrapes_the_sidecars_training_series_and_the_recording_rules_evaluate(
        stack: Stack, training: subprocess.Popen[bytes]) -> None:
    steps = wait_for(f"megaheal_step of {RANKS} ranks from the sidecar",
                     lambda: (r := query(stack, 'megaheal_step{node="node-1"} > 2')) and len(r) == RANKS and r,
                     timeout_s=180, every_s=1)
    assert {s["metric"]["rank"] for s in steps} == {str(r) for r in range(RANKS)}
    (job,) = {s["metric"]["job"] for s in steps}
    mfu = wait_for("the job's MFU recording rule", lambda: query(stack, f'job:megaheal_mfu:avg{{job="{job}"}}'),
                   timeout_s=60, every_s=1)
    assert 0 < float(mfu[0]["value"][1]) < 1
    rules = [r for g in stack.get("prometheus", "/api/v1/rules")["data"]["groups"] for r in g["rules"]]
    assert rules and all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
    assert query(stack, 'up{job="megaheal-healer"} == 1'), "Prometheus does not scrape the healer"
    assert training.poll() is None, (stack.dir / "job.log").read_text()[-3000:]


def test_a_stopped_rank_opens_an_incident_in_the_healers_postgres_and_reaches_alertmanager(
        stack: Stack, training: subprocess.Popen[bytes]) -> None:
    ranks = {procfs.worker_rank(p): p for p in procfs.descendants(training.pid)}
    assert set(ranks) >= {0, 1}, f"the job's ranks: {ranks}"
    os.kill(ranks[1], signal.SIGSTOP)  # rank 0 then waits for it in the next all-reduce: the job hangs
    (incident,) = wait_for("a hang incident in PostgreSQL", lambda: incidents(stack, "hang"), timeout_s=120, every_s=1)
    assert incident[1] == "hang" and incident[3] == "node-1", incident
    # The stopped rank is named by its kernel state, which only the sidecar's heartbeats carry here (no node agent).
    assert "suspect rank(s) 1 (process stopped (state T))" in incident[4], incident
    alerts = wait_for("the healer's incident in Alertmanager", lambda: [
        a for a in stack.get("alertmanager", "/api/v2/alerts?" + urllib.parse.urlencode(
            {"filter": 'alertname="MegahealIncident"'})) if a["labels"].get("kind") == "hang"], timeout_s=60, every_s=1)
    assert alerts[0]["labels"]["incident"] == incident[0]


def test_a_node_down_alert_goes_from_prometheus_through_alertmanager_to_the_healers_postgres(stack: Stack) -> None:
    assert not incidents(stack, "node_down"), "a node_down incident before the sidecar stopped"
    podman("stop", "--time", "5", stack.container("sidecar"))
    wait_for("MegahealNodeDown firing", lambda: query(stack, 'ALERTS{alertname="MegahealNodeDown", alertstate="firing"}'),
             timeout_s=60, every_s=1)
    (incident,) = wait_for("a node_down incident in PostgreSQL", lambda: incidents(stack, "node_down"),
                           timeout_s=90, every_s=1)
    assert incident[1] == "node-down" and incident[3] == "node-1", incident
    metrics = stack.get("alertmanager", "/metrics")
    webhook = [line for line in metrics.splitlines()
               if line.startswith('alertmanager_notifications_total{integration="webhook"')]
    assert webhook and float(webhook[0].split()[-1]) >= 1, webhook


def test_compose_down_v_leaves_no_container_volume_or_network(stack: Stack) -> None:
    assert stack.containers() and stack.volumes()
    stack.save_logs()
    stack.compose("down", "-v", "--remove-orphans", timeout=180)
    assert stack.containers() == []
    assert stack.volumes() == []
    assert stack.networks() == []

"""Live: a real Prometheus loaded with deploy/prometheus (its config, recording and alert rules, file-based
discovery) scrapes a real 4-rank training through its real sidecar, and `megaheal run`'s goodput server (over a run
directory of a supervised run). Every PromQL expression of every dashboard and rule is run against it: all parse,
and the training, MFU, phase and run ones return data."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

from dashboards.build import load, queries
from healer.ledger.metrics import GoodputServer
from tests.conftest import CONFIGS, REPO, job_env, kill_job
from tests.deploy.configs import ALERTS, PROMETHEUS_DIR, RECORDING, rules
from tests.exporters.promtools import Prometheus
from tests.exporters.test_sidecar_e2e import start_sidecar
from tests.selfheal.test_goodput_metrics import write_run
from tests.support import free_port, service_ready, wait_for

pytestmark = pytest.mark.multiprocess
STEPS = 8


@contextmanager
def deployed_prometheus(tmp: Path, sidecar: str) -> Iterator[Prometheus]:
    """deploy/prometheus copied as is, but for its target files (this test's sidecar; the run's comes later, by
    `add_run_target`) and 1 s intervals."""
    conf_dir = tmp / "prometheus"
    shutil.copytree(PROMETHEUS_DIR, conf_dir)
    (conf_dir / "targets" / "sidecars.yml").write_text(
        yaml.safe_dump([{"targets": [sidecar], "labels": {"node": "node-1"}}]))
    for stale in (conf_dir / "targets" / "megaheal-run").glob("*.yml"):
        stale.unlink()
    config = yaml.safe_load((conf_dir / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    (conf_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("prometheus") or "prometheus", f"--config.file={conf_dir / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("w"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("Prometheus to be ready", lambda: service_ready(url, proc, "prometheus"), timeout_s=30)
        yield Prometheus(url)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def add_run_target(tmp: Path, run: str) -> None:
    """A supervised run's target file, as `megaheal run` leaves one: Prometheus's file discovery watches the folder.
    Written whole and renamed in, so Prometheus never reads half a file."""
    folder = tmp / "prometheus" / "targets" / "megaheal-run"
    (folder / "local.yml.part").write_text(yaml.safe_dump([{"targets": [run]}]))
    (folder / "local.yml.part").rename(folder / "local.yml")


def as_promql(query: str, job: str) -> str:
    """A dashboard query as Grafana sends it: variables and interval macros substituted; label_values() (a
    Grafana variable function) as the PromQL that lists the same values."""
    if query.startswith("label_values("):
        metric, label = query[len("label_values("):-1].rsplit(",", 1)
        query = f"count by ({label.strip()}) ({metric})"
    for var, value in (("$job", job), ("$node", ".*"), ("$rank", ".*"), ("$gpu", ".*"),
                       ("$__rate_interval", "1m"), ("$__range", "5m"), ("$__interval", "15s")):
        query = query.replace(var, value)
    # NOTE: $1 and the like are label_replace's own references to its regex's groups, not variables.
    assert not re.search(r"\$(?![0-9])", query), f"unsubstituted variable in {query}"
    return query


def run(prom: Prometheus, where: str, expr: str) -> list[dict[str, Any]]:
    try:
        return prom.query(expr)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{where}: Prometheus refused {expr!r}: {exc.read().decode()}") from exc


def rule_states(prom: Prometheus) -> list[dict[str, Any]]:
    """Every rule Prometheus loaded, with its health ("ok" once evaluated without error)."""
    with urllib.request.urlopen(f"{prom.url}/api/v1/rules", timeout=5) as r:
        return [rule for group in json.load(r)["data"]["groups"] for rule in group["rules"]]


@pytest.mark.timeout(240)
def test_prometheus_loaded_with_deploy_answers_every_dashboard_and_rule_query(tmp_path: Path) -> None:
    sock, port = tmp_path / "sidecar.sock", free_port()
    sidecar = start_sidecar(sock, port, tmp_path / "sidecar.log")
    job, goodput = None, None
    try:
        with deployed_prometheus(tmp_path, f"127.0.0.1:{port}") as prom:
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m", "train",
                 "--config", str(CONFIGS / "tiny-dp4.yaml"), "--run-dir", str(tmp_path / "run"),
                 "--set", f"steps={STEPS}"],
                cwd=REPO, env=job_env() | {"MEGAHEAL_SIDECAR_SOCKET": str(sock)}, stdout=subprocess.DEVNULL,
                stderr=(tmp_path / "job.log").open("w"), start_new_session=True)
            assert job.wait(timeout=180) == 0, (tmp_path / "job.log").read_text()[-3000:]
            # The sidecar keeps serving the ranks' last step after they exit; the rules need a few evaluations.
            wait_for("every rank's last step in Prometheus",
                     lambda: len(prom.query(f"megaheal_step == {STEPS - 1}")) == 4, timeout_s=60)
            wait_for("the straggler score of every rank",
                     lambda: len(prom.query("rank:megaheal_straggler_score:ratio")) == 4, timeout_s=30)
            (job_name,) = {r["metric"]["job"] for r in prom.query("megaheal_step")}
            # `megaheal run`'s metrics of that job: its goodput server over a supervised run's directory, on a port
            # it binds itself (a port picked minutes earlier may be taken by then, by a test running alongside).
            goodput = GoodputServer(tmp_path / "supervised", job_name, write_run(tmp_path / "supervised"))
            add_run_target(tmp_path, f"127.0.0.1:{goodput.start()}")
            wait_for("the run's ETTR in Prometheus",
                     lambda: prom.query(f'megaheal_goodput_ettr_ratio{{job="{job_name}"}}'), timeout_s=60)
            # NOTE: a burn rate is an increase() of the run's counters: it needs two of their scrapes, then a rule run.
            burn = f'job:megaheal_ettr_error_budget:burn_rate3d{{job="{job_name}"}}'
            wait_for("the run's ETTR burn rates recorded", lambda: prom.query(burn), timeout_s=30)

            mfu = run(prom, "MFU", f'job:megaheal_mfu:avg{{job="{job_name}"}}')
            assert len(mfu) == 1 and 0 < float(mfu[0]["value"][1]) < 1
            phases = {r["metric"]["phase"] for r in run(prom, "phases", "job_phase:megaheal_step_seconds:avg")}
            assert "total" in phases and {"forward_backward", "optimizer"} <= phases, phases

            # Every dashboard query parses; every training one returns data.
            for name, board in load().items():
                for where, language, query in queries(board):
                    if language == "promql":
                        result = run(prom, where, as_promql(query, job_name))
                        assert result or name != "training", f"{where}: no data for {query}"
            # Every rule parses; the recording rules over training metrics return data.
            for rule in rules(ALERTS) + rules(RECORDING):
                run(prom, rule.get("alert") or rule["record"], rule["expr"])
                if "record" in rule and "megaheal_" in rule["expr"]:
                    assert run(prom, rule["record"], rule["record"]), f"{rule['record']}: no data"

            # Prometheus evaluates the deploy rules itself, without error. The healer of deploy/ is not running
            # here, so its alert is pending (for: 2m); the sidecar is up, so its node is not down.
            wait_for("every rule evaluated", lambda: all(r["health"] == "ok" for r in rule_states(prom)), timeout_s=10)
            assert {r["name"] for r in rule_states(prom)} == {r.get("alert") or r["record"]
                                                            for r in rules(ALERTS) + rules(RECORDING)}
            wait_for("MegahealHealerDown pending",
                     lambda: prom.query('ALERTS{alertname="MegahealHealerDown", alertstate="pending"}'), timeout_s=10)
            assert not prom.query('ALERTS{alertname=~"MegahealNodeDown|MegahealTelemetryAbsent"}')
    finally:
        if goodput is not None:
            goodput.stop()
        if job is not None and job.poll() is None:
            kill_job(job)
        sidecar.terminate()
        sidecar.wait(timeout=10)

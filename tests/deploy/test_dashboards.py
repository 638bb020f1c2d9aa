"""The dashboards: the committed JSON is what the code generates, the panels the operators expect are there,
every query points at a provisioned datasource, and push uploads them into their folder."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
from typer.testing import CliRunner

from dashboards.build import DASHBOARDS, OUT_DIR, build_all, load, panels, queries, render, stale
from dashboards.push import PushConfig, push
from megaheal.cli import app
from tests.deploy.configs import COMPOSE, DEPLOY, load_yaml

pytestmark = pytest.mark.unit


def test_regenerating_the_dashboards_gives_the_committed_json(tmp_path: Path) -> None:
    assert stale() == [], "run `megaheal dashboards build` and commit dashboards/*.json"
    written = build_all(tmp_path)
    assert [p.read_text() for p in written] == [(OUT_DIR / p.name).read_text() for p in written]
    # A change in the code shows up as stale.
    (tmp_path / "gpus.json").write_text(render("gpus").replace("Xid", "xid"))
    assert stale(tmp_path) == ["gpus"]


def test_the_build_command_writes_and_checks(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["dashboards", "build", "--check", "--out", str(tmp_path)]).exit_code == 1
    built = runner.invoke(app, ["dashboards", "build", "--out", str(tmp_path)])
    assert built.exit_code == 0 and sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.json" for n in DASHBOARDS)
    assert runner.invoke(app, ["dashboards", "build", "--check", "--out", str(tmp_path)]).exit_code == 0


def _titles(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["title"]: p for p in panels(board)}


def test_the_dashboards_have_the_panels_operators_look_for() -> None:
    boards = load()
    training, _, incidents = (_titles(boards[n]) for n in ("training", "gpus", "incidents"))
    for title in ("MFU", "Tokens/s", "ETTR", "Loss and gradient norm", "Phase breakdown (mean per step)",
                  "Step time (every step)", "Straggler score (lowest 10 ranks)", "Telemetry drops", "ETTR of the run",
                  "Where the wall time went"):
        assert title in training, title
    assert training["Compute time by rank"]["type"] == "heatmap"
    assert [v["name"] for v in boards["training"]["templating"]["list"]] == [
        "datasource", "incidents_db", "tempo", "job", "node", "rank", "pages"]
    gpu_exprs = " ".join(q for _, lang, q in queries(boards["gpus"]) if lang == "promql")
    for metric in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
                   "DCGM_FI_DEV_FB_USED", "megaheal_gpu_xid_errors_total", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                   "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                   "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"):
        assert metric in gpu_exprs, metric
    assert "increase(DCGM_FI_DEV_XID_ERRORS" not in gpu_exprs, "the last-Xid gauge cannot be increase()d"
    for title in ("Open incidents", "MTTR", "Detection, diagnosis and recovery times", "Recent actions"):
        assert title in incidents, title
    for name in ("training", "incidents"):
        (annotation,) = boards[name]["annotations"]["list"]
        assert "FROM incidents" in annotation["target"]["rawSql"]


def test_every_query_names_its_datasource_by_a_variable_defaulting_to_the_provisioned_one() -> None:
    provisioned = {d["uid"]: d for d in
                   load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "megaheal.yml")["datasources"]}
    boards = load()
    assert len({b["uid"] for b in boards.values()}) == len(DASHBOARDS)
    for board in boards.values():
        assert board["schemaVersion"] >= 39
        variables = {v["name"]: v for v in board["templating"]["list"] if v["type"] == "datasource"}
        for variable in variables.values():  # imported elsewhere, Grafana offers every datasource of the type
            default = provisioned[variable["current"]["value"]]
            assert (default["type"], default["name"]) == (variable["query"], variable["current"]["text"])
        refs = [a["datasource"] for a in board.get("annotations", {}).get("list", [])]
        refs += [v["datasource"] for v in board["templating"]["list"] if v.get("datasource")]
        for panel in panels(board):
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]
            assert panel["datasource"] in [t["datasource"] for t in panel["targets"]], panel["title"]
            refs += [t["datasource"] for t in panel["targets"]]
        for ref in refs:
            name = ref["uid"].removeprefix("${").removesuffix("}")
            assert name in variables and variables[name]["query"] == ref["type"], (board["uid"], ref)


def _links(board: dict[str, Any]) -> list[str]:
    urls = [link["url"] for link in board.get("links", [])]
    for panel in panels(board):
        field_config = panel.get("fieldConfig") or {}
        urls += [link["url"] for link in field_config.get("defaults", {}).get("links", [])]
        urls += [link["url"] for o in field_config.get("overrides", []) for p in o["properties"] if p["id"] == "links"
                 for link in p["value"]]
    return urls


def test_links_lead_from_a_node_to_its_gpus_an_incident_to_its_page_and_a_rank_to_its_traces() -> None:
    boards = load()
    training, incidents = _links(boards["training"]), _links(boards["incidents"])
    gpus_uid = boards["gpus"]["uid"]
    assert f"/d/{gpus_uid}/megaheal-gpus?var-node=${{__field.labels.node}}&${{datasource:queryparam}}" \
           "&${__url_time_range}" in training
    assert any(u.startswith(f"/d/{gpus_uid}/") and "${node:queryparam}" in u for u in training)
    assert "${pages}/incidents/${__value.raw}" in incidents
    (trace,) = {u for u in training if "${__field.labels.rank}" in u}
    assert trace.startswith("/explore?")
    pane = json.loads(unquote(trace.split("panes=", 1)[1]))["traces"]
    assert pane["datasource"] == "${tempo}" and pane["queries"][0]["queryType"] == "traceql"
    # The attributes exporters/traces.py puts on every rank's step span.
    assert pane["queries"][0]["query"] == ('{ span.megaheal.job = "${job:percentencode}" && '
                                           'span.megaheal.rank = ${__field.labels.rank} }')
    assert any(u.startswith(f"/d/{boards['training']['uid']}/") for u in _links(boards["gpus"]))
    tempo = [t for p in panels(boards["training"]) for t in p["targets"] if t["datasource"]["type"] == "tempo"]
    assert [t["query"] for t in tempo] == ['{ span.megaheal.job = "$job" }']


def test_the_compute_heat_map_orders_ranks_by_number() -> None:
    (expr,) = [q for where, _, q in queries(load()["training"]) if "Compute time by rank" in where]
    assert "megaheal_rank_compute_seconds_sum" in expr and expr.startswith("max by (order, rank) (")
    # What each label_replace does to a rank of each width, the way Prometheus does it (an anchored regex).
    rules = re.findall(r'"order", "(0*)\$1", "rank", "\(\[0-9\]\{(\d)\}\)"', expr)
    assert len(rules) == 6

    def order(rank: str) -> str:
        padded = ""
        for zeros, width in rules:
            if re.fullmatch(f"[0-9]{{{width}}}", rank):
                padded = zeros + rank
        return padded

    ranks = ["0", "1", "2", "9", "10", "11", "99", "100", "12287", "131071"]
    assert sorted(ranks, key=order) == ranks and sorted(ranks) != ranks


def test_grafana_loads_the_committed_json_from_the_mounted_folder() -> None:
    provider = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "megaheal.yml")["providers"][0]
    mounts = load_yaml(COMPOSE)["services"]["grafana"]["volumes"]
    assert f"./dashboards:{provider['options']['path']}:ro" in mounts


class FakeGrafana:
    """Records the calls push makes, like grafana-client's GrafanaApi (folder, dashboard)."""

    def __init__(self, folders: list[dict[str, Any]]) -> None:
        self.folders = folders
        self.created: list[tuple[str, str]] = []
        self.posted: list[dict[str, Any]] = []
        self.folder, self.dashboard = self, self

    def get_all_folders(self) -> list[dict[str, Any]]:
        return self.folders

    def create_folder(self, title: str, uid: str) -> None:
        self.created.append((title, uid))

    def update_dashboard(self, body: dict[str, Any]) -> dict[str, Any]:
        self.posted.append(body)
        return {"url": f"/d/{body['dashboard']['uid']}/x"}


@pytest.mark.parametrize("existing", [[], [{"uid": "megaheal", "title": "megaheal"}]])
def test_push_uploads_every_dashboard_into_its_folder(existing: list[dict[str, Any]]) -> None:
    api = FakeGrafana(existing)
    boards = load()
    boards["training"]["id"] = 7  # an id from another Grafana must not travel
    urls = push(PushConfig(url="http://grafana:3000/", token="t"), boards, api=api)
    assert api.created == ([] if existing else [("megaheal", "megaheal")])
    assert [b["dashboard"]["uid"] for b in api.posted] == [b["uid"] for b in boards.values()]
    assert all(b["overwrite"] and b["folderUid"] == "megaheal" and "id" not in b["dashboard"] for b in api.posted)
    assert urls[0] == "http://grafana:3000/d/megaheal-training/x"
    with pytest.raises(ValueError, match="token"):
        PushConfig(url="http://grafana:3000", token=" ")

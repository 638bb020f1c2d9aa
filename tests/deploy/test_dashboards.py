"""The dashboards: the committed JSON is what the code generates, the panels the operators expect are there,
every query points at a provisioned datasource, and push uploads them into their folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    training, gpus, incidents = (_titles(boards[n]) for n in ("training", "gpus", "incidents"))
    for title in ("MFU", "Tokens/s", "ETTR and goodput", "Loss and gradient norm", "Phase breakdown (mean over ranks)",
                  "Straggler score (lowest 10 ranks)", "Telemetry drops"):
        assert title in training, title
    assert training["Step time by rank"]["type"] == "heatmap"
    assert [v["name"] for v in boards["training"]["templating"]["list"]] == ["job", "node", "rank"]
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


def test_every_query_has_a_ref_id_and_a_provisioned_datasource() -> None:
    provisioned = {d["uid"]: d["type"] for d in
                   load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "megaheal.yml")["datasources"]}
    boards = load()
    assert len({b["uid"] for b in boards.values()}) == len(DASHBOARDS)
    for board in boards.values():
        assert board["schemaVersion"] >= 39
        for panel in panels(board):
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert ref_ids and len(set(ref_ids)) == len(ref_ids), panel["title"]
            for target in panel["targets"]:
                source = target["datasource"]
                assert provisioned.get(source["uid"]) == source["type"], (panel["title"], source)


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

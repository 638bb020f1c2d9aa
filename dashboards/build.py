"""Generate the dashboards' JSON, check that the committed JSON is current, and list their queries.

    megaheal dashboards build [--out DIR] [--check]
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# name -> module with build(); imported on first use (grafana-foundation-sdk is only needed to generate).
DASHBOARDS: dict[str, str] = {
    "training": "dashboards.training",
    "gpus": "dashboards.gpus",
    "incidents": "dashboards.incidents",
}
OUT_DIR = Path(__file__).resolve().parent


def render(name: str) -> str:
    """The JSON text of one dashboard, as committed."""
    if name not in DASHBOARDS:
        raise KeyError(f"unknown dashboard {name!r}; known: {', '.join(DASHBOARDS)}")
    from dashboards.common import render as render_board

    return render_board(importlib.import_module(DASHBOARDS[name]).build())


def build_all(out_dir: Path = OUT_DIR) -> list[Path]:
    """Write every dashboard to out_dir/<name>.json; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DASHBOARDS:
        path = out_dir / f"{name}.json"
        path.write_text(render(name))
        written.append(path)
    return written


def stale(out_dir: Path = OUT_DIR) -> list[str]:
    """Dashboards whose file in out_dir is missing or differs from a fresh generation."""
    return [name for name in DASHBOARDS
            if not (out_dir / f"{name}.json").exists() or (out_dir / f"{name}.json").read_text() != render(name)]


def load(out_dir: Path = OUT_DIR) -> dict[str, dict[str, Any]]:
    """The committed dashboards, parsed."""
    return {name: json.loads((out_dir / f"{name}.json").read_text()) for name in DASHBOARDS}


def panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed panels included (rows themselves left out)."""
    for panel in board.get("panels", []):
        if panel.get("type") == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(board: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, language, query) of every query: panel targets, template variables and annotations;
    language is "promql" or "sql"."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            where = f"{board['uid']}: {panel.get('title')} [{target.get('refId')}]"
            if "expr" in target:
                yield where, "promql", target["expr"]
            elif "rawSql" in target:
                yield where, "sql", target["rawSql"]
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        if isinstance(query, dict):
            yield f"{board['uid']}: variable {variable['name']}", "promql", query["query"]
    for annotation in board.get("annotations", {}).get("list", []):
        target = annotation.get("target") or {}
        if "rawSql" in target:
            yield f"{board['uid']}: annotation {annotation['name']}", "sql", target["rawSql"]

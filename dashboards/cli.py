"""`megaheal dashboards`: generate the dashboards' JSON, or upload it to a Grafana."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Grafana dashboards: generate dashboards/*.json (build) or upload them (push).")

TOKEN_ENV = "GRAFANA_TOKEN"


@app.command()
def build(
    out: Annotated[Optional[str], typer.Option("--out", help="directory to write to [default: the dashboards package]")] = None,
    check: Annotated[bool, typer.Option("--check", help="write nothing; exit 1 if a committed dashboard is stale")] = False,
) -> None:
    """Generate every dashboard's JSON from its Python definition."""
    from dashboards.build import OUT_DIR, build_all, stale  # grafana-foundation-sdk: imported only here

    out_dir = Path(out) if out else OUT_DIR
    if check:
        names = stale(out_dir)
        if names:
            typer.echo(f"stale: {', '.join(names)}; run `megaheal dashboards build`", err=True)
            raise typer.Exit(1)
        typer.echo("dashboards are current")
        return
    for path in build_all(out_dir):
        typer.echo(f"wrote {path}")


@app.command()
def push(
    url: Annotated[str, typer.Option("--url", help="Grafana base URL")],
    token: Annotated[Optional[str], typer.Option("--token", help=f"service-account token (prefer --token-file or ${TOKEN_ENV}: "
                                                 "a token on the command line is visible to other users)")] = None,
    token_file: Annotated[Optional[str], typer.Option("--token-file", help="file holding the token")] = None,
    folder: Annotated[str, typer.Option("--folder", help="uid of the folder (created when missing)")] = "megaheal",
) -> None:
    """Upload the committed dashboards (dashboards/*.json) to Grafana, replacing older versions."""
    from dashboards.build import load
    from dashboards.push import PushConfig, PushError, push as push_boards

    secret = token or (Path(token_file).read_text().strip() if token_file else os.environ.get(TOKEN_ENV, ""))
    try:
        cfg = PushConfig(url=url, token=secret, folder_uid=folder)
        for link in push_boards(cfg, load()):
            typer.echo(f"pushed {link}")
    except (ValueError, PushError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc

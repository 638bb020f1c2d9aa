"""The `megaheal` command. Subcommands grow with the project: `train` launches a training job."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from megaheal.typedconfig import ConfigError

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Keep large distributed training jobs healthy.")


@app.callback()
def _root() -> None:
    """Keep large distributed training jobs healthy."""


@app.command()
def train(
    config: Annotated[str, typer.Option("--config", help="training config YAML (see configs/)")],
    run_dir: Annotated[Optional[str], typer.Option("--run-dir", help="output directory [default: runs/<timestamp>]")] = None,
    overrides: Annotated[
        Optional[list[str]], typer.Option("--set", help="override a config key, e.g. steps=6 (repeatable)")
    ] = None,
) -> None:
    """Train on this machine: one torchrun process per rank (pp x dp x tp of the config)."""
    from train.launch import launch  # imports torch: keep `megaheal --help` fast

    try:
        code = launch(config, overrides or [], run_dir)
    except ConfigError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    raise typer.Exit(code)

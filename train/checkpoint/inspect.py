"""`megaheal ckpt list|verify|inspect RUN_DIR`: what checkpoints a run has and what a resume would pick."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from train.checkpoint import catalog
from wire.run_paths import RunPaths

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Inspect and verify a run's checkpoints.")

RunDir = Annotated[Path, typer.Argument(help="run directory (holding checkpoints/) or a checkpoint directory")]
Checksums = Annotated[bool, typer.Option("--checksums", help="also verify file checksums (reads every byte)")]


def _ckpt_dir(run_dir: Path) -> Path:
    checkpoints = RunPaths(run_dir).checkpoints
    return checkpoints if checkpoints.is_dir() else run_dir


@app.command("list")
def list_(run_dir: RunDir, checksums: Checksums = False) -> None:
    """Every checkpoint, newest first, with its status; then what `--resume auto` would load."""
    ckpt_dir = _ckpt_dir(run_dir)
    infos = catalog.list_checkpoints(ckpt_dir)
    if not infos:
        typer.echo(f"no checkpoints in {ckpt_dir}")
        raise typer.Exit(1)
    latest = catalog.read_latest(ckpt_dir)
    typer.echo(f"{'checkpoint':<16} {'step':>8} {'status':<10} {'size MiB':>9}  layout        note")
    for info in infos:
        problems = catalog.verify(info, checksums)
        size = sum(f["size"] for f in (info.manifest or {}).get("files", [])) / 2**20
        layout = (info.manifest or {}).get("layout", {})
        shape = f"pp{layout.get('pp', '?')} dp{layout.get('dp', '?')} tp{layout.get('tp', '?')}" if layout else "-"
        note = "<- latest" if info.path.name == latest else ""
        if problems:
            note = "; ".join(problems)
        typer.echo(f"{info.path.name:<16} {info.step:>8} {info.status:<10} {size:>9.2f}  {shape:<13} {note}")
    choice = catalog.choose_resume(ckpt_dir, checksums=checksums)
    picked = choice.checkpoint.path.name if choice.checkpoint else "nothing (start from step 0)"
    typer.echo(f"resume auto would load: {picked}")


@app.command()
def verify(run_dir: RunDir, checksums: Checksums = False) -> None:
    """Verify every complete checkpoint; exit 1 naming each bad file if any is corrupt."""
    ckpt_dir = _ckpt_dir(run_dir)
    infos = [i for i in catalog.list_checkpoints(ckpt_dir) if i.complete]
    if (run_dir / catalog.MANIFEST).is_file():  # a single checkpoint directory was given
        infos = [i for i in catalog.list_checkpoints(run_dir.parent) if i.path == run_dir]
    if not infos:
        typer.echo(f"no complete checkpoints in {ckpt_dir}", err=True)
        raise typer.Exit(1)
    bad = 0
    for info in infos:
        problems = catalog.verify(info, checksums)
        bad += bool(problems)
        for problem in problems or ["ok"]:
            typer.echo(f"{info.path}: {problem}", err=bool(problems))
    raise typer.Exit(1 if bad else 0)


@app.command()
def inspect(run_dir: RunDir) -> None:
    """Print the manifest of the checkpoint `latest` names (or of the given checkpoint directory)."""
    if (run_dir / catalog.MANIFEST).is_file():
        path = run_dir
    else:
        ckpt_dir = _ckpt_dir(run_dir)
        latest = catalog.read_latest(ckpt_dir)
        if latest is None:
            typer.echo(f"{ckpt_dir}: no latest marker", err=True)
            raise typer.Exit(1)
        path = ckpt_dir / latest
    typer.echo(json.dumps(json.loads((path / catalog.MANIFEST).read_text()), indent=2))

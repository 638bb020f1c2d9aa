"""The healer's commands, mounted on `megaheal` by megaheal/cli.py: `megaheal healer` and `megaheal db ...`."""

from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from ground.typedconfig import ConfigError

db_app = typer.Typer(no_args_is_help=True, add_completion=False,
                     help="The healer's database: apply, undo or show schema migrations.")
DbOption = Annotated[Optional[str], typer.Option("--db", help="database URL [default: MEGAHEAL_DB, else SQLite in "
                                                               "$XDG_STATE_HOME/megaheal/healer.db]")]


def _db_url(db: str | None) -> str:
    from healer.incidents.db import default_db_url

    return db or os.environ.get("MEGAHEAL_DB") or default_db_url()


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


@db_app.command("upgrade")
def upgrade(db: DbOption = None, revision: Annotated[str, typer.Argument(help="target revision")] = "head") -> None:
    """Migrate the database up to REVISION (default: the newest)."""
    from healer.errors import DatabaseError
    from healer.incidents import db as dbmod

    try:
        engine = dbmod.make_engine(_db_url(db))
        before = dbmod.current_revision(engine)
        dbmod.upgrade(engine, revision)
        typer.echo(f"{dbmod.safe_url(engine.url)}: {before or 'empty'} -> {dbmod.current_revision(engine)}")
    except DatabaseError as exc:
        raise _fail(str(exc)) from exc


@db_app.command("downgrade")
def downgrade(revision: Annotated[str, typer.Argument(help="target revision, e.g. -1 or base")], db: DbOption = None) -> None:
    """Migrate the database down to REVISION (base: drop everything)."""
    from healer.errors import DatabaseError
    from healer.incidents import db as dbmod

    try:
        engine = dbmod.make_engine(_db_url(db))
        before = dbmod.current_revision(engine)
        dbmod.downgrade(engine, revision)
        typer.echo(f"{dbmod.safe_url(engine.url)}: {before or 'empty'} -> {dbmod.current_revision(engine) or 'base'}")
    except DatabaseError as exc:
        raise _fail(str(exc)) from exc


@db_app.command("current")
def current(db: DbOption = None) -> None:
    """Show the database's revision and the newest one; exit 1 when they differ."""
    from healer.errors import DatabaseError
    from healer.incidents import db as dbmod

    try:
        engine = dbmod.make_engine(_db_url(db))
        now, head = dbmod.current_revision(engine), dbmod.head_revision()
    except DatabaseError as exc:
        raise _fail(str(exc)) from exc
    typer.echo(f"{dbmod.safe_url(engine.url)}: at {now or 'none'}, newest {head}")
    raise typer.Exit(0 if now == head else 1)


def healer(config: str | None, listen: str | None, db: str | None, token_file: str | None) -> None:
    """Run the healer service (see megaheal/cli.py for the options)."""
    from healer.service.app import run
    from healer.service.config import load_config

    try:
        cfg = load_config(config)
        if listen is not None:
            cfg.listen = listen
        if db is not None or os.environ.get("MEGAHEAL_DB"):
            cfg.db = db or os.environ["MEGAHEAL_DB"]
        if token_file is not None:
            cfg.token_file = token_file
        cfg.__post_init__()
    except (ConfigError, ValueError) as exc:
        raise _fail(str(exc)) from exc
    try:
        code = run(cfg)
    except ConfigError as exc:
        raise _fail(str(exc)) from exc
    raise typer.Exit(code)

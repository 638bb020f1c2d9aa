"""Alembic environment of the healer's database.

The healer (`megaheal db upgrade`, `healer.incidents.db.upgrade`) passes its engine in `config.attributes["engine"]`.
Run directly (`alembic -c alembic.ini ...`, e.g. to write a new revision with --autogenerate), the URL comes
from MEGAHEAL_DB or from sqlalchemy.url in alembic.ini.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection

from healer.incidents.db import make_engine
from healer.incidents.models import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def _render_item(kind: str, obj: Any, autogen_context: AutogenContext) -> str | Literal[False]:
    # NOTE: revisions must not import healer.incidents.models (a later change to the models would rewrite history):
    # the UTC type decorator is written as the plain column type it stores.
    if kind == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        render_item=_render_item,
        # NOTE: SQLite cannot ALTER most things; batch mode rebuilds the table, and is a no-op on PostgreSQL.
        render_as_batch=connection.dialect.name == "sqlite",
    )


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        url = os.environ.get("MEGAHEAL_DB") or config.get_main_option("sqlalchemy.url")
        if not url:
            raise SystemExit("set MEGAHEAL_DB (or sqlalchemy.url in alembic.ini) to the database URL")
        engine = make_engine(url)
    with engine.begin() as connection:
        _configure(connection)
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) mode is not supported: run against a database")
run_migrations_online()

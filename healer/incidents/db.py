"""Database connections and schema revisions: engines for SQLite (WAL, busy timeout) and PostgreSQL
(psycopg 3), Alembic upgrade/downgrade, and the check that keeps the healer off a database whose schema
is not the newest one.

A brand-new, empty database is created through the migrations (so `megaheal healer` works on a fresh
machine); a database with tables but an older revision is refused with the command to run.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from healer.errors import DatabaseError, DatabaseNotAtHead

log = logging.getLogger(__name__)

SQLITE_BUSY_TIMEOUT_MS = 5000
PG_CONNECT_TIMEOUT_S = 5
# NOTE: TCP keepalives and a user timeout, so a database host that vanished (power, a partition) breaks the
# connection within ~30 s instead of the kernel's ~2 h: statement timeouts are the server's, and a server that
# cannot be reached never sends one.
PG_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
                 "tcp_user_timeout": 30000}


def default_db_url() -> str:
    """SQLite under $XDG_STATE_HOME/megaheal (~/.local/state/megaheal by default)."""
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return f"sqlite:///{state / 'megaheal' / 'healer.db'}"


def safe_url(url: str | sa.URL) -> str:
    """The URL for messages and logs, password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable database URL>"


def make_engine(url: str, timeout: timedelta | None = None, password: str | None = None) -> Engine:
    """An engine for `url`: sqlite:///PATH or postgresql+psycopg://USER@HOST:PORT/DB. Raises DatabaseError.

    PostgreSQL only: `timeout` bounds every statement and lock wait (the server cancels it: an OperationalError
    the healer answers with 503), and how long a request waits for a pooled connection; None for no limit (the
    migration commands, which may rewrite big tables). `password` is given to the driver directly, so it never
    sits in the URL or the environment."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise DatabaseError(f"database URL {url!r} is not a URL: use sqlite:///PATH or postgresql+psycopg://...") from exc
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(parsed)
    if backend == "postgresql":
        # NOTE: the dialect's driver, not the URL's: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3.
        if parsed.get_dialect().driver != "psycopg":
            raise DatabaseError(f"{safe_url(parsed)}: use the psycopg 3 driver, postgresql+psycopg://...")
        connect_args: dict[str, Any] = {"connect_timeout": PG_CONNECT_TIMEOUT_S, **PG_KEEPALIVES}
        if timeout is not None:
            ms = max(1, int(timeout.total_seconds() * 1000))
            connect_args["options"] = f"-c statement_timeout={ms} -c lock_timeout={ms}"
        if password is not None:
            connect_args["password"] = password
        pool_timeout = timeout.total_seconds() if timeout is not None else 30.0
        try:
            return sa.create_engine(parsed, pool_pre_ping=True, pool_size=5, max_overflow=5, pool_timeout=pool_timeout,
                                    connect_args=connect_args)
        except NoSuchModuleError as exc:
            raise DatabaseError(f"{safe_url(parsed)}: psycopg is not installed") from exc
    raise DatabaseError(f"{safe_url(parsed)}: unsupported database {backend!r}; use sqlite or postgresql+psycopg")


def _sqlite_engine(url: sa.URL) -> Engine:
    if url.database and url.database != ":memory:":
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        # NOTE: WAL lets readers (the API) run while a writer (a tick) holds the lock; busy_timeout makes a
        # second healer process on the same file wait for the lock instead of failing with "database is locked".
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.close()

    return engine


# ---- migrations -------------------------------------------------------------------------------------------

def migrations_dir() -> Path:
    """migrations/ beside the healer package (clone, editable install), else the installed `migrations` package."""
    here = Path(__file__).resolve().parents[2] / "migrations"
    if (here / "env.py").is_file():
        return here
    spec = importlib.util.find_spec("migrations")
    if spec is not None and spec.submodule_search_locations:
        found = Path(next(iter(spec.submodule_search_locations)))
        if (found / "env.py").is_file():
            return found
    raise DatabaseError("the healer's migrations/ folder is missing from this installation")


def alembic_config(engine: Engine) -> Any:
    from alembic.config import Config  # imported here: only migration commands need alembic

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(migrations_dir()))
    head = script.get_current_head()
    if head is None:
        raise DatabaseError("migrations/ holds no revision")
    return head


def current_revision(engine: Engine) -> str | None:
    """The database's revision; None for a database without alembic_version. Raises DatabaseError if unreachable."""
    from alembic.migration import MigrationContext

    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except sa.exc.SQLAlchemyError as exc:
        raise DatabaseError(f"cannot reach the database {safe_url(engine.url)}: {_reason(exc)}") from exc


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    _run(engine, lambda cfg: command.upgrade(cfg, revision))


def downgrade(engine: Engine, revision: str) -> None:
    from alembic import command

    _run(engine, lambda cfg: command.downgrade(cfg, revision))


def _run(engine: Engine, action: Any) -> None:
    try:
        action(alembic_config(engine))
    except sa.exc.OperationalError as exc:
        raise DatabaseError(f"cannot reach the database {safe_url(engine.url)}: {_reason(exc)}") from exc


def is_empty(engine: Engine) -> bool:
    try:
        with engine.connect() as conn:
            return not [t for t in sa.inspect(conn).get_table_names() if t != "alembic_version"]
    except sa.exc.SQLAlchemyError as exc:
        raise DatabaseError(f"cannot reach the database {safe_url(engine.url)}: {_reason(exc)}") from exc


def ensure_schema(engine: Engine, create_if_empty: bool = True) -> str:
    """Make sure the schema is at head: create an empty database through the migrations, refuse anything else
    that is not at head (DatabaseNotAtHead, saying what to run). Returns the revision."""
    head = head_revision()
    current = current_revision(engine)
    if current == head:
        return head
    if current is None and create_if_empty and is_empty(engine):
        log.info("database %s is empty: creating it through the migrations (to %s)", safe_url(engine.url), head)
        upgrade(engine, "head")
        return head
    raise DatabaseNotAtHead(
        f"database {safe_url(engine.url)} is at revision {current or 'none (tables without alembic_version)'}, "
        f"this healer needs {head}: run `megaheal db upgrade --db {safe_url(engine.url)}` (back it up first)")


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` says the database cannot be used right now (down, unreachable, a statement or a wait for a
    pooled connection timed out), as opposed to refusing one statement: the request should be retried later."""
    if isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.TimeoutError,
                        sa.exc.DisconnectionError)):
        return True
    return isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated


def _reason(exc: BaseException) -> str:
    """The driver's own one-line reason, without SQLAlchemy's background links."""
    orig = getattr(exc, "orig", None) or exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__

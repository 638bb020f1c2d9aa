"""The healer tests' database fixtures (a PostgreSQL cluster per session, `db_url` on SQLite and PostgreSQL), for the
self-healing tests whose incidents, restarts and ledger live in the healer's database."""

from tests.healer.conftest import db_url, pg_url, postgres  # noqa: F401

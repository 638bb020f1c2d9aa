"""Fixtures of the healer tests: a PostgreSQL cluster for the session, a fresh database per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.healer.services import Postgres

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def postgres() -> Iterator[Postgres]:
    pg = Postgres()
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()


@pytest.fixture
def pg_url(postgres: Postgres) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    url = postgres.create_database(name)
    try:
        yield url
    finally:
        postgres.drop_database(name)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each store test runs on SQLite (a file, WAL) and on the real PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'healer.db'}"
    return str(request.getfixturevalue("pg_url"))

"""Migrations: upgrade and downgrade on SQLite and PostgreSQL, the models match the newest migration, and the healer
refuses a database that is not at head (saying what to run) but creates an empty one."""

from __future__ import annotations

import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from healer.detect.suspects import decode, nodes
from healer.errors import DatabaseError, DatabaseNotAtHead
from healer.incidents import db
from healer.incidents.models import Base, Incident
from tests.healer.services import MEGAHEAL

pytestmark = pytest.mark.services

TABLES = {"jobs", "nodes", "node_incidents", "incidents", "incident_events", "runbook_runs", "remediations", "restarts",
          "goodput_intervals", "healer_epochs"}


def _tables(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(sa.inspect(conn).get_table_names()) - {"alembic_version"}


def test_it_upgrades_and_downgrades(db_url: str) -> None:
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    assert db.current_revision(engine) == db.head_revision() and _tables(engine) == TABLES
    db.downgrade(engine, "base")
    assert db.current_revision(engine) is None and _tables(engine) == set()
    db.upgrade(engine)
    assert _tables(engine) == TABLES
    engine.dispose()


def test_incidents_recorded_before_the_typed_findings_get_their_suspects_and_first_step_from_their_evidence(db_url: str) -> None:
    engine = db.make_engine(db_url)
    db.upgrade(engine, "0003")
    columns = ("id, fingerprint, rule, kind, severity, page, state, summary, labels, evidence, occurrences, "
               "opened_at, last_seen_at, state_since, notified_resolved")
    old = {1: {"suspect_rank": 3, "suspect_node": "n2", "cause": "compute"},  # a straggler, a rank on its host
           2: {"suspect_ranks": [1, 4], "suspect_nodes": ["n1", "n3"]},  # a hang: ranks and hosts, unpaired
           3: {"suspect_rank": None, "suspect_node": "n4"},  # a crash with its host lost
           4: {"promql": "up == 0"},  # a PromQL rule's: nobody named
           5: {"first_step": 12, "suspect_ranks": [0]}}  # a non-finite loss
    with engine.begin() as conn:
        for i, evidence in old.items():
            conn.execute(sa.text(f"INSERT INTO incidents ({columns}) VALUES (:id, 'f', 'r', 'k', 's', 'p', 'open', "
                                 "'x', '{}', :ev, 1, :t, :t, :t, false)"),
                         {"id": i, "ev": json.dumps(evidence), "t": datetime(2026, 12, 1, tzinfo=UTC)})
    db.upgrade(engine)
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.select(Incident.id, Incident.suspects)).all())
        first = dict(conn.execute(sa.select(Incident.id, Incident.first_bad_step)).all())
    engine.dispose()
    assert rows == {1: [{"node": "n2", "rank": 3}], 2: [{"rank": 1}, {"rank": 4}, {"node": "n1"}, {"node": "n3"}],
                    3: [{"node": "n4"}], 4: [], 5: [{"rank": 0}]}
    assert [nodes(decode(rows[i], f"incident {i}")) for i in sorted(rows)] == [["n2"], ["n1", "n3"], ["n4"], [], []]
    assert first == {1: None, 2: None, 3: None, 4: None, 5: 12}


def test_autogenerate_finds_nothing_between_models_and_migrations(db_url: str) -> None:
    engine = db.make_engine(db_url)
    db.upgrade(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    engine.dispose()
    assert diff == []


def test_an_empty_database_is_created_and_an_old_one_refused(db_url: str) -> None:
    engine = db.make_engine(db_url)
    assert db.ensure_schema(engine) == db.head_revision()
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0000'"))
    with pytest.raises(DatabaseNotAtHead, match="at revision 0000, this healer needs .*run `megaheal db upgrade --db"):
        db.ensure_schema(engine)
    engine.dispose()


def test_sqlite_runs_in_wal_mode_with_a_busy_timeout(tmp_path: Path) -> None:
    engine = db.make_engine(f"sqlite:///{tmp_path / 'x' / 'h.db'}")
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == db.SQLITE_BUSY_TIMEOUT_MS
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_unusable_urls_are_clear_errors() -> None:
    with pytest.raises(DatabaseError, match="unsupported database 'mysql'"):
        db.make_engine("mysql://x@y/z")
    with pytest.raises(DatabaseError, match="use the psycopg 3 driver"):
        db.make_engine("postgresql+psycopg2://x@y/z")
    engine = db.make_engine("postgresql+psycopg://nobody:secret@127.0.0.1:1/none")
    with pytest.raises(DatabaseError, match=r"cannot reach the database postgresql\+psycopg://nobody:\*\*\*@") as info:
        db.current_revision(engine)
    assert "secret" not in str(info.value)


def test_the_db_commands_upgrade_show_and_downgrade(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    run = lambda *args: subprocess.run([MEGAHEAL, "db", *args, "--db", url], capture_output=True, text=True, timeout=60)
    before = run("current")
    assert before.returncode == 1 and "at none" in before.stdout
    up = run("upgrade")
    assert up.returncode == 0 and f"empty -> {db.head_revision()}" in up.stdout, up.stderr
    assert run("current").returncode == 0
    down = run("downgrade", "base")
    assert down.returncode == 0 and "-> base" in down.stdout
    bad = subprocess.run([MEGAHEAL, "db", "upgrade", "--db", "oracle://x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unsupported database 'oracle'" in bad.stderr and "Traceback" not in bad.stderr


def test_migrations_are_found_from_the_package_location() -> None:
    found = db.migrations_dir()
    assert (found / "env.py").is_file() and (found / "script.py.mako").is_file()
    assert any(p.name.startswith("0001_") for p in (found / "versions").iterdir())

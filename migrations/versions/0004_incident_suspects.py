"""Whom an incident's finding blames (healer/detect/suspects.py) and the first step it touched, in columns of their
own, so that no decision reads the free-form evidence. Incidents recorded before it get theirs from the evidence keys
the detectors wrote then.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-05 08:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _from_evidence(evidence: Any) -> list[dict[str, Any]]:
    """The suspects the evidence of an older incident named (its `suspect_rank(s)` and `suspect_node(s)` keys): a
    rank on its host where there was one of each, else each alone. NOTE: written out here, not imported, so that
    this revision does the same whatever the code around it becomes."""
    ev = evidence if isinstance(evidence, dict) else {}
    ranks = ev.get("suspect_ranks") or ([ev["suspect_rank"]] if ev.get("suspect_rank") is not None else [])
    nodes = {n for n in [ev.get("suspect_node"), *(ev.get("suspect_nodes") or [])] if isinstance(n, str) and n}
    ranks = sorted({r for r in ranks if isinstance(r, int) and not isinstance(r, bool)})
    if len(ranks) == 1 and len(nodes) == 1:
        return [{"node": next(iter(nodes)), "rank": ranks[0]}]
    return [{"rank": r} for r in ranks] + [{"node": n} for n in sorted(nodes)]


def upgrade() -> None:
    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.add_column(sa.Column('suspects', sa.JSON(), nullable=False, server_default=sa.text("'[]'")))
        batch_op.add_column(sa.Column('first_bad_step', sa.Integer(), nullable=True))
    incidents = sa.table('incidents', sa.column('id', sa.Integer()), sa.column('evidence', sa.JSON()),
                         sa.column('suspects', sa.JSON()), sa.column('first_bad_step', sa.Integer()))
    conn = op.get_bind()
    for row in conn.execute(sa.select(incidents.c.id, incidents.c.evidence)).all():
        named = _from_evidence(row.evidence)
        first = row.evidence.get("first_step") if isinstance(row.evidence, dict) else None
        first = first if isinstance(first, int) and not isinstance(first, bool) else None
        if named or first is not None:
            conn.execute(incidents.update().where(incidents.c.id == row.id).values(suspects=named,
                                                                                   first_bad_step=first))


def downgrade() -> None:
    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.drop_column('first_bad_step')
        batch_op.drop_column('suspects')

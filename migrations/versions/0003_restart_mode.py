"""Whether each restart was warm or cold, and why.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 15:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('restarts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('mode', sa.String(length=20), nullable=True))
        batch_op.add_column(sa.Column('mode_why', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('restarts', schema=None) as batch_op:
        batch_op.drop_column('mode_why')
        batch_op.drop_column('mode')

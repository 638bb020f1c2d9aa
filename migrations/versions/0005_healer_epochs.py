"""Each job's healer epoch: claimed by every healer that starts driving the job and carried in its orders, so that
agents refuse an older healer's.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-08 10:20:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('healer_epochs',
    sa.Column('job', sa.String(length=200), nullable=False),
    sa.Column('epoch', sa.Integer(), nullable=False),
    sa.Column('claimed_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('claimed_by', sa.String(length=200), nullable=False),
    sa.PrimaryKeyConstraint('job', name=op.f('pk_healer_epochs'))
    )


def downgrade() -> None:
    op.drop_table('healer_epochs')

"""Node history (which incidents named a node, who excluded it), the attempt an incident happened in and which
healer acts on it, and what each restart did (its attempt, start time, dp, resume point, skipped batches, the work it put at risk).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 18:52:08.496821
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('node_incidents',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('node', sa.String(length=253), nullable=False),
    sa.Column('job', sa.String(length=200), nullable=False),
    sa.Column('incident_ref', sa.String(length=64), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=True),
    sa.Column('kind', sa.String(length=100), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_node_incidents_incident_id_incidents'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_node_incidents')),
    sa.UniqueConstraint('node', 'job', 'incident_ref', name=op.f('uq_node_incidents_node'))
    )
    with op.batch_alter_table('node_incidents', schema=None) as batch_op:
        batch_op.create_index('ix_node_incidents_node_at', ['node', 'at'], unique=False)

    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.add_column(sa.Column('attempt', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('handler', sa.String(length=200), nullable=True))
        batch_op.create_index(batch_op.f('ix_incidents_handler'), ['handler'], unique=False)

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.add_column(sa.Column('excluded_by', sa.Integer(), nullable=True))
        batch_op.create_foreign_key(batch_op.f('fk_nodes_excluded_by_incidents'), 'incidents', ['excluded_by'], ['id'], ondelete='SET NULL')

    with op.batch_alter_table('restarts', schema=None) as batch_op:
        batch_op.add_column(sa.Column('cause', sa.String(length=20), nullable=False,
                                      server_default='remediation'))
        batch_op.add_column(sa.Column('attempt', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('started_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('dp', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('resume', sa.Text(), nullable=True))
        batch_op.add_column(sa.Column('skip_steps', sa.JSON(), nullable=False,
                                      server_default=sa.text("'[]'")))
        batch_op.add_column(sa.Column('highest_step', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('restarts', schema=None) as batch_op:
        batch_op.drop_column('highest_step')
        batch_op.drop_column('skip_steps')
        batch_op.drop_column('resume')
        batch_op.drop_column('dp')
        batch_op.drop_column('started_at')
        batch_op.drop_column('attempt')
        batch_op.drop_column('cause')

    with op.batch_alter_table('nodes', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('fk_nodes_excluded_by_incidents'), type_='foreignkey')
        batch_op.drop_column('excluded_by')

    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_incidents_handler'))
        batch_op.drop_column('handler')
        batch_op.drop_column('attempt')

    with op.batch_alter_table('node_incidents', schema=None) as batch_op:
        batch_op.drop_index('ix_node_incidents_node_at')

    op.drop_table('node_incidents')

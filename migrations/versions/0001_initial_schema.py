"""The initial schema: jobs, nodes, incidents and their events, runbook runs, remediations, restarts, goodput.

Revision ID: 0001
Revises: 
Create Date: 2026-11-30 02:43:48.768607
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('incidents',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('active_fingerprint', sa.String(length=64), nullable=True),
    sa.Column('rule', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=100), nullable=False),
    sa.Column('severity', sa.String(length=20), nullable=False),
    sa.Column('page', sa.String(length=20), nullable=False),
    sa.Column('state', sa.String(length=20), nullable=False),
    sa.Column('job', sa.String(length=200), nullable=True),
    sa.Column('node', sa.String(length=253), nullable=True),
    sa.Column('summary', sa.Text(), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.Column('occurrences', sa.Integer(), nullable=False),
    sa.Column('opened_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('state_since', sa.DateTime(timezone=True), nullable=False),
    sa.Column('next_action_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('resolved_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('owner', sa.String(length=200), nullable=True),
    sa.Column('acknowledged_by', sa.String(length=200), nullable=True),
    sa.Column('notified_resolved', sa.Boolean(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_incidents')),
    sa.UniqueConstraint('active_fingerprint', name=op.f('uq_incidents_active_fingerprint'))
    )
    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_incidents_fingerprint'), ['fingerprint'], unique=False)
        batch_op.create_index(batch_op.f('ix_incidents_next_action_at'), ['next_action_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_incidents_state'), ['state'], unique=False)

    op.create_table('jobs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('first_seen', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('name', name=op.f('uq_jobs_name'))
    )
    op.create_table('nodes',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=253), nullable=False),
    sa.Column('last_job', sa.String(length=200), nullable=True),
    sa.Column('first_seen', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ranks', sa.Integer(), nullable=False),
    sa.Column('excluded_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('excluded_reason', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_nodes')),
    sa.UniqueConstraint('name', name=op.f('uq_nodes_name'))
    )
    op.create_table('goodput_intervals',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job', sa.String(length=200), nullable=False),
    sa.Column('kind', sa.String(length=20), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=True),
    sa.Column('steps', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_goodput_intervals_incident_id_incidents'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_goodput_intervals')),
    sa.UniqueConstraint('job', 'kind', 'started_at', name=op.f('uq_goodput_intervals_job'))
    )
    with op.batch_alter_table('goodput_intervals', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_goodput_intervals_job'), ['job'], unique=False)

    op.create_table('incident_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('kind', sa.String(length=20), nullable=False),
    sa.Column('from_state', sa.String(length=20), nullable=True),
    sa.Column('to_state', sa.String(length=20), nullable=True),
    sa.Column('actor', sa.String(length=200), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_incident_events_incident_id_incidents'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_incident_events'))
    )
    with op.batch_alter_table('incident_events', schema=None) as batch_op:
        batch_op.create_index('ix_incident_events_incident_at', ['incident_id', 'at'], unique=False)

    op.create_table('remediations',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=False),
    sa.Column('action', sa.String(length=100), nullable=False),
    sa.Column('decided_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('outcome', sa.String(length=20), nullable=True),
    sa.Column('basis', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_remediations_incident_id_incidents'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_remediations'))
    )
    with op.batch_alter_table('remediations', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_remediations_incident_id'), ['incident_id'], unique=False)

    op.create_table('restarts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('job', sa.String(length=200), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=True),
    sa.Column('requested_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('resumed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('from_step', sa.Integer(), nullable=True),
    sa.Column('resumed_step', sa.Integer(), nullable=True),
    sa.Column('nodes', sa.JSON(), nullable=False),
    sa.Column('excluded', sa.JSON(), nullable=False),
    sa.Column('outcome', sa.String(length=20), nullable=True),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_restarts_incident_id_incidents'), ondelete='SET NULL'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_restarts'))
    )
    with op.batch_alter_table('restarts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_restarts_job'), ['job'], unique=False)

    op.create_table('runbook_runs',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('incident_id', sa.Integer(), nullable=True),
    sa.Column('runbook', sa.String(length=200), nullable=False),
    sa.Column('nodes', sa.JSON(), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('verdict', sa.String(length=20), nullable=True),
    sa.Column('summary', sa.Text(), nullable=True),
    sa.Column('result', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['incident_id'], ['incidents.id'], name=op.f('fk_runbook_runs_incident_id_incidents'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_runbook_runs'))
    )
    with op.batch_alter_table('runbook_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_runbook_runs_incident_id'), ['incident_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('runbook_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_runbook_runs_incident_id'))

    op.drop_table('runbook_runs')
    with op.batch_alter_table('restarts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_restarts_job'))

    op.drop_table('restarts')
    with op.batch_alter_table('remediations', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_remediations_incident_id'))

    op.drop_table('remediations')
    with op.batch_alter_table('incident_events', schema=None) as batch_op:
        batch_op.drop_index('ix_incident_events_incident_at')

    op.drop_table('incident_events')
    with op.batch_alter_table('goodput_intervals', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_goodput_intervals_job'))

    op.drop_table('goodput_intervals')
    op.drop_table('nodes')
    op.drop_table('jobs')
    with op.batch_alter_table('incidents', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_incidents_state'))
        batch_op.drop_index(batch_op.f('ix_incidents_next_action_at'))
        batch_op.drop_index(batch_op.f('ix_incidents_fingerprint'))

    op.drop_table('incidents')

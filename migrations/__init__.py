"""Alembic migrations of the healer's database (`megaheal db upgrade`). A package only so that it ships."""

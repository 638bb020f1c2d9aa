"""Incidents: the one lifecycle (states.py), its SQL store (every write a conditional UPDATE), the database and its
models, what is kept of jobs and hosts, and an incident's story read back. All SQL of the healer lives here."""

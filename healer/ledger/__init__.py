"""The goodput ledger: where a run's wall time went (productive, lost work, detection, diagnosis, restart, ...),
computed from the run's files and its incidents, written to the database and served as metrics."""

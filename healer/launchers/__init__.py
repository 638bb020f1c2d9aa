"""The healer's hands: launchers that place attempts of a job on hosts, the coordinator that watches their
processes, and node diagnostics run on a host."""

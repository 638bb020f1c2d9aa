"""The wire: every record that crosses a process or a file, typed once (msgspec structs, or a packed layout) and
imported by both ends: the ranks' telemetry datagrams and the sidecars' heartbeat batches, the relays' columns, the
phase beacon a rank keeps in shared memory, a warm pool's generation plans, the node agents' orders, runbook
verdicts. It stands on the ground only (a test checks it)."""

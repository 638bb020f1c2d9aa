"""Fault tolerance per data-parallel replica group (torchft's per-step quorum), megaheal's side of it."""

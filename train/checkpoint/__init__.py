"""Checkpoints that survive faults: async save, manifest and `latest` marker, fallback, resharding resume."""

"""Front door: `megaheal healer`, the healer as an HTTP service (heartbeats and Alertmanager in, incidents out)."""

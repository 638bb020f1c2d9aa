"""Grafana dashboards as code (grafana-foundation-sdk): `megaheal dashboards build` writes dashboards/*.json,
which Grafana's provisioning loads (deploy/grafana) and `megaheal dashboards push` uploads."""

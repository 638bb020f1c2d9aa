"""The healer: one service per training job that turns signals into incidents and incidents into action.

Inputs: heartbeat batches from the node sidecars, Alertmanager webhooks, PromQL rules evaluated
against Prometheus. State: incidents and their transitions in a SQL database (healer.incidents.models,
migrations/). Outputs: incidents posted to Alertmanager, a generic webhook, Grafana annotations,
and /metrics. `megaheal healer` runs it; `megaheal db upgrade` migrates its database.
"""

"""On-call: where incidents go (Alertmanager, webhooks, Grafana annotations) and the Alertmanager webhook that
brings alerts in."""

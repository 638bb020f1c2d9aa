"""The incidents dashboard: what is broken now, how long each stage of each incident took, what the healer did.

Incident tables read the healer's database (tables of healer/incidents/models.py) through Grafana's PostgreSQL
datasource; the healer's own health comes from its /metrics through Prometheus.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from dashboards.common import Sql, datasource_variable, incident_annotation, link, pages_variable, prom, proms

UID = "megaheal-incidents"
INCIDENT_PAGE = "${pages}/incidents/${__value.raw}"
# NOTE: the training dashboard's uid, written out (it imports this module for the link back).
TRAINING_OF_JOB = "/d/megaheal-training/megaheal-training?var-job=${__value.raw:percentencode}&${datasource:queryparam}"

OPEN_SQL = """
SELECT id AS "incident", opened_at AS "opened", state, severity, kind, rule, job, node, summary, occurrences,
       acknowledged_by AS "acknowledged by"
FROM incidents WHERE resolved_at IS NULL ORDER BY opened_at DESC LIMIT 200
"""

# Stage times of each incident: diagnosis and recovery from its transitions (incident_events), detection and
# lost work from the goodput ledger (goodput_intervals), all in seconds.
TIMINGS_SQL = """
SELECT i.id AS "incident", i.opened_at AS "opened", i.rule, i.job, i.node, i.state,
       led.detection AS "detection",
       EXTRACT(EPOCH FROM tr.remediating - tr.diagnosing) AS "diagnosis",
       EXTRACT(EPOCH FROM i.resolved_at - COALESCE(tr.remediating, tr.diagnosing, i.opened_at)) AS "recovery",
       EXTRACT(EPOCH FROM i.resolved_at - i.opened_at) AS "time to resolve",
       led.lost AS "lost work"
FROM incidents i
LEFT JOIN LATERAL (
  SELECT MIN(e.at) FILTER (WHERE e.to_state = 'diagnosing') AS diagnosing,
         MIN(e.at) FILTER (WHERE e.to_state = 'remediating') AS remediating
  FROM incident_events e WHERE e.incident_id = i.id) tr ON TRUE
LEFT JOIN LATERAL (
  SELECT SUM(EXTRACT(EPOCH FROM g.ended_at - g.started_at)) FILTER (WHERE g.kind = 'detection') AS detection,
         SUM(EXTRACT(EPOCH FROM g.ended_at - g.started_at)) FILTER (WHERE g.kind = 'lost') AS lost
  FROM goodput_intervals g WHERE g.incident_id = i.id) led ON TRUE
WHERE $__timeFilter(i.opened_at)
ORDER BY i.opened_at DESC LIMIT 200
"""

MTTR_SQL = """
SELECT AVG(EXTRACT(EPOCH FROM resolved_at - opened_at)) AS "MTTR"
FROM incidents WHERE resolved_at IS NOT NULL AND $__timeFilter(opened_at)
"""

OPENED_SQL = """
SELECT COUNT(*) AS "opened", COUNT(*) FILTER (WHERE state = 'escalated' OR acknowledged_by IS NOT NULL) AS "needed a person"
FROM incidents WHERE $__timeFilter(opened_at)
"""

BY_KIND_SQL = """
SELECT $__timeGroupAlias(opened_at, 1h), kind AS metric, COUNT(*) AS value
FROM incidents WHERE $__timeFilter(opened_at) GROUP BY 1, 2 ORDER BY 1
"""

ACTIONS_SQL = """
SELECT r.decided_at AS "decided", r.incident_id AS "incident", i.rule, r.action, r.outcome,
       r.finished_at AS "finished", i.job, i.node
FROM remediations r JOIN incidents i ON i.id = r.incident_id
WHERE $__timeFilter(r.decided_at) ORDER BY r.decided_at DESC LIMIT 100
"""

TRANSITIONS_SQL = """
SELECT e.at AS "time", e.incident_id AS "incident", i.rule, e.kind, e.from_state AS "from", e.to_state AS "to",
       e.actor
FROM incident_events e JOIN incidents i ON i.id = e.incident_id
WHERE $__timeFilter(e.at) ORDER BY e.at DESC LIMIT 100
"""

RESTARTS_SQL = """
SELECT requested_at AS "requested", job, incident_id AS "incident", from_step AS "from step",
       resumed_step AS "resumed at step", resumed_at AS "resumed", excluded::text AS "excluded nodes", outcome
FROM restarts WHERE $__timeFilter(requested_at) ORDER BY requested_at DESC LIMIT 100
"""


def _table(title: str, sql: str, description: str, span: int = 24, unit: str = "") -> table.Panel:
    """A table of the healer's database; its `incident` column opens the incident's page, its `job` column the
    training dashboard of that job (columns a table does not have are left alone)."""
    panel = (table.Panel().title(title).description(description).height(8).span(span)
             .with_target(Sql(sql))  # type: ignore[arg-type]
             .override_by_name("incident", [model.DynamicConfigValue(id_val="links", value=[
                 {"title": "Incident #${__value.raw}", "url": INCIDENT_PAGE, "targetBlank": True}])])
             .override_by_name("job", [model.DynamicConfigValue(id_val="links", value=[
                 {"title": "Training of ${__value.raw}", "url": TRAINING_OF_JOB}])]))
    return panel.unit(unit) if unit else panel


def _now_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Now"))
    board.with_panel(
        stat.Panel().title("Open incidents").height(5).span(6)
        .description("Incidents not yet resolved, by severity (from the healer's /metrics).")
        .with_target(prom("sum by (severity) (megaheal_incidents_open)", "{{severity}}", instant=True))
        .color_mode(common.BigValueColorMode.BACKGROUND))
    board.with_panel(
        stat.Panel().title("MTTR").height(5).span(6).unit("s")
        .description("Mean time from opening to resolution of the incidents opened in the range.")
        .with_target(Sql(MTTR_SQL)))  # type: ignore[arg-type]
    board.with_panel(
        stat.Panel().title("Incidents in range").height(5).span(6)
        .description("Opened in the range, and how many of them needed a person (escalated or acknowledged).")
        .with_target(Sql(OPENED_SQL)))  # type: ignore[arg-type]
    board.with_panel(
        stat.Panel().title("Healer").height(5).span(6)
        .description("1 when Prometheus reaches the healer and the healer its database.")
        .targets(proms(('min(up{job="megaheal-healer"})', "up"), ("min(megaheal_healer_db_up)", "database")))
        .color_mode(common.BigValueColorMode.BACKGROUND))
    board.with_panel(_table("Open incidents", OPEN_SQL, "Every incident not yet resolved, newest first."))


def _history_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("History"))
    board.with_panel(_table(
        "Detection, diagnosis and recovery times", TIMINGS_SQL, "Per incident, in seconds: detection and lost "
        "work from the goodput ledger; diagnosis (diagnosing to remediating) and recovery (to resolved) from its "
        "transitions.", unit="s"))
    board.with_panel(
        timeseries.Panel().title("Incidents opened per hour, by kind").height(8).span(12)
        .with_target(Sql(BY_KIND_SQL, fmt="time_series")).unit("none"))  # type: ignore[arg-type]
    board.with_panel(
        timeseries.Panel().title("Healer activity").height(8).span(12).unit("cps")
        .description("Alerts the healer received (matched a rule or not) and incident transitions it made.")
        .targets(proms(
            ("sum by (status, matched) (rate(megaheal_healer_alerts_received_total[$__rate_interval]))",
             "alerts {{status}} matched={{matched}}"),
            ("sum by (to_state) (rate(megaheal_healer_transitions_total[$__rate_interval]))", "to {{to_state}}"),
            ("sum(rate(megaheal_healer_heartbeat_batches_total[$__rate_interval]))", "heartbeat batches"))))
    board.with_panel(_table("Recent actions", ACTIONS_SQL, "Remediations the healer decided on, newest first.",
                            span=12))
    board.with_panel(_table("Recent transitions", TRANSITIONS_SQL, "Every state change, by the healer or a person.",
                            span=12))
    board.with_panel(_table("Restarts", RESTARTS_SQL, "Job restarts: from which step, resumed at which, without "
                                                      "which nodes."))


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard("megaheal / incidents").uid(UID).tags(["megaheal", "incidents"]).refresh("1m")
        .time("now-7d", "now").timezone("utc").tooltip(model.DashboardCursorSync.CROSSHAIR)
        .description("Open incidents, their stage times, MTTR and the healer's actions (healer database).")
        .with_variable(datasource_variable("prometheus"))
        .with_variable(datasource_variable("postgres"))
        .with_variable(pages_variable())
        .link(link("Incident pages", "${pages}/incidents", "The healer's own pages: every incident, its stages, "
                   "diagnosis, heat map and timeline.", keep_time=False, icon="external link"))
        .annotation(incident_annotation())
    )
    _now_row(board)
    _history_row(board)
    return board

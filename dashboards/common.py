"""Shared pieces of the megaheal dashboards: datasource variables, query builders, variables, links and the
incident annotation.

Every query names its datasource through a dashboard variable ($datasource for Prometheus, $incidents_db for the
healer's PostgreSQL, $tempo for traces), as dashboards shared on grafana.com do: imported into any Grafana they ask
which datasource to use. Each variable's default is the uid deploy/grafana/provisioning gives that datasource, so the
docker-compose stack needs no choice (docs/operations.md).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, tempo
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus as prom_model
from grafana_foundation_sdk.models import tempo as tempo_model

# (variable, datasource type, label, provisioned uid, provisioned name): deploy/grafana/provisioning/datasources.
DATASOURCES = {
    "prometheus": ("datasource", "prometheus", "Prometheus", "megaheal-prometheus", "Prometheus"),
    "postgres": ("incidents_db", "grafana-postgresql-datasource", "Incidents DB", "megaheal-postgres",
                 "megaheal incidents"),
    "tempo": ("tempo", "tempo", "Traces", "megaheal-tempo", "Tempo"),
}
PROMETHEUS, POSTGRES, TEMPO = (model.DataSourceRef(type_val=kind, uid=f"${{{var}}}")
                               for var, kind, *_ in DATASOURCES.values())
PAGES_DEFAULT = "http://localhost:8470"
"""Where the healer serves its incident pages on the docker-compose stack (its port on the host's loopback)."""

# NOTE: refIds must be unique within a panel; Grafana shows nothing for a target without one.
REF_IDS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


# ---- queries ----------------------------------------------------------------------------------------------------

def prom(expr: str, legend: str = "", ref: str = "A", instant: bool = False, table: bool = False) -> prometheus.Dataquery:
    """A PromQL target. `table`: instant query in table format (for tables and bar gauges)."""
    query = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(PROMETHEUS)
    if legend:
        query = query.legend_format(legend)
    if instant or table:
        query = query.instant()
    else:
        query = query.range()
    if table:
        query = query.format(prom_model.PromQueryFormat.TABLE)
    return query


def proms(*queries: tuple[str, str]) -> list[cogbuilder.Builder[cogvariants.Dataquery]]:
    """Several (expr, legend) targets with refIds A, B, C, ..."""
    targets: list[cogbuilder.Builder[cogvariants.Dataquery]] = [
        prom(expr, legend, REF_IDS[i]) for i, (expr, legend) in enumerate(queries)]
    return targets


class SqlQuery(cogvariants.Dataquery):
    """A raw SQL target of Grafana's PostgreSQL datasource (the SDK has no builder for it).

    Grafana expands its macros ($__timeFilter(col), $__timeFrom(), $__timeTo(), $__timeGroupAlias(col, 1h))
    and dashboard variables before sending the statement to PostgreSQL.
    """

    def __init__(self, raw_sql: str, ref_id: str, fmt: str) -> None:
        if fmt not in ("table", "time_series"):
            raise ValueError(f"format must be table or time_series, got {fmt!r}")
        self.raw_sql, self.ref_id, self.fmt = " ".join(raw_sql.split()), ref_id, fmt

    def to_json(self) -> dict[str, object]:
        return {"datasource": POSTGRES, "editorMode": "code", "format": self.fmt, "rawQuery": True,
                "rawSql": self.raw_sql, "refId": self.ref_id}


class Sql(cogbuilder.Builder[SqlQuery]):
    def __init__(self, raw_sql: str, ref: str = "A", fmt: str = "table") -> None:
        self._query = SqlQuery(raw_sql, ref, fmt)

    def build(self) -> SqlQuery:
        return self._query


def traceql(query: str, ref: str = "A", limit: int = 20) -> tempo.TempoQuery:
    """A TraceQL search of the $tempo datasource, listed as traces."""
    return (tempo.TempoQuery().ref_id(ref).datasource(TEMPO).query_type("traceql").query(query).limit(limit)
            .table_type(tempo_model.SearchTableType.TRACES))


# ---- variables and annotations ----------------------------------------------------------------------------------

def datasource_variable(which: str) -> dash.DatasourceVariable:
    """The variable that picks the datasource of one kind (DATASOURCES), defaulting to the provisioned one."""
    var, kind, label, uid, name = DATASOURCES[which]
    return (dash.DatasourceVariable(var).label(label).type(kind)
            .current(model.VariableOption(selected=True, text=name, value=uid)))


def pages_variable() -> dash.TextBoxVariable:
    """$pages: the base URL of the healer's incident pages, which incident links open."""
    return (dash.TextBoxVariable("pages").label("Incident pages").default_value(PAGES_DEFAULT)
            .description("Base URL of the healer's incident pages (`megaheal healer`, port 8470), as your browser "
                         "reaches it.")
            .current(model.VariableOption(selected=True, text=PAGES_DEFAULT, value=PAGES_DEFAULT)))


def link(title: str, url: str, tooltip: str = "", keep_time: bool = True, icon: str = "dashboard") -> dash.DashboardLink:
    """A link in the dashboard's header (variables in `url` are interpolated by Grafana)."""
    return (dash.DashboardLink(title).type(model.DashboardLinkType.LINK).url(url).tooltip(tooltip).icon(icon)
            .keep_time(keep_time))


def data_link(title: str, url: str) -> dash.DashboardLink:
    """A link on a panel's values; `url` may use ${__field.labels.X}, ${__value.raw} and the dashboard's variables."""
    return dash.DashboardLink(title).url(url)


def explore_traces(query: str) -> str:
    """The Explore URL of a TraceQL search in $tempo over the dashboard's range. NOTE: the pane is JSON in the URL,
    percent-encoded here except for the ${...} Grafana interpolates when the link is followed; values put inside
    the TraceQL must be percent-encoded themselves (${job:percentencode})."""
    pane = {"datasource": "${tempo}", "queries": [
        {"refId": "A", "datasource": {"type": "tempo", "uid": "${tempo}"}, "queryType": "traceql", "query": query,
         "limit": 20, "tableType": "traces"}], "range": {"from": "${__from}", "to": "${__to}"}}
    return "/explore?schemaVersion=1&panes=" + quote(json.dumps({"traces": pane}, separators=(",", ":")), safe="${}:.")


def label_variable(name: str, metric: str, label: str, *, multi: bool, label_text: str) -> dash.QueryVariable:
    """A variable listing the values of `label` on `metric` (label_values), refreshed with the time range."""
    variable = (
        dash.QueryVariable(name).label(label_text).datasource(PROMETHEUS)
        .query({"query": f"label_values({metric}, {label})", "refId": "PrometheusVariableQueryEditor-VariableQuery",
                "qryType": 1})
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(model.VariableSort.ALPHABETICAL_ASC)
    )
    if multi:
        variable = variable.multi(True).include_all(True).all_value(".*")
    return variable


def incident_annotation(job_filter: str = "") -> dash.AnnotationQuery:
    """Incidents of the healer's database as annotations: a region from opening to resolution."""
    where = f"AND (job IS NULL OR job = '{job_filter}')" if job_filter else ""
    sql = f"""SELECT opened_at AS time, COALESCE(resolved_at, NOW()) AS "timeEnd",
                     '#' || id || ' ' || rule || ' [' || state || ']: ' || summary AS text,
                     kind || ',' || severity AS tags
              FROM incidents WHERE opened_at <= $__timeTo() AND COALESCE(resolved_at, NOW()) >= $__timeFrom()
              {where} ORDER BY opened_at"""
    return (dash.AnnotationQuery().name("Incidents").datasource(POSTGRES).enable(True).icon_color("red")
            .target(Sql(sql, "Anno")))  # type: ignore[arg-type]


# ---- rendering --------------------------------------------------------------------------------------------------

def render(board: dash.Dashboard) -> str:
    """The dashboard's JSON as committed: keys sorted and indented, so a regeneration diff is readable."""
    data = json.loads(json.dumps(board.build(), cls=JSONEncoder))
    for panel in data.get("panels", []):
        _panel_datasource(panel)
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _panel_datasource(panel: dict[str, Any]) -> None:
    """Give a panel its targets' datasource. NOTE: a panel without one runs its queries on Grafana's default
    datasource unless the targets all agree; naming it keeps the $datasource choice on every panel."""
    for inner in panel.get("panels", []):
        _panel_datasource(inner)
    sources = {json.dumps(t["datasource"], sort_keys=True) for t in panel.get("targets", []) if "datasource" in t}
    if len(sources) == 1 and "datasource" not in panel:
        panel["datasource"] = json.loads(sources.pop())

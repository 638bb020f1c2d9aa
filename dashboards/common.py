"""Shared pieces of the megaheal dashboards: datasources, query builders, variables and the incident annotation.

The datasource uids are the ones deploy/grafana/provisioning gives them, so the generated JSON works on the
docker-compose stack as is, and on another Grafana after `megaheal dashboards push` as long as its
datasources carry the same uids (docs/operations.md).
"""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog import variants as cogvariants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import prometheus as prom_model

PROMETHEUS = model.DataSourceRef(type_val="prometheus", uid="megaheal-prometheus")
POSTGRES = model.DataSourceRef(type_val="grafana-postgresql-datasource", uid="megaheal-postgres")
TEMPO = model.DataSourceRef(type_val="tempo", uid="megaheal-tempo")

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


# ---- variables and annotations ----------------------------------------------------------------------------------

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
    return json.dumps(board.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"

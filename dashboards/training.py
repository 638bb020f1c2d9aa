"""The training dashboard: is the job making progress, how fast, and which rank or phase holds it back.

Job-wide panels read the recording rules of deploy/prometheus/rules/recording.yml (one series per job),
so they stay cheap at 12,288 ranks; per-rank panels are filtered by the node and rank variables. Step and phase
times are exact means over every step the sidecars received (their running totals under rate()), not the last step a
scrape happened to see. Links lead from a node to its GPUs, from a rank to its step traces, and to the incidents.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import bargauge, heatmap, stat, table, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap as heatmap_options
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model

from dashboards import gpus, incidents
from dashboards.common import (
    Sql,
    data_link,
    datasource_variable,
    explore_traces,
    incident_annotation,
    label_variable,
    link,
    pages_variable,
    prom,
    proms,
    traceql,
)

UID = "megaheal-training"
JOB = 'job="$job"'
NODES = 'job="$job", node=~"$node"'
RANKS = 'job="$job", node=~"$node", rank=~"$rank"'
RATE = "[$__rate_interval]"

# ETTR (effective training time ratio) over the dashboard's range, from the healer's ledger, each interval clipped to
# the range: productive time / wall time, the one definition of the report, the pages and `megaheal run`'s
# megaheal_goodput_ettr_ratio (healer/ledger/goodput.py). Checkpointing is shown beside it, never added to it.
_CLIPPED = ("EXTRACT(EPOCH FROM (LEAST(ended_at, $__timeTo()) - GREATEST(started_at, $__timeFrom())))")
GOODPUT_SQL = f"""
SELECT SUM({_CLIPPED}) FILTER (WHERE kind = 'productive') / NULLIF(SUM({_CLIPPED}), 0) AS "ETTR",
       SUM({_CLIPPED}) FILTER (WHERE kind = 'checkpointing') / NULLIF(SUM({_CLIPPED}), 0) AS "Checkpointing"
FROM goodput_intervals
WHERE job = '$job' AND started_at < $__timeTo() AND ended_at > $__timeFrom()
"""

# Links. NOTE: ${var:queryparam} carries a multi-value variable as var-node=a&var-node=b; ${__url_time_range} the range.
GPUS_OF_NODES = f"/d/{gpus.UID}/megaheal-gpus?${{node:queryparam}}&${{datasource:queryparam}}"
GPUS_OF_NODE = (f"/d/{gpus.UID}/megaheal-gpus?var-node=${{__field.labels.node}}&${{datasource:queryparam}}"
                "&${__url_time_range}")
RANK_TRACES = explore_traces('{ span.megaheal.job = "${job:percentencode}" && span.megaheal.rank = ${__field.labels.rank} }')
JOB_TRACES = '{ span.megaheal.job = "$job" }'
# Mean seconds of each phase per step, grouped by `by`: every step's phases (summed per node by the sidecars) over
# the number of steps (the step histogram's count), exact whatever the scrape interval.
PHASE_MEAN = ("sum by ({by}) (rate(megaheal_step_phase_seconds_total{{{nodes}}}{rate})) / on ({on}) group_left "
              "sum by ({on}) (rate(megaheal_step_duration_seconds_count{{{nodes}}}{rate}))")


def by_rank_number(expr: str, digits: int = 6) -> str:
    """expr with its series in the numeric order of their rank, each labelled only by rank.

    NOTE: Prometheus returns series sorted by their labels as strings (rank 10 before rank 2), and Prometheus 2.x has
    no function that sorts by a label's number. The rank, zero-padded into a label `order` (a label_replace for each
    number of digits, anchored), sorts first (`order` < `rank`), so the string order is the numeric one; Grafana's
    heat map keeps the order it is given."""
    padded = expr
    for width in range(1, digits + 1):
        padded = (f'label_replace({padded}, "order", "{"0" * (digits - width)}$1", "rank", "([0-9]{{{width}}})")')
    return f"max by (order, rank) ({padded})"
def _stat(title: str, target, unit: str, description: str) -> stat.Panel:
    return (stat.Panel().title(title).description(description).with_target(target).unit(unit).height(5).span(6)
            .graph_mode(common.BigValueGraphMode.AREA).color_mode(common.BigValueColorMode.VALUE))


def _series(title: str, targets, unit: str, description: str, span: int = 12, stacked: bool = False) -> timeseries.Panel:
    panel = (timeseries.Panel().title(title).description(description).targets(targets).unit(unit).height(8)
             .span(span).fill_opacity(10))
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(60)
    return panel


def _throughput_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Throughput and goodput"))
    board.with_panel(_stat("MFU", prom(f"job:megaheal_mfu:avg{{{JOB}}}", "MFU"), "percentunit",
                           "Model FLOPs utilisation, mean over ranks (6N + 12·L·h·s FLOPs per token)."))
    board.with_panel(_stat("Tokens/s", prom(f"job:megaheal_tokens_per_second:avg{{{JOB}}}", "tokens/s"), "short",
                           "Tokens per second of the whole job."))
    board.with_panel(
        stat.Panel().title("ETTR").height(5).span(6).unit("percentunit").min(0).max(1)
        .description("From the healer's goodput ledger over the dashboard's range: ETTR = productive time / wall "
                     "time, as in `megaheal report` and the incident pages; the share spent checkpointing beside it.")
        .with_target(Sql(GOODPUT_SQL)))  # type: ignore[arg-type]
    board.with_panel(_stat("Step (slowest rank)", prom(f"job:megaheal_step:min{{{JOB}}}", "step"), "none",
                           "Last step every rank has completed."))
    board.with_panel(_series("MFU", proms((f"job:megaheal_mfu:avg{{{JOB}}}", "job"),
                                          (f'node:megaheal_mfu:avg{{{NODES}}}', "{{node}}")),
                             "percentunit", "Job MFU and each node's mean; a node below the others is a suspect.")
                     .data_links([data_link("GPUs of ${__field.labels.node}", GPUS_OF_NODE)]))
    board.with_panel(_series("Tokens/s", proms((f"job:megaheal_tokens_per_second:avg{{{JOB}}}", "tokens/s")),
                             "short", "Tokens per second of the whole job."))
    board.with_panel(_series("Loss and gradient norm", proms((f"job:megaheal_loss:avg{{{JOB}}}", "loss"),
                                                             (f"job:megaheal_grad_norm:max{{{JOB}}}", "grad norm")),
                             "short", "Mean loss over ranks and the largest gradient norm before clipping."))
    board.with_panel(_series("Step progress", proms((f"job:megaheal_step:max{{{JOB}}}", "fastest rank"),
                                                    (f"job:megaheal_step:min{{{JOB}}}", "slowest rank")),
                             "none", "A gap between the fastest and the slowest rank that grows is a hang."))


def _step_time_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Step time and stragglers"))
    compute = (f"rate(megaheal_rank_compute_seconds_sum{{{RANKS}}}{RATE}) "
               f"/ rate(megaheal_rank_compute_seconds_count{{{RANKS}}}{RATE})")
    board.with_panel(
        heatmap.Panel().title("Compute time by rank").height(10).span(24)
        .description("Each row is a rank (in rank order), each cell its mean compute per step (forward/backward and "
                     "optimizer) over every step in the interval: a rank that stays darker is a straggler. Not the "
                     "whole step: in a synchronous job every rank's step lasts as long as the slowest one's.")
        .with_target(prom(by_rank_number(compute), "{{rank}}"))
        .calculate(False).unit("s")
        .rows_frame(heatmap_options.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN))
        .color(heatmap_options.HeatmapColorOptions().mode(heatmap_model.HeatmapColorMode.SCHEME).scheme("Oranges")
               .scale(heatmap_model.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
        .y_axis(heatmap_options.YAxisConfig().axis_label("rank")))
    board.with_panel(_series("Step time (every step)", proms(
        (f"job:megaheal_step_duration_seconds:mean5m{{{JOB}}}", "mean (5m)"),
        (f"histogram_quantile(0.5, sum by (le) (rate(megaheal_step_duration_seconds_bucket{{{NODES}}}{RATE})))",
         "p50"),
        (f"histogram_quantile(0.99, sum by (le) (rate(megaheal_step_duration_seconds_bucket{{{NODES}}}{RATE})))",
         "p99")), "s",
        "Mean and percentiles of every step of every rank (the sidecars' histogram): a p99 far above p50 is "
        "checkpoint stalls or hiccups."))
    board.with_panel(_series("Phase breakdown (mean per step)", proms(
        (PHASE_MEAN.format(by="phase", on="", nodes=NODES, rate=RATE), "{{phase}}")), "s",
        "Where a step's time goes: data, forward/backward, the data-parallel reduce, clipping, optimizer, "
        "checkpoint; mean per step over every step of the selected nodes.", stacked=True))
    board.with_panel(_series("Phase time per node", proms(
        (PHASE_MEAN.format(by="node, phase", on="node", nodes=NODES, rate=RATE), "{{node}} {{phase}}")),
        "s", "Each node's mean per step, by phase: a node slow in one phase only points at its cause.")
        .data_links([data_link("GPUs of ${__field.labels.node}", GPUS_OF_NODE)]))
    board.with_panel(
        bargauge.Panel().title("Straggler score (lowest 10 ranks)").height(8).span(12).min(0).max(1)
        .description("Fastest rank's compute per step / this rank's, over 2 minutes: 1 is the fastest, below 0.75 "
                     "is a straggler. Click a rank for its step traces.")
        .with_target(prom(f"bottomk(10, rank:megaheal_straggler_score:ratio{{{JOB}}})", "rank {{rank}} ({{node}})",
                          instant=True))
        .unit("percentunit")
        .data_links([data_link("Step traces of rank ${__field.labels.rank}", RANK_TRACES)]))
    board.with_panel(_series("Data-parallel reduce lag (top 10)", proms(
        (f"topk(10, megaheal_dp_reduce_lag_seconds{{{RANKS}}})", "rank {{rank}}")), "s",
        "How much later a rank entered the reduce than the earliest rank of its node: a late rank makes all "
        "others wait (a slow rank, not a slow network).")
        .data_links([data_link("Step traces of rank ${__field.labels.rank}", RANK_TRACES)]))
    board.with_panel(
        table.Panel().title("Step traces").height(8).span(24)
        .description("The job's latest steps in Tempo: one trace per step, every rank's span in it and a child per "
                     "phase. Open one to see the rank that held the step up.")
        .with_target(traceql(JOB_TRACES)))


def _run_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Supervised run (megaheal run)"))
    run = 'job="$job"'
    board.with_panel(_stat("ETTR of the run", prom(f"megaheal_goodput_ettr_ratio{{{run}}}", "ETTR"), "percentunit",
                           "`megaheal run`'s goodput ledger since the run began: productive time / wall time."))
    board.with_panel(_stat("Attempts", prom(f"megaheal_goodput_attempts_total{{{run}}}", "attempts"), "none",
                           "Attempts the launcher started: 1 plus the restarts."))
    board.with_panel(_stat("Lost steps", prom(f"megaheal_goodput_lost_steps_total{{{run}}}", "lost"), "none",
                           "Steps run and then run again after a restart from an older checkpoint."))
    board.with_panel(_stat("Open incidents of the run", prom(
        f'sum(megaheal_incidents{{{run}, state!="resolved"}}) or vector(0)', "open"), "none",
        "Incidents of this run not yet resolved."))
    board.with_panel(_series("Where the wall time went", proms(
        (f"megaheal_goodput_seconds{{{run}}}", "{{category}}")), "s",
        "The run's wall time by goodput category (they add up to the wall): productive, checkpointing, lost work, "
        "detection, diagnosis, restart, startup, other.", stacked=True))
    board.with_panel(_series("Incidents of the run", proms(
        (f"sum by (kind, state) (megaheal_incidents{{{run}}})", "{{kind}} {{state}}")), "none",
        "The run's incidents by kind and latest state.", stacked=True))


def _telemetry_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Telemetry"))
    board.with_panel(_series("Ranks up per node", proms((f'node:megaheal_rank_up:sum{{{NODES}}}',
                                                         "{{node}}")), "none",
                             "Rank processes alive on each node, as the node's sidecar sees them.", span=8)
                     .data_links([data_link("GPUs of ${__field.labels.node}", GPUS_OF_NODE)]))
    board.with_panel(_series("Telemetry drops", proms((f'node:megaheal_telemetry_dropped:rate5m{{{NODES}}}',
                                                       "{{node}}")), "cps",
                             "Records ranks could not hand to their sidecar (dropped, never waited for).", span=8))
    board.with_panel(_series("Longest rank silence", proms(
        (f"max by (node) (megaheal_rank_last_seen_seconds{{{RANKS}}})", "{{node}}")), "s",
        "Seconds since each node's sidecar last heard from its quietest rank.", span=8))


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard("megaheal / training").uid(UID).tags(["megaheal", "training"]).refresh("30s")
        .time("now-3h", "now").timezone("utc").tooltip(model.DashboardCursorSync.CROSSHAIR)
        .description("MFU, throughput, ETTR, step times, phases and stragglers of one training job.")
        .with_variable(datasource_variable("prometheus"))
        .with_variable(datasource_variable("postgres"))
        .with_variable(datasource_variable("tempo"))
        .with_variable(label_variable("job", "megaheal_step", "job", multi=False, label_text="Job"))
        .with_variable(label_variable("node", f"megaheal_step{{{JOB}}}", "node", multi=True, label_text="Node"))
        .with_variable(label_variable("rank", f'megaheal_step{{{JOB}, node=~"$node"}}', "rank", multi=True,
                                      label_text="Rank"))
        .with_variable(pages_variable())
        .link(link("GPUs of these nodes", GPUS_OF_NODES, "The GPU dashboard for the nodes selected here."))
        .link(link("Incidents", f"/d/{incidents.UID}/megaheal-incidents?${{datasource:queryparam}}"
                   "&${incidents_db:queryparam}&${pages:queryparam}", "The incidents dashboard."))
        .link(link("Incident pages of this job", "${pages}/incidents?job=${job:percentencode}",
                   "The healer's own pages of this job's incidents.", keep_time=False, icon="external link"))
        .link(link("Step traces", explore_traces('{ span.megaheal.job = "${job:percentencode}" }'),
                   "This job's step traces in Explore (Tempo).", icon="bolt"))
        .annotation(incident_annotation("$job"))
    )
    _throughput_row(board)
    _step_time_row(board)
    _run_row(board)
    _telemetry_row(board)
    return board

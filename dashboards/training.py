"""The training dashboard: is the job making progress, how fast, and which rank or phase holds it back.

Job-wide panels read the recording rules of deploy/prometheus/rules/recording.yml (one series per job),
so they stay cheap at 12,288 ranks; per-rank panels are filtered by the node and rank variables.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import bargauge, heatmap, stat, timeseries
from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap as heatmap_options
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model

from dashboards.common import Sql, incident_annotation, label_variable, prom, proms

UID = "megaheal-training"
JOB = 'job="$job"'
RANKS = 'job="$job", node=~"$node", rank=~"$rank"'

# ETTR (effective training time ratio) and goodput over the dashboard's range, from the healer's ledger:
# each interval clipped to the range; ETTR counts checkpointing as training time, goodput only productive steps.
_CLIPPED = ("EXTRACT(EPOCH FROM (LEAST(ended_at, $__timeTo()) - GREATEST(started_at, $__timeFrom())))")
GOODPUT_SQL = f"""
SELECT SUM({_CLIPPED}) FILTER (WHERE kind IN ('productive', 'checkpointing')) / NULLIF(SUM({_CLIPPED}), 0) AS "ETTR",
       SUM({_CLIPPED}) FILTER (WHERE kind = 'productive') / NULLIF(SUM({_CLIPPED}), 0) AS "Goodput"
FROM goodput_intervals
WHERE job = '$job' AND started_at < $__timeTo() AND ended_at > $__timeFrom()
"""


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
        stat.Panel().title("ETTR and goodput").height(5).span(6).unit("percentunit").min(0).max(1)
        .description("From the healer's goodput ledger over the dashboard's range: ETTR = training (and "
                     "checkpointing) time / wall time; goodput = productive time / wall time.")
        .with_target(Sql(GOODPUT_SQL)))  # type: ignore[arg-type]
    board.with_panel(_stat("Step (slowest rank)", prom(f"job:megaheal_step:min{{{JOB}}}", "step"), "none",
                           "Last step every rank has completed."))
    board.with_panel(_series("MFU", proms((f"job:megaheal_mfu:avg{{{JOB}}}", "job"),
                                          (f'node:megaheal_mfu:avg{{{JOB}, node=~"$node"}}', "{{node}}")),
                             "percentunit", "Job MFU and each node's mean; a node below the others is a suspect."))
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
    board.with_panel(
        heatmap.Panel().title("Step time by rank").height(10).span(24)
        .description("Each row is a rank, each cell its step time: a rank that stays darker is a straggler.")
        .with_target(prom(f'megaheal_step_seconds{{{RANKS}, phase="total"}}', "{{rank}}"))
        .calculate(False).unit("s")
        .rows_frame(heatmap_options.RowsHeatmapOptions().layout(common.HeatmapCellLayout.UNKNOWN))
        .color(heatmap_options.HeatmapColorOptions().mode(heatmap_model.HeatmapColorMode.SCHEME).scheme("Oranges")
               .scale(heatmap_model.HeatmapColorScale.EXPONENTIAL).exponent(0.5).steps(64))
        .y_axis(heatmap_options.YAxisConfig().axis_label("rank")))
    board.with_panel(_series("Phase breakdown (mean over ranks)", proms(
        (f'job_phase:megaheal_step_seconds:avg{{{JOB}, phase!="total"}}', "{{phase}}")), "s",
        "Where a step's time goes: data, forward/backward, the data-parallel reduce, clipping, optimizer.",
        stacked=True))
    board.with_panel(_series("Slowest node per phase", proms(
        (f'node_phase:megaheal_step_seconds:max{{{JOB}, node=~"$node", phase!="total"}}', "{{node}} {{phase}}")),
        "s", "The slowest rank of each node, by phase: a node slow in one phase only points at its cause."))
    board.with_panel(
        bargauge.Panel().title("Straggler score (lowest 10 ranks)").height(8).span(12).min(0).max(1)
        .description("Fastest rank's step time / this rank's, over 2 minutes: 1 is the fastest, below 0.75 "
                     "is a straggler.")
        .with_target(prom(f"bottomk(10, rank:megaheal_straggler_score:ratio{{{JOB}}})", "rank {{rank}} ({{node}})",
                          instant=True))
        .unit("percentunit"))
    board.with_panel(_series("Data-parallel reduce lag (top 10)", proms(
        (f"topk(10, megaheal_dp_reduce_lag_seconds{{{RANKS}}})", "rank {{rank}}")), "s",
        "How much later a rank entered the reduce than the earliest rank of its node: a late rank makes all "
        "others wait (a slow rank, not a slow network)."))


def _telemetry_row(board: dash.Dashboard) -> None:
    board.with_row(dash.Row("Telemetry"))
    board.with_panel(_series("Ranks up per node", proms((f'node:megaheal_rank_up:sum{{{JOB}, node=~"$node"}}',
                                                         "{{node}}")), "none",
                             "Rank processes alive on each node, as the node's sidecar sees them.", span=8))
    board.with_panel(_series("Telemetry drops", proms((f'node:megaheal_telemetry_dropped:rate5m{{{JOB}, node=~"$node"}}',
                                                       "{{node}}")), "cps",
                             "Records ranks could not hand to their sidecar (dropped, never waited for).", span=8))
    board.with_panel(_series("Longest rank silence", proms(
        (f"max by (node) (megaheal_rank_last_seen_seconds{{{RANKS}}})", "{{node}}")), "s",
        "Seconds since each node's sidecar last heard from its quietest rank.", span=8))


def build() -> dash.Dashboard:
    board = (
        dash.Dashboard("megaheal / training").uid(UID).tags(["megaheal", "training"]).refresh("30s")
        .time("now-3h", "now").timezone("utc").tooltip(model.DashboardCursorSync.CROSSHAIR)
        .description("MFU, throughput, goodput, step times, phases and stragglers of one training job.")
        .with_variable(label_variable("job", "megaheal_step", "job", multi=False, label_text="Job"))
        .with_variable(label_variable("node", f"megaheal_step{{{JOB}}}", "node", multi=True, label_text="Node"))
        .with_variable(label_variable("rank", f'megaheal_step{{{JOB}, node=~"$node"}}', "rank", multi=True,
                                      label_text="Rank"))
        .annotation(incident_annotation("$job"))
    )
    _throughput_row(board)
    _step_time_row(board)
    _telemetry_row(board)
    return board


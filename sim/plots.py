"""The sweeps as PNG plots (matplotlib, drawn off-screen). matplotlib is the `sim` extra: without it the simulation
still writes its JSON and says why there are no plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.ledger import LOSSES

MODES = (("warm", "megaheal, warm restarts", "#1f77b4"), ("cold", "megaheal, cold restarts only", "#d62728"),
         ("replica", "megaheal, replica groups (train/ft/)", "#2ca02c"))


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("the plots need matplotlib: pip install 'megaheal[sim]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: dict[str, Any], out: Path) -> list[Path]:
    plt = _pyplot()
    sw, title = result["sweeps"], result["title"]
    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    def lines(ax: Any, rows: list[dict[str, Any]], scale: float = 1.0) -> None:
        xs = [r["value"] * scale for r in rows]
        for mode, label, colour in MODES:
            ax.plot(xs, [100 * r[mode]["ettr"] for r in rows], "o-", color=colour, label=label)
        ax.set_ylabel("ETTR (%)")
        ax.grid(alpha=0.3)

    fig, ax = plt.subplots(figsize=(7, 4.2))
    lines(ax, sw["checkpoint_interval_s"], 1 / 60)
    check = [c for c in result["analytic_check"] if c["point"].startswith("interval")]
    ax.plot([c["dt_s"] / 60 for c in check], [100 * c["kokolis"] for c in check], "k--", label="Kokolis et al., first order")
    ax.plot([c["dt_s"] / 60 for c in check], [100 * c["exact"] for c in check], "k:", label="exact renewal model")
    ax.plot([c["dt_s"] / 60 for c in check], [100 * c["simulated"] for c in check], "kx",
            label="simulated, policy off")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (minutes)")
    ax.set_title(f"{title}: ETTR against the checkpoint interval")
    ax.legend(fontsize=8)
    save(fig, "ettr_vs_checkpoint_interval.png")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    lines(ax, sw["failure_scale"])
    ax.set_xlabel("failure rate (x the record's)")
    ax.set_title(f"{title}: ETTR against the failure rate")
    ax.legend(fontsize=8)
    save(fig, "ettr_vs_failure_rate.png")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    lines(ax, sw["gpus"])
    ax.set_xscale("log")
    ax.set_xlabel("GPUs in the job")
    ax.set_title("ETTR against the job's size (failures per host as in the record)")
    ax.legend(fontsize=8)
    save(fig, "ettr_vs_job_size.png")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = sw["cold_start_s"]
    ax.plot([r["value"] / 60 for r in rows], [100 * r["cold"]["ettr"] for r in rows], "o-", color=MODES[1][2],
            label="cold restarts, startup as on the axis")
    ax.axhline(100 * sw["warm"]["ettr"], color=MODES[0][2], label="warm restarts where the policy allows")
    ax.set_xscale("log")
    ax.set_xlabel("cold start to first step (minutes)")
    ax.set_ylabel("ETTR (%)")
    ax.grid(alpha=0.3)
    ax.set_title(f"{title}: ETTR against the restart time")
    ax.legend(fontsize=8)
    save(fig, "ettr_vs_restart_time.png")

    fig, ax = plt.subplots(figsize=(7, 4.2))
    head = result["headline"]
    bottom = [0.0] * len(MODES)
    for loss in LOSSES:
        vals = [head[m]["gpu_hours"][loss] / 1e3 for m, _, _ in MODES]
        ax.bar([label for _, label, _ in MODES], vals, bottom=bottom, label=loss.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("GPU-hours lost (thousands)")
    ax.set_title(f"{title}: where the lost GPU time went")
    ax.legend(fontsize=8, ncol=2)
    save(fig, "lost_gpu_hours.png")
    return written

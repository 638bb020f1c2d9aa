"""`collective_bandwidth`: all_reduce, all_gather, reduce_scatter, all_to_all and send/recv timed
over a range of message sizes by a short torch.distributed job, reported as algbw and busbw
(nccl-tests' factors), and failed below 0.9 x the stored baseline. NCCL on CUDA, gloo on CPU.

With `pairwise`, node leaders also exchange data pair by pair to name the slow node or link.
Nodes: `--nodes` names the participants. Inside a Slurm allocation (launcher `auto`, or `srun`) the
ranks run on those hosts, `ranks_per_node` on each, through one `srun` step (collective_srun.py);
otherwise the job runs on this machine, each node being `ranks_per_node` local ranks (one per GPU
on a GPU machine).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from runbooks.baselines import BaselineStore, below_baseline
from runbooks.busbw import COLLECTIVES, bus_factor, check_size, fit_size
from runbooks.checks.pairwise import attribute
from runbooks.registry import Check, CheckContext
from wire.verdict import CheckResult, Measurement, Status

MAX_LOCAL_RANKS = 64
LAUNCHERS = ("auto", "local", "srun")
MAX_SIZE = 1 << 30


class CollectiveBandwidthCheck(Check):
    name = "collective_bandwidth"

    @dataclass(kw_only=True, slots=True)
    class Config:
        ranks: int = 4
        """Ranks in the job when no nodes are named (each its own node)."""
        ranks_per_node: int = 1
        """Ranks per node; the pairwise test uses each node's first rank."""
        device: str = "auto"
        """cpu (gloo), cuda (nccl, one GPU per rank) or auto (cuda when there is a GPU for every rank)."""
        collectives: list[str] = field(default_factory=lambda: list(COLLECTIVES))
        """Collectives to time, any of all_reduce, all_gather, reduce_scatter, all_to_all, sendrecv."""
        sizes: list[int] = field(default_factory=lambda: [1 << 16, 1 << 20, 1 << 22])
        """Message sizes in bytes (nccl-tests' S: the whole array of one operation)."""
        warmup: int = 2
        """Untimed iterations before each measurement."""
        iters: int = 5
        """Timed iterations per collective and size."""
        budget: timedelta = timedelta(seconds=3)
        """What the iterations of one measurement (a collective at a size) may take: where one operation is slow
        (a link throttled to a few MB/s moves an 8 MiB all-reduce in seconds), fewer timed iterations (one at
        least) and no more warm-up. NOTE: ten such iterations per size held network-triage over a minute, while a
        slow operation is measured well enough by one or two."""
        pairwise: bool = False
        """Also test every pair of nodes (send/recv both ways) to name a slow node or link."""
        pair_size: int = 1 << 20
        """Bytes each side sends per pairwise exchange."""
        pair_repeats: int = 3
        """Times the whole pair schedule runs; each pair keeps its best (interference is transient)."""
        baseline_fraction: float = 0.9
        """Fail a busbw below this fraction of its stored baseline (nccl-tests uses 0.9)."""
        pair_fraction: float = 0.5
        """Without a pair baseline, a pair below this fraction of the best pair is slow."""
        inject_send_delay: timedelta | None = None
        """Fault injection (chaos tests): `inject_rank` sleeps this long before every send."""
        inject_rank: int | None = None
        """The rank that is slowed by `inject_send_delay`."""
        inject_peer: int | None = None
        """Slow only sends to this rank (a slow link); None slows all of the rank's sends."""
        launcher: str = "auto"
        """Where ranks run: local (this machine, each node simulated), srun (on the named hosts), or auto
        (srun when nodes are named and this runs inside a Slurm allocation, local otherwise)."""

        def __post_init__(self) -> None:
            if not 2 <= self.ranks <= MAX_LOCAL_RANKS:
                raise ValueError(f"ranks must be in [2, {MAX_LOCAL_RANKS}], got {self.ranks}")
            if self.ranks_per_node < 1 or self.ranks % self.ranks_per_node:
                raise ValueError(
                    f"ranks_per_node must be >= 1 and divide ranks ({self.ranks}), got {self.ranks_per_node}"
                )
            if self.device not in ("auto", "cpu", "cuda"):
                raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
            unknown = sorted(set(self.collectives) - set(COLLECTIVES))
            if unknown or not self.collectives:
                raise ValueError(
                    f"collectives must be a non-empty subset of {', '.join(COLLECTIVES)}; unknown: {unknown}"
                )
            if not self.sizes or any(not 0 < s <= MAX_SIZE for s in self.sizes):
                raise ValueError(f"sizes must be a non-empty list of byte counts in (0, 1 GiB], got {self.sizes}")
            for s in self.sizes:
                check_size(s, self.ranks)
            check_size(self.pair_size, 1)
            if not 1 <= self.pair_repeats <= 20:
                raise ValueError(f"pair_repeats must be in [1, 20], got {self.pair_repeats}")
            if self.warmup < 0 or self.iters < 1:
                raise ValueError(f"warmup must be >= 0 and iters >= 1, got {self.warmup} and {self.iters}")
            if self.budget <= timedelta(0):
                raise ValueError(f"budget must be > 0, got {self.budget}")
            for name in ("baseline_fraction", "pair_fraction"):
                if not 0 < getattr(self, name) <= 1:
                    raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
            if self.inject_send_delay is not None:
                if not timedelta(0) < self.inject_send_delay <= timedelta(seconds=10):
                    raise ValueError(f"inject_send_delay must be in (0, 10s], got {self.inject_send_delay}")
                if self.inject_rank is None or not 0 <= self.inject_rank < MAX_LOCAL_RANKS:
                    raise ValueError("inject_rank must name the slowed rank when inject_send_delay is set")
            elif self.inject_rank is not None or self.inject_peer is not None:
                raise ValueError("inject_rank and inject_peer need inject_send_delay")
            if self.launcher not in LAUNCHERS:
                raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)}, got {self.launcher!r}")
            if self.launcher == "srun" and self.inject_send_delay is not None:
                raise ValueError("inject_send_delay is for local jobs; on real hosts slow a link instead")

    def participants(self, config: Config, ctx: CheckContext) -> tuple[list[str], int]:
        """Node names and world size: the named nodes, or `ranks` local nodes."""
        if ctx.nodes:
            return list(ctx.nodes), len(ctx.nodes) * config.ranks_per_node
        n_nodes = config.ranks // config.ranks_per_node
        return [f"local{i}" for i in range(n_nodes)], config.ranks

    def validate(self, config: Config, ctx: CheckContext) -> None:
        nodes, world = self.participants(config, ctx)
        if world < 2 or world > MAX_LOCAL_RANKS:
            raise ValueError(
                f"the job needs 2..{MAX_LOCAL_RANKS} ranks; {len(nodes)} node(s) x "
                f"{config.ranks_per_node} ranks per node = {world}"
            )
        for s in config.sizes:
            check_size(fit_size(s, world), world)
        if config.pairwise and len(nodes) < 2:
            raise ValueError(f"pairwise needs at least 2 nodes, got {nodes}")
        if config.inject_rank is not None and config.inject_rank >= world:
            raise ValueError(f"inject_rank {config.inject_rank} is not a rank of the {world}-rank job")
        if config.launcher == "srun" and not ctx.nodes:
            raise ValueError("launcher srun needs the hosts to run on: name them with --nodes")

    def launcher(self, config: Config, ctx: CheckContext) -> str:
        """local or srun, as `config.launcher` asks and this process's surroundings allow."""
        from ground.slurm import inside_allocation

        if config.launcher != "auto":
            return config.launcher
        return "srun" if ctx.nodes and config.inject_send_delay is None and inside_allocation() else "local"

    def run(self, config: Config, ctx: CheckContext) -> CheckResult:
        from runbooks.checks.collective_job import JobError, JobSpec, SendDelay, run_job

        self.validate(config, ctx)
        nodes, world = self.participants(config, ctx)
        config = _fitted(config, world)
        launcher = self.launcher(config, ctx)
        try:
            # On other hosts the ranks choose (the machine that starts srun may have no GPU).
            device = config.device if launcher == "srun" else _pick_device(config.device, world)
        except ValueError as exc:
            return CheckResult(status=Status.ERROR, summary=str(exc))
        fault = None
        if config.inject_send_delay is not None:
            fault = SendDelay(rank=config.inject_rank, delay=config.inject_send_delay, peer=config.inject_peer)
        # The ranks' own timeout is shorter than the step's, so a stuck rank is reported by the job
        # (naming the rank) before the runner has to stop the whole step.
        spec = JobSpec(
            world_size=world,
            ranks_per_node=config.ranks_per_node,
            device=device,
            collectives=list(config.collectives),
            sizes=list(config.sizes),
            warmup=config.warmup,
            iters=config.iters,
            budget_s=config.budget.total_seconds(),
            pairwise=config.pairwise,
            pair_size=config.pair_size,
            pair_repeats=config.pair_repeats,
            timeout=timedelta(seconds=max(5.0, 0.8 * ctx.timeout_s - 2.0)),
            fault=fault,
        )
        try:
            if launcher == "srun":
                ranks, nodes = self._run_srun(spec, nodes)
                device = ranks[0]["device"]
            else:
                ranks = run_job(spec)
        except JobError as exc:
            where = f"on {','.join(nodes)} through srun" if launcher == "srun" else f"on {world} local ranks"
            return CheckResult(status=Status.ERROR, summary=f"collective job {where} failed: {exc}")
        store = BaselineStore(None if ctx.calibrate else ctx.baselines_path)
        backend = "nccl" if device == "cuda" else "gloo"
        sweep, low = _sweep_measurements(config, ranks, world, backend, store)
        pairs = _pair_measurements(config, ranks, nodes, backend, store) if config.pairwise else None
        result = _verdict(config, sweep, low, pairs, nodes, world, backend)
        if launcher == "srun":
            result.details["hosts"] = {r["node"]: r["rank"] for r in ranks if r["rank"] % config.ranks_per_node == 0}
        return result

    @staticmethod
    def _run_srun(spec: Any, nodes: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
        """The ranks on the named hosts; the nodes in the order Slurm placed them (node i holds leader i)."""
        from runbooks.checks.collective_job import JobError
        from runbooks.checks.collective_srun import run_srun_job

        ranks = run_srun_job(spec, nodes, timedelta(seconds=spec.timeout.total_seconds() + 5.0))
        placed = [ranks[leader]["node"] for leader in range(0, spec.world_size, spec.ranks_per_node)]
        if sorted(placed) != sorted(nodes):
            raise JobError(f"srun placed the ranks on {placed}, not on the named hosts {nodes}")
        return ranks, placed


def _fitted(config: Any, world: int) -> Any:
    """`config` with its sizes fitted to `world` ranks (busbw.fit_size); measurements are labelled with these."""
    sizes = [fit_size(s, world) for s in config.sizes]
    return config if sizes == config.sizes else replace(config, sizes=sizes, ranks=world)


def _pick_device(device: str, world: int) -> str:
    """auto: NCCL when every rank can have its own GPU (NCCL refuses two ranks on one), else gloo."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < world:
        raise ValueError(f"device cuda needs one GPU per rank: {world} ranks, {gpus} GPU(s) visible")
    if device != "auto":
        return device
    return "cuda" if gpus >= world else "cpu"


def _sweep_measurements(
    config: Any, ranks: list[dict[str, Any]], world: int, backend: str, store: BaselineStore
) -> tuple[list[Measurement], list[Measurement]]:
    """busbw and algbw per collective and size; the collective ends when its slowest rank does."""
    out, low = [], []
    for collective in config.collectives:
        for size in config.sizes:
            seconds = max(r["sweep"][collective][str(size)] for r in ranks)
            algbw = size / seconds
            labels = {"collective": collective, "size": str(size), "ranks": str(world), "backend": backend}
            key = f"collective/{backend}/{world}/{collective}/{size}/busbw"
            busbw = Measurement(
                name="busbw",
                value=algbw * bus_factor(collective, world) / 1e9,
                unit="GB/s",
                labels=labels,
                baseline=store.get(key),
                key=key,
            )
            out += [
                busbw,
                Measurement(name="algbw", value=algbw / 1e9, unit="GB/s", labels=labels),
                Measurement(name="time", value=seconds, unit="s", labels=labels),
                Measurement(name="iterations", value=ranks[0]["iters"][collective][str(size)], unit="ops",
                            labels=labels),
            ]
            if below_baseline(busbw.value, busbw.baseline, config.baseline_fraction):
                low.append(busbw)
    return out, low


def _pair_measurements(
    config: Any, ranks: list[dict[str, Any]], nodes: list[str], backend: str, store: BaselineStore
) -> tuple[list[Measurement], Any]:
    """Per pair busbw (the slower of the two sides' timings), then attribution."""
    seconds: dict[tuple[int, int], float] = {}
    for r in ranks:
        for pair, value in r["pairs"].items():
            a, b = (int(x) for x in pair.split("-"))
            seconds[(a, b)] = max(seconds.get((a, b), 0.0), value)
    busbw = {p: config.pair_size / t for p, t in seconds.items()}
    key = f"pairwise/{backend}/{config.ranks_per_node}/{config.pair_size}/busbw"
    baseline = store.get(key)
    verdict = attribute(
        busbw,
        nodes,
        config.pair_fraction if baseline is None else config.baseline_fraction,
        None if baseline is None else baseline * 1e9,
    )
    out = [
        Measurement(
            name="pair_busbw",
            value=v / 1e9,
            unit="GB/s",
            labels={"pair": f"{nodes[a]}<->{nodes[b]}", "size": str(config.pair_size), "backend": backend},
            baseline=baseline,
        )
        for (a, b), v in sorted(busbw.items())
    ]
    if busbw:
        # Calibrated from the slowest pair of a healthy run: like nccl-tests' expected minimum, it is
        # what every pair must reach; a median would put half of a healthy fabric below it.
        out.append(
            Measurement(
                name="pair_busbw_min",
                value=min(busbw.values()) / 1e9,
                unit="GB/s",
                labels={"size": str(config.pair_size), "backend": backend},
                key=key,
            )
        )
    return out, verdict


def _verdict(
    config: Any,
    sweep: list[Measurement],
    low: list[Measurement],
    pairs: Any,
    nodes: list[str],
    world: int,
    backend: str,
) -> CheckResult:
    measurements = list(sweep)
    suspects = []
    problems = [
        f"{m.labels['collective']} {_size(int(m.labels['size']))} busbw {m.value:.3g} GB/s < "
        f"{config.baseline_fraction:g} x baseline {m.baseline:.3g}"
        for m in low
    ]
    if pairs is not None:
        pair_measurements, verdict = pairs
        measurements += pair_measurements
        suspects = verdict.suspects
        if suspects:
            problems.append("pairwise: " + "; ".join(f"{s.kind} {s.name}" for s in suspects))
    where = f"{world} ranks on {len(nodes)} node(s), {backend}"
    if problems:
        return CheckResult(
            status=Status.FAIL,
            summary=f"{where}: " + "; ".join(problems),
            suspects=tuple(suspects),
            measurements=tuple(measurements),
        )
    largest = max(config.sizes)
    best = {m.labels["collective"]: m.value for m in sweep if m.name == "busbw" and m.labels["size"] == str(largest)}
    text = ", ".join(f"{c} {v:.3g}" for c, v in best.items())
    baselines = sum(1 for m in sweep if m.name == "busbw" and m.baseline is not None)
    note = f"{baselines} compared with baselines" if baselines else "no baselines stored"
    return CheckResult(
        status=Status.PASS,
        summary=f"{where}: busbw at {_size(largest)} (GB/s): {text}; {note}",
        measurements=tuple(measurements),
    )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"

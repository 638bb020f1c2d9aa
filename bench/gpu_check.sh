#!/usr/bin/env bash
# Every GPU check of the project in one call, for a lent GPU machine.
#
# Run (on the GPU machine, from the repository root):  OUT=/some/dir bash bench/gpu_check.sh
# It uses the machine's own python3 and PyTorch (CUDA build), not the project's pins. Python packages that
# image lacks travel as wheels in .whl/ (ignored by git): where .whl/ holds any, they are installed first into
# /tmp/site (no index, no dependencies) and put on PYTHONPATH. The image (seen 2026-11-30: Python 3.12.3, torch
# 2.11.0+cu130, typer 0.27.2, click 8.5.0, no pydantic) should need none (its typer imports no pydantic; not yet
# run without wheels); the run in bench/results/gpu/ carried the project's typer 0.29.2, which imports pydantic:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl typer==0.29.2 click==8.5.1 pydantic==2.14.4 \
#       pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0
#
# Results land in $OUT (at most 8 files, so the device tool brings them all back):
#   gpu_check.log      everything printed, the summary table last
#   train_gpt1b.json   gpt-1b-1gpu through `torchrun -m train`: tokens/s, step time, MFU, phases, every step
#   smi_train.csv      nvidia-smi samples during that run (memory used, util, SM clock, power, temperature)
#   gpu_triage.json    `megaheal diagnose gpu-triage --json`: NVML health, matmul vs reference, TFLOP/s, memtest
#   nvml/<gpu>.json, nvml/<gpu>.prom   a recording of the real GPU through NVML, and its dcgm-named exposition
#   train_extras.json  bench/gpu_train.py: MFU with and without the telemetry client, device memory, a kernel
#                      profile by category, and one microbatch of 8 instead of two of 4
# Sections are independent: one failing does not stop the others; the exit code is the number that failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=${PY:-python3}
TMP=$(mktemp -d /tmp/gpu-check.XXXXXX)
CONFIG=${CONFIG:-configs/gpt-1b-1gpu.yaml}  # another config only for a dry run (a CPU config on a CPU machine)

section() { echo; echo "==== $1 ($(date -u +%H:%M:%S))"; }

main() {
  local failed=0 rc
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "image's own: $($PY -m pip list 2>/dev/null | grep -i -E '^(typer|click|pydantic|pydantic.core|typing.extensions) ' | tr -s ' ' | paste -sd,)"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing the carried wheels failed"; return 99; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

  # -------------------------------------------------------------- environment
  section "environment"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.sm,power.limit,temperature.gpu \
    --format=csv
  $PY - <<'PY'
import importlib.metadata as md, platform, torch
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "absent"
print(" ".join(f"{p} {version(p)}" for p in ("typer", "click", "pydantic", "rich", "nvidia-ml-py", "prometheus-client")))
print("python", platform.python_version(), "| torch", torch.__version__, "cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name(), "| SMs", torch.cuda.get_device_properties(0).multi_processor_count)
PY
  $PY -c "import train.trainer, megaheal.cli, runbooks.cli, exporters.nvml_recorder" || echo "IMPORT CHECK FAILED"

  # -------------------------------------------------------------- trainer: gpt-1b on one GPU, bf16
  # Target (issue: foundation and trainer): MFU >= 40% in bf16 on an H100/H200. The production path: torchrun.
  section "train gpt-1b-1gpu (torchrun -m train)"
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,clocks.sm,power.draw,temperature.gpu \
    --format=csv,noheader,nounits -lms 500 > "$OUT/smi_train.csv" 2>/dev/null &
  local smi=$!
  timeout 300 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m train \
    --config "$CONFIG" --run-dir "$TMP/gpt-1b" --set steps=30
  rc=$?
  kill "$smi" 2>/dev/null; wait "$smi" 2>/dev/null
  if [ "$rc" -eq 0 ]; then
    $PY - "$OUT" "$TMP/gpt-1b" "$CONFIG" <<'PY' || failed=$((failed + 1))
import json, statistics, sys
from pathlib import Path
out, run = Path(sys.argv[1]), Path(sys.argv[2])
recs = [json.loads(l) for l in (run / "ranks" / "0.jsonl").read_text().splitlines()]
steady = recs[5:]  # skip start-up and allocator warm-up
step = statistics.median(r["step_seconds"] for r in steady)
phases = {p: statistics.median(r["phases"][p] for r in steady) for p in steady[0]["phases"]}
def num(v):
    try:
        return float(v)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None
smi = [l.split(", ") for l in (out / "smi_train.csv").read_text().splitlines() if l.count(",") == 5]
busy = [s for s in smi if (num(s[2]) or 0) >= 50]
res = {
    "config": sys.argv[3],
    "command": f"torchrun --standalone --nproc-per-node 1 -m train --config {sys.argv[3]} --set steps=30",
    "steps_measured": len(steady),
    "tokens_per_step": steady[0]["tokens"],
    "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in steady),
    "step_seconds_median": step,
    "step_seconds_min_max": [min(r["step_seconds"] for r in steady), max(r["step_seconds"] for r in steady)],
    "mfu_median": statistics.median(r["mfu"] for r in steady),
    "target_mfu": 0.40,
    "peak_source": steady[0]["peak_source"],
    "peak_flops": steady[0]["peak_flops"],
    "phases_median_seconds": phases,
    "phases_share_of_step": {p: v / step for p, v in phases.items()},
    "max_rss_mib": recs[-1]["max_rss_mib"],
    "nvidia_smi": {
        "samples": len(smi), "samples_util_ge_50": len(busy),
        "memory_used_mib_max": max((num(s[1]) or 0 for s in smi), default=None),
        "sm_clock_mhz_median_busy": statistics.median(num(s[3]) for s in busy) if busy else None,
        "power_w_median_busy": statistics.median(num(s[4]) for s in busy if num(s[4]) is not None) if busy else None,
        "util_median_busy": statistics.median(num(s[2]) for s in busy) if busy else None,
        "temperature_c_max": max((num(s[5]) or 0 for s in smi), default=None),
    },
    "loss_first_last": [recs[0]["loss"], recs[-1]["loss"]],
    "steps": [{k: r[k] for k in ("step", "loss", "grad_norm", "step_seconds", "tokens_per_second", "mfu", "phases")}
              for r in recs],
}
(out / "train_gpt1b.json").write_text(json.dumps(res, indent=1) + "\n")
print(json.dumps({k: v for k, v in res.items() if k != "steps"}, indent=1))
PY
  else
    echo "gpt-1b training failed (exit $rc)"; failed=$((failed + 1))
  fi

  # -------------------------------------------------------------- runbooks: gpu-triage (and NCCL busbw with >= 2 GPUs)
  # NVML health, matmul vs reference, bf16 TFLOP/s against the table, memory test. Exit 0 pass, 1 degraded/fail
  # (a finding, recorded), 2 error (the check itself broke: counted as failed). No baselines: the spec sheet only.
  section "runbooks gpu-triage"
  local megaheal=(-c "from megaheal.cli import app; app()")
  timeout 240 $PY "${megaheal[@]}" diagnose gpu-triage --json --baselines "$TMP/baselines.json" > "$OUT/gpu_triage.json"
  rc=$?; echo "gpu-triage exit $rc"; [ "$rc" -ge 2 ] && failed=$((failed + 1))
  local ngpu
  ngpu=$(nvidia-smi -L | wc -l)
  if [ "$ngpu" -ge 2 ]; then
    section "runbooks collectives-quick on $ngpu GPUs (NCCL)"
    timeout 300 $PY "${megaheal[@]}" diagnose collectives-quick --json --baselines "$TMP/baselines.json" \
      --set collectives.device=cuda --set collectives.ranks="$ngpu" --set "collectives.sizes=[1048576, 67108864, 1073741824]" \
      > "$OUT/collectives_nccl.json" || failed=$((failed + 1))
  else
    echo "one GPU: NCCL busbw needs >= 2 (NCCL refuses two ranks on one device); skipped"
  fi

  # -------------------------------------------------------------- NVML collector on the real GPU
  # Records the device into a fixture (tests/fixtures/nvml format) and renders its exposition; promtool lints it
  # where promtool is installed (the GPU image has none: lint the .prom after fetching it).
  section "nvml recording"
  timeout 60 $PY -m exporters.nvml_recorder --out "$OUT/nvml" || { echo "nvml recording failed"; failed=$((failed + 1)); }

  # -------------------------------------------------------------- trainer extras: telemetry on/off, memory, profile
  section "train extras (bench/gpu_train.py)"
  timeout 300 $PY bench/gpu_train.py --config "$CONFIG" --out "$OUT/train_extras.json" \
    --warmup 5 --block 5 --blocks 4 --profile-steps 2 --variant parallel.microbatches=1 --variant-steps 8 \
    || { echo "train extras failed"; failed=$((failed + 1)); }

  section "summary"
  $PY - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
load = lambda name: json.loads((out / name).read_text()) if (out / name).exists() else None
pct = lambda v: f"{100 * v:.1f}%" if isinstance(v, (int, float)) else "-"
rows = []
t = load("train_gpt1b.json")
if t:
    lo, hi = (x * 1e3 for x in t["step_seconds_min_max"])
    smi = t["nvidia_smi"]
    rows += [
        ("gpt-1b torchrun: MFU (target 40%)",
         f"{pct(t['mfu_median'])} of {t['peak_flops'] / 1e12:.1f} TFLOP/s ({t['peak_source']})"),
        ("gpt-1b torchrun: tokens/s, step",
         f"{t['tokens_per_second_median']:,.0f} tok/s, {t['step_seconds_median'] * 1e3:.1f} ms (min {lo:.1f}, max {hi:.1f})"),
        ("gpt-1b torchrun: phases (ms)",
         ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t["phases_median_seconds"].items() if v >= 5e-4)),
        ("gpt-1b torchrun: nvidia-smi",
         f"max used {smi['memory_used_mib_max']} MiB, SM {smi['sm_clock_mhz_median_busy']} MHz, "
         f"{smi['power_w_median_busy']} W, util {smi['util_median_busy']}%"),
    ]
else:
    rows.append(("gpt-1b torchrun", "FAILED"))
e = load("train_extras.json")
if e and "main" in e:
    tel = e["main"].get("telemetry", {}).get("summary", {})
    if "off" in tel and "on" in tel:
        rows.append(("telemetry client off / on: MFU",
                     f"{pct(tel['off']['mfu_median'])} / {pct(tel['on']['mfu_median'])} (on/off "
                     f"{tel.get('mfu_on_over_off', 0):.4f}; sent {tel['client']['sent']}, dropped {tel['client']['dropped']})"))
    m = e["main"].get("memory")
    if m:
        rows.append(("device memory (torch)", f"max allocated {m['max_allocated_mib'] / 1024:.1f} GiB, reserved "
                     f"{m['max_reserved_mib'] / 1024:.1f} GiB of {m['device_total_mib'] / 1024:.1f}"))
    p = e["main"].get("profile", {})
    if "kernel_share_by_category" in p:
        shares = sorted(p["kernel_share_by_category"].items(), key=lambda kv: -kv[1])
        rows.append(("kernel time by category", ", ".join(f"{k} {pct(v)}" for k, v in shares)))
        rows.append(("GPU busy per step (profiled)", f"{p['gpu_busy_per_step_seconds'] * 1e3:.1f} ms, "
                     f"{p['kernel_launches'] // max(p['steps'], 1)} launches/step"))
    elif p:
        rows.append(("profile", str(p.get("error"))))
    v = e.get("variant")
    if v:
        rows.append((f"variant {' '.join(v['overrides'])}", v.get("error") or (
            f"MFU {pct(v['mfu_median'])}, {v['tokens_per_second_median']:,.0f} tok/s, {v['step_seconds_median'] * 1e3:.1f} ms")))
else:
    rows.append(("train extras", "FAILED"))
g = load("gpu_triage.json")
if g:
    ms = {m["name"]: m["value"] for s in g.get("steps", []) for m in s.get("measurements", [])}
    rows.append(("gpu-triage verdict", g["summary"][:200]))
    rows.append(("gpu-triage compute", f"{ms.get('matmul_tflops', float('nan')):.0f} TFLOP/s bf16, max rel err "
                 f"{ms.get('matmul_max_rel_error', float('nan')):.1e}, memtest {ms.get('memtest_mismatches')} bad words"))
else:
    rows.append(("gpu-triage", "FAILED"))
nvml = sorted((out / "nvml").iterdir()) if (out / "nvml").exists() else []
rows.append(("nvml recording", ", ".join(f.name for f in nvml) if any(f.suffix == ".json" for f in nvml) else "FAILED"))
width = max(len(k) for k, _ in rows)
print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
PY
  echo; echo "gpu_check: $failed section(s) failed"
  return "$failed"
}

main 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
rm -rf "$TMP"
exit "$status"

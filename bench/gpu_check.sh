#!/usr/bin/env bash
# Every GPU check of the project in one call, for a lent GPU machine (see README "GPU checks").
#
# Run (on the GPU machine, from the repository root):  OUT=/some/dir bash bench/gpu_check.sh
# It uses the machine's own python3 and PyTorch (CUDA build); results land in $OUT as JSON.
# Sections are independent: one failing does not stop the others; the exit code is the number that failed.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
failed=0

section() { echo; echo "==== $1 ($(date -u +%H:%M:%S))"; }

# ---------------------------------------------------------------- environment
section "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.csv"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

# ---------------------------------------------------------------- trainer: gpt-1b on one GPU, bf16
# Target (issue: foundation and trainer): MFU >= 40% in bf16 on an H100/H200.
section "train gpt-1b-1gpu"
rm -rf "$OUT/gpt-1b"
if timeout 420 $PY -m torch.distributed.run --standalone --nproc-per-node 1 -m train \
    --config configs/gpt-1b-1gpu.yaml --run-dir "$OUT/gpt-1b" --set steps=25 > "$OUT/gpt-1b.log" 2>&1; then
  $PY - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
recs = [json.loads(l) for l in (out / "gpt-1b" / "ranks" / "0.jsonl").read_text().splitlines()]
steady = recs[5:]  # skip start-up and allocator warm-up
res = {
    "config": "configs/gpt-1b-1gpu.yaml",
    "steps_measured": len(steady),
    "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in steady),
    "step_seconds_median": statistics.median(r["step_seconds"] for r in steady),
    "mfu_median": statistics.median(r["mfu"] for r in steady),
    "peak_source": steady[0]["peak_source"],
    "peak_flops": steady[0]["peak_flops"],
    "max_rss_mib": recs[-1]["max_rss_mib"],
    "loss_first_last": [recs[0]["loss"], recs[-1]["loss"]],
    "phases_median_seconds": {p: statistics.median(r["phases"][p] for r in steady) for p in steady[0]["phases"]},
    "target_mfu": 0.40,
}
(out / "train_gpt1b.json").write_text(json.dumps(res, indent=2) + "\n")
print(json.dumps(res, indent=2))
PY
else
  echo "gpt-1b training failed; tail of its log:"; tail -40 "$OUT/gpt-1b.log"; failed=$((failed + 1))
fi
rm -rf "$OUT/gpt-1b/ranks"  # the summary above keeps what matters; keep the transfer small

# ---------------------------------------------------------------- runbooks: gpu-triage (and NCCL busbw with >= 2 GPUs)
# Issue "Diagnostic runbooks": NVML health, matmul vs reference, bf16 TFLOP/s against the table, memory test.
# Exit 0 pass, 1 degraded/fail (a finding, recorded), 2 error (the check itself broke: counted as failed).
section "runbooks gpu-triage"
MEGAHEAL_PY=(-c "from megaheal.cli import app; app()")
timeout 300 $PY "${MEGAHEAL_PY[@]}" diagnose gpu-triage --json --baselines "$OUT/baselines.json" \
  > "$OUT/gpu_triage.json" 2> "$OUT/gpu_triage.log"
rc=$?; echo "gpu-triage exit $rc"; head -c 3000 "$OUT/gpu_triage.json"; [ "$rc" -ge 2 ] && { tail -20 "$OUT/gpu_triage.log"; failed=$((failed + 1)); }
ngpu=$(nvidia-smi -L | wc -l)
if [ "$ngpu" -ge 2 ]; then
  section "runbooks collectives-quick on $ngpu GPUs (NCCL)"
  timeout 300 $PY "${MEGAHEAL_PY[@]}" diagnose collectives-quick --json --baselines "$OUT/baselines.json" \
    --set collectives.device=cuda --set collectives.ranks="$ngpu" --set "collectives.sizes=[1048576, 67108864, 1073741824]" \
    > "$OUT/collectives_nccl.json" 2> "$OUT/collectives_nccl.log" || { tail -20 "$OUT/collectives_nccl.log"; failed=$((failed + 1)); }
else
  echo "one GPU: NCCL busbw needs >= 2 (NCCL refuses two ranks on one device); skipped"
fi

# ---------------------------------------------------------------- NVML collector on the real GPU
# Records the device into a fixture (tests/fixtures/nvml format), renders its exposition, runs promtool on it.
section "nvml recording"
if ! timeout 120 $PY -m exporters.nvml_recorder --out "$OUT/nvml"; then
  echo "nvml recording failed"; failed=$((failed + 1))
fi

echo; echo "gpu_check: $failed section(s) failed"
exit $failed

#!/usr/bin/env bash
# make test: the whole suite, part of it as two pytest runs at once, so that it fits its 30 minutes on 2 cores.
#
# Why: run one after another, the suite used ~0.77 of the 2 cores (22.5 CPU-minutes in 29 wall-minutes); most of
# its time goes to waiting on real training jobs, services and timeouts. So:
#   1. the light lane (the tiers that start no multi-rank training job: the healer against PostgreSQL, Prometheus
#      and Alertmanager, exporters, fuzz, agents, deploy, runbooks, sim, unit) runs beside the first heavy tiers
#      (checkpoints, containers, distributed), whose tests wait on commits, health checks and exit codes, never
#      on a detector's clock;
#   2. once both are done, the tiers timed against detectors (multihost, pages, selfheal) run alone, as before.
# Each pytest run has its own session fixtures (its own PostgreSQL cluster, tmp directories, ports from the
# kernel); the light lane touches nothing the root tiers set up (namespaces, iptables, podman, Slurm).
# The exit status is non-zero when any run failed; each run's report is printed whole.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIGHT=(tests/agent tests/deploy tests/exporters tests/fuzz tests/healer tests/runbooks tests/sim tests/unit)
BESIDE=(tests/checkpoint tests/containers tests/distributed)
PYTEST=("$PY" -m pytest -q -rs)

mkdir -p build
light_log=build/test-light-lane.log
# NOTE: no cache plugin in the light lane: the two runs would write .pytest_cache at once.
"${PYTEST[@]}" --durations=5 -p no:cacheprovider "${LIGHT[@]}" >"$light_log" 2>&1 &
light=$!
trap 'kill "$light" 2>/dev/null' EXIT

"${PYTEST[@]}" --durations=10 "${BESIDE[@]}"
beside_rc=$?
wait "$light"
light_rc=$?
trap - EXIT
echo
echo "==== the light lane, run beside the above: exit $light_rc ($light_log)"
cat "$light_log"
echo

skip=()
for dir in "${LIGHT[@]}" "${BESIDE[@]}"; do skip+=(--ignore "$dir"); done
"${PYTEST[@]}" --durations=15 "${skip[@]}" tests  # the slowest, to watch the 30-minute budget
alone_rc=$?

echo "==== exit status: beside $beside_rc, light lane $light_rc, alone $alone_rc"
[ "$beside_rc" -eq 0 ] && [ "$light_rc" -eq 0 ] && [ "$alone_rc" -eq 0 ]

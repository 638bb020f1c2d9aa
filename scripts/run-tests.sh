#!/usr/bin/env bash
# make test: the whole suite, part of it as two pytest runs at once, so that it fits its 30 minutes on 2 cores.
#
# Why: run one after another, the suite used ~0.77 of the 2 cores (22.5 CPU-minutes in 29 wall-minutes); most of
# its time goes to waiting on real training jobs, services and timeouts. So:
#   1. two lanes at once, of the tiers whose tests wait on exit codes, commits and health checks, never on a
#      detector's clock: the light tiers (no multi-rank training job: the healer against PostgreSQL, Prometheus
#      and Alertmanager, exporters, fuzz, agents, deploy, runbooks, sim, unit) and the checkpoint tier, beside
#      the containers and distributed tiers (~340 s and ~300 s of test time; the light tiers beside all three
#      made the first step 462 s, the light lane done after 270 s);
#   2. once both are done, the tiers timed against detectors (multihost, pages, selfheal) run alone, as before.
# Each pytest run has its own session fixtures (its own PostgreSQL cluster, tmp directories, ports from the
# kernel); the second lane touches nothing the root tiers set up (namespaces, iptables, podman, Slurm).
# The exit status is non-zero when any run failed; each run's report is printed whole.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
LIGHT=(tests/agent tests/checkpoint tests/deploy tests/exporters tests/fuzz tests/healer tests/runbooks tests/sim
       tests/unit)
BESIDE=(tests/containers tests/distributed)
PYTEST=("$PY" -m pytest -q -rs)

mkdir -p build
lane_log=build/test-second-lane.log
# NOTE: no cache plugin in the second lane: the two runs would write .pytest_cache at once.
"${PYTEST[@]}" --durations=5 -p no:cacheprovider "${LIGHT[@]}" >"$lane_log" 2>&1 &
light=$!
trap 'kill "$light" 2>/dev/null' EXIT

"${PYTEST[@]}" --durations=10 "${BESIDE[@]}"
beside_rc=$?
wait "$light"
light_rc=$?
trap - EXIT
echo
echo "==== the second lane (${LIGHT[*]}), run beside the above: exit $light_rc ($lane_log)"
cat "$lane_log"
echo

skip=()
for dir in "${LIGHT[@]}" "${BESIDE[@]}"; do skip+=(--ignore "$dir"); done
"${PYTEST[@]}" --durations=15 "${skip[@]}" tests  # the slowest, to watch the 30-minute budget
alone_rc=$?

echo "==== exit status: containers+distributed $beside_rc, second lane $light_rc, detector-timed tiers $alone_rc"
[ "$beside_rc" -eq 0 ] && [ "$light_rc" -eq 0 ] && [ "$alone_rc" -eq 0 ]

"""The node agent: one per host (`megaheal agent`). It owns the host's view (its rank processes, their states and
exit statuses, log tails, the ranks' telemetry, NVML) and reports it to the healer, and it carries out the
healer's orders on its host: start this attempt's ranks, stop them, signal one, run a runbook. It never decides
for the job."""

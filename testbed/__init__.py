"""A real multi-host cluster on one machine, for the tests, the benches and the demo.

Hosts are network namespaces on a bridge, each with its own hostname, /etc/hosts and /tmp; Slurm
(slurmctld on the machine, one slurmd per host) schedules across them. `testbed.bed.Bed` brings it
up and down, `testbed.faults` breaks it for real. Root only. See README ("A cluster on one machine").
"""

"""Observe: what the healer knows of its jobs now. The heartbeat table (every rank's latest record, in columns per
job), each node's batch times, the launcher's view of the processes, and the history of step samples the learning
detectors read; one snapshot of them a detection cycle (jobview.py)."""

"""How long each host of a job's current attempt has been silent: under a launcher every host's node agent posts a
batch every second or so whatever its ranks do, so a host whose batches stopped is dead or cut off. host_lost names
such a host; crash and hang hold back meanwhile, because what they would name (a peer's echo of the lost ranks, the
lowest step) is a consequence of it, not its cause."""

from __future__ import annotations

from healer.observe.jobview import Readings


def host_silence(table: Readings, job: str, now: float) -> dict[str, float]:
    """Seconds since each host of `job`'s current attempt was last heard from (a host not heard from since the attempt
    started counts from the start); empty when no launcher said where the attempt runs."""
    nodes, started_at = table.processes.placement(job)
    heard = {n.node: n.received_at for n in table.nodes()}
    return {n: now - max(heard.get(n, started_at), started_at) for n in nodes}


def silent_hosts(table: Readings, job: str, now: float, after: float) -> dict[str, float]:
    """The hosts of `job`'s attempt silent for more than `after` seconds, and for how long."""
    return {n: s for n, s in host_silence(table, job, now).items() if s > after}

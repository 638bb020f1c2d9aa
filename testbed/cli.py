"""`megaheal testbed`: bring a multi-host cluster up on this machine, look at it, break it, take it down.

Exit codes: 0 done (status: healthy), 1 status: not healthy or not up, 2 error (bad input, not root,
a missing program, a command that failed), with a message naming what.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Optional

import typer

from testbed.bed import Bed, Report
from testbed.cmd import BedError

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="A multi-host cluster on this machine: network namespaces, a bridge and Slurm (root only).")

Prefix = Annotated[str, typer.Option("--prefix", help="names everything of the bed: hosts PREFIX1.., links PREFIXv1..")]
AsJson = Annotated[bool, typer.Option("--json", help="print the result as JSON")]


def _fail(exc: Exception) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(2)


@app.command()
def up(
    hosts: Annotated[int, typer.Option("--hosts", help="number of hosts")] = 4,
    prefix: Prefix = "mh",
    subnet: Annotated[str, typer.Option("--subnet", help="private IPv4 subnet of the bridge and hosts")] = "10.213.0.0/24",
    cpus_per_host: Annotated[int, typer.Option("--cpus-per-host", help="CPUs each host offers to Slurm")] = 2,
    slurmctld_port: Annotated[int, typer.Option("--slurmctld-port", help="slurmctld's port on this machine")] = 6817,
    as_json: AsJson = False,
) -> None:
    """Bring the bed up (idempotent: makes what is missing, keeps what is there)."""
    try:
        bed = Bed(Bed.Config(hosts=hosts, prefix=prefix, subnet=subnet, cpus_per_host=cpus_per_host,
                             slurmctld_port=slurmctld_port))
        report = bed.up()
        status = bed.status()
    except (ValueError, BedError) as exc:
        if isinstance(exc, BedError) and not exc.permanent:
            typer.echo(f"(what was made stays; `megaheal testbed down --prefix {prefix}` removes it)", err=True)
        raise _fail(exc) from exc
    if as_json:
        typer.echo(json.dumps({"made": report.made, "kept": report.kept, **status}, indent=2))
        return
    _print_report("made", report)
    _print_status(status)


@app.command()
def down(prefix: Prefix = "mh", as_json: AsJson = False) -> None:
    """Remove everything the bed made: processes, namespaces, links, bridge, mounts, cgroups, state."""
    try:
        report = Bed(Bed.Config(prefix=prefix, hosts=1)).down()
    except (ValueError, BedError) as exc:
        raise _fail(exc) from exc
    if as_json:
        typer.echo(json.dumps({"removed": report.removed}, indent=2))
    elif report.removed:
        typer.echo(f"removed: {', '.join(report.removed)}")
    else:
        typer.echo(f"nothing of test bed {prefix!r} was left")


@app.command()
def status(prefix: Prefix = "mh", as_json: AsJson = False) -> None:
    """Show the bed's hosts, links, faults and Slurm states; exit 1 unless it is up and healthy."""
    try:
        st = Bed.existing(prefix).status()
    except BedError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(1) from exc
    if as_json:
        typer.echo(json.dumps(st, indent=2))
    else:
        _print_status(st)
    raise typer.Exit(0 if st["healthy"] else 1)


FAULTS = ("kill-host", "revive-host", "cut-link", "restore-link", "slow-link", "restore-speed", "drain", "resume",
          "clear")


@app.command()
def fault(
    kind: Annotated[str, typer.Argument(help=", ".join(FAULTS))],
    host: Annotated[Optional[str], typer.Argument(help="the host (every kind but clear)")] = None,
    rate: Annotated[Optional[str], typer.Option("--rate", help="slow-link: rate such as 100mbit, 1gbit, 500kbit")] = None,
    reason: Annotated[str, typer.Option("--reason", help="drain: the reason Slurm shows")] = "megaheal testbed",
    prefix: Prefix = "mh",
) -> None:
    """Inject a real fault on a host of the bed (or `clear` them all)."""
    from testbed import faults

    try:
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; one of {', '.join(FAULTS)}")
        bed = Bed.existing(prefix)
        if kind == "clear":
            faults.clear(bed)
        elif host is None:
            raise ValueError(f"{kind} needs a host: one of {', '.join(h.name for h in bed.hosts)}")
        elif kind == "slow-link":
            faults.slow_link(bed, host, parse_rate(rate))
        elif kind == "drain":
            faults.drain(bed, host, reason)
        else:
            action = {"kill-host": faults.kill_host, "revive-host": faults.revive_host, "cut-link": faults.cut_link,
                      "restore-link": faults.restore_link, "restore-speed": faults.restore_speed,
                      "resume": faults.resume}[kind]
            action(bed, host)
    except (ValueError, BedError) as exc:
        raise _fail(exc) from exc
    typer.echo(f"{kind} {host or ''}".strip() + ": done")


_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)?$", re.IGNORECASE)
_SCALE = {"bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000}


def parse_rate(text: str | None) -> int:
    """"100mbit" -> 100_000_000 bits per second (tc's units, decimal)."""
    m = _RATE.match((text or "").strip())
    if not m:
        raise ValueError(f"--rate must be a rate such as 100mbit, 1gbit or 500kbit, got {text!r}")
    return int(float(m.group(1)) * _SCALE[(m.group(2) or "bit").lower()])


def _print_report(_: str, report: Report) -> None:
    if report.made:
        typer.echo("made: " + "; ".join(report.made))
    if report.kept:
        typer.echo("already there: " + "; ".join(report.kept))


def _print_status(st: dict[str, Any]) -> None:
    word = "up and healthy" if st["healthy"] else ("up, NOT healthy" if st["up"] else "not up")
    typer.echo(f"test bed {st['prefix']}: {word}; slurmctld pid {st['slurmctld_pid']}, "
               f"bridge {st['bridge']['name']} {st['bridge']['address']}")
    for h in st["hosts"]:
        extra = f", rate {h['rate_limit']}" if h["rate_limit"] else ""
        typer.echo(f"  {h['name']:6s} {h['address']:15s} link {h['link']}{extra}, slurmd pid {h['slurmd_pid']}, "
                   f"slurm {h['slurm_state']}")
    for group, pids in st["frozen"].items():
        typer.echo(f"  frozen ({group}): {pids}")
    typer.echo(f"use it:  export SLURM_CONF={st['slurm_conf']}; srun -N {min(3, len(st['hosts']))} hostname")


__all__ = ["app", "parse_rate"]

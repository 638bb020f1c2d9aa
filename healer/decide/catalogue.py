"""The fault catalogue: every kind of fault the healer knows, in one table, and the GPU Xid codes it acts on (ground/gpu_faults.py).

For each kind: its severity, whether the job can go on without a restart, whether its suspect hosts run their
diagnostics before the decision (and the job is stopped first, because it cannot go on and a diagnosis wants the
host idle), whether it counts towards a host's lemon history, and the remedy the policy takes when a rule leaves
`remediate:` unset. Detectors, rules, the policy, the Prometheus alert rules (deploy/prometheus/rules/alerts.yml)
and the gpu_health runbook all read from here; a test checks that the alert rules and the runbook agree with it.

Each fault has one owner. In-job faults (the kinds below with a detector) belong to the healer's detectors.
Prometheus alerts routed to the healer are for what it cannot see itself: a host or its sidecar down, telemetry
gone blind; they notify.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Remedy(str, enum.Enum):
    """What the policy can do about an incident (rules name them in `remediate:`)."""

    RESTART = "restart"
    """Start the job again on the same hosts (hosts proven bad by a diagnosis or lemon history are left out)."""
    EXCLUDE_AND_RESTART = "exclude-node-and-restart"
    """Leave the suspect hosts out (a spare takes their place, or the job comes back smaller) and restart."""
    ROLLBACK = "rollback-and-skip"
    """Restart from the newest good checkpoint before the first bad step and skip the batches that caused it."""
    NOTIFY = "notify"
    """Tell on-call and wait for the condition to clear."""
    ESCALATE = "escalate"
    """Page a person at once."""

    @property
    def restarts(self) -> bool:
        return self in (Remedy.RESTART, Remedy.EXCLUDE_AND_RESTART, Remedy.ROLLBACK)


JOB_ACTIONS = frozenset(r for r in Remedy if r.restarts)
"""Remedies that act on the job: they need a launcher (`megaheal run`); the service alone can only notify."""


class BadStep(str, enum.Enum):
    """How the first bad step of a rollback is found in rank 0's records (every step, where the heartbeats only
    sample them): healer/launchers/rank_records.py reads each."""

    NONFINITE = "nonfinite"
    """The first record whose loss or grad norm is not finite."""
    SPIKE = "spike"
    """The first record whose loss is far above the ones before it, by the detector's own robust z-score."""


@dataclass(frozen=True, slots=True)
class FaultKind:
    name: str
    severity: str
    """info, warning or critical: the `severity` label on Alertmanager."""
    remedy: Remedy
    """The policy's choice when a rule leaves `remediate:` unset."""
    stops_job: bool = False
    """The job cannot go on (a rank is dead or hangs): its attempt is stopped as soon as the incident is acted on."""
    diagnose_first: bool = False
    """Suspect hosts run the rule's runbook before the decision (the attempt stopped first, see stops_job)."""
    swaps_slow: bool = False
    """Its finding measures what each step loses to one host: where that projects to cost more than a swap, the host
    is replaced with a spare instead of notified (healer/decide/fail_slow.py)."""
    lemon: bool = False
    """Counts towards a host's lemon history (only faults that point at the host itself, never ones the job may
    cause, like a straggler without a failed diagnosis)."""
    evicts_suspects: bool = False
    """The suspect hosts leave the job even without a failed diagnosis (the fault is the host's by definition)."""
    warm: str = ""
    """Why a restart for this kind may be warm (the surviving processes and what they hold are trusted: a job that
    runs warm then restarts without stopping them, healer/launchers/warm_control.py); empty: it restarts cold."""
    replaces_named: bool = False
    """A warm restart replaces the live processes of the ranks the incident names (a hang's: they hold the job up
    and cannot be trusted) with standbys; with no rank named it restarts cold."""
    looks_first: bool = False
    """Every rank is looked at from its host (kernel state, phase, Python stack, flight recorder) before anything
    is stopped: the incident's culprit is named from what the ranks were doing (healer/detect/hang_attribution.py)."""
    bad_step: BadStep | None = None
    """A rollback's first bad step, read from rank 0's every record; None: the kind rolls nothing back."""
    drains_suspects: bool = False
    """Its suspect hosts count as proven bad for the scheduler (drained), without a diagnosis they could not answer."""
    keeps_out: bool = False
    """A host it leaves out stays out until a person returns it: the screening that takes a repaired host back
    cannot see this fault (silent data corruption shows only under load, now and then)."""
    taints: bool = False
    """Its suspects may have spoiled the job's state before it showed, from the finding's first bad step on: the
    checkpoints saved since are tainted, and the restart resumes from the newest saved before it (plans.untainted)."""
    proof: str = ""
    """What proved a drained suspect bad, for the drain's reason; empty: its silence, which witnesses must confirm
    (healer/launchers/drain.py)."""
    names_host: bool = True
    """The fault is a host's (False: a bad batch, which names none)."""
    description: str = ""


CATALOGUE: dict[str, FaultKind] = {k.name: k for k in (
    FaultKind("crash", "critical", Remedy.RESTART, stops_job=True, diagnose_first=True, lemon=True,
              warm="a rank's process died and the others are intact: they keep their state, a standby takes its rank",
              description="a rank or agent ended with a failure (signal, OOM, NCCL/gloo error, exception)"),
    FaultKind("hang", "critical", Remedy.RESTART, stops_job=True, diagnose_first=True, lemon=True, looks_first=True,
              replaces_named=True,
              warm="the ranks holding the job up are named and the others only wait: their generation is aborted and "
                   "they keep their state, standbys take the named ranks' places",
              description="no step progress past the learned timeout"),
    FaultKind("gpu_fault", "critical", Remedy.EXCLUDE_AND_RESTART, lemon=True, evicts_suspects=True,
              warm="the faulty GPU's host leaves and the ranks elsewhere are intact: they keep their state",
              description="a critical Xid, an uncorrectable ECC error, a failed or pending row remap, or a recovery "
                          "action asked for by the driver"),
    FaultKind("nonfinite", "critical", Remedy.ROLLBACK, bad_step=BadStep.NONFINITE, names_host=False,
              warm="a bad batch, not a bad process: every rank rolls back to a state it holds in memory",
              description="NaN or Inf in the loss or the gradient norm"),
    FaultKind("loss_spike", "warning", Remedy.ROLLBACK, bad_step=BadStep.SPIKE, names_host=False,
              warm="a bad batch, not a bad process: every rank rolls back to a state it holds in memory",
              description="a loss far above its recent level"),
    FaultKind("sdc", "critical", Remedy.EXCLUDE_AND_RESTART, lemon=True, evicts_suspects=True, drains_suspects=True,
              proof="silent data corruption, convicted by re-runs", taints=True, keeps_out=True,
              warm="the convicted host leaves and the ranks elsewhere are intact: the re-runs kept every update it "
                   "was caught in out of their state",
              description="silent data corruption: a host convicted by re-running suspect steps (its ranks gave "
                          "other results for the same work)"),
    FaultKind("rerun", "info", Remedy.NOTIFY, names_host=False,
              description="a suspect step re-run and mended in the trainer: a batch judged bad data and skipped, or a "
                          "one-off fault whose re-run came out clean"),
    FaultKind("straggler", "warning", Remedy.NOTIFY, swaps_slow=True, description="one rank holds the job up"),
    FaultKind("collective_slowdown", "warning", Remedy.NOTIFY, swaps_slow=True,
              description="every rank slower in the collectives while compute stays flat"),
    FaultKind("job_slowdown", "warning", Remedy.NOTIFY,
              description="the whole job slower than its own baseline, no rank and not the network to blame"),
    FaultKind("heartbeat_stale", "critical", Remedy.NOTIFY, description="ranks on a host stopped reporting"),
    FaultKind("healer_blind", "critical", Remedy.NOTIFY,
              description="the healer hears from few of a job's hosts at once: it acts on no host's silence"),
    FaultKind("host_lost", "critical", Remedy.EXCLUDE_AND_RESTART, stops_job=True, lemon=True, evicts_suspects=True,
              drains_suspects=True,
              warm="the lost host's ranks are gone and the others are intact: they keep their state",
              description="a host of the job went silent and the job stopped with it (the host is down or cut off)"),
    # What the healer cannot see itself, told by Prometheus through Alertmanager (deploy/healer/rules/alerts.yaml).
    FaultKind("node_down", "critical", Remedy.NOTIFY, description="a host's sidecar cannot be scraped"),
    FaultKind("telemetry_absent", "critical", Remedy.NOTIFY, description="no sidecar is scraped at all"),
)}

DETECTED = frozenset(k for k in CATALOGUE if k not in ("node_down", "telemetry_absent"))
"""The kinds a detector of the healer finds (the others come from Prometheus alerts)."""
UNNAMED_KINDS = frozenset(k.name for k in CATALOGUE.values() if not k.names_host)
"""The kinds whose incidents name no host (a NaN, a loss spike): what a restart budget scaled by hosts holds to its
unscaled count (healer/decide/plans.py, `gate`)."""


def fault(kind: str) -> FaultKind:
    """The catalogue entry of `kind`; a kind the catalogue does not know (an alert's, a PromQL rule's) is a
    warning that notifies and changes nothing."""
    return CATALOGUE.get(kind) or FaultKind(kind, "warning", Remedy.NOTIFY)

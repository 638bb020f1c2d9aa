"""Diagnostic runbooks: declarative YAML steps calling registered checks, into one verdict.

    from runbooks import CheckContext, load_runbook, run_runbook
    result = run_runbook(load_runbook("collectives-quick"), CheckContext(nodes=("n1", "n2")))
    result.verdict, result.suspects, result.to_payload()

`megaheal diagnose` and the healer both call `run_runbook`. Nothing here imports torch; the
checks that need it import it inside their step's own process.
"""

from runbooks.registry import BUILTIN_CHECKS, Check, CheckContext, CheckRegistry, default_registry
from runbooks.runner import run_runbook
from runbooks.spec import Runbook, Step, load_runbook, shipped_runbooks
from wire.verdict import CheckResult, Measurement, RunbookResult, Status, StepResult, Suspect

__all__ = [
    "BUILTIN_CHECKS",
    "Check",
    "CheckContext",
    "CheckRegistry",
    "CheckResult",
    "Measurement",
    "Runbook",
    "RunbookResult",
    "Status",
    "Step",
    "StepResult",
    "Suspect",
    "default_registry",
    "load_runbook",
    "run_runbook",
    "shipped_runbooks",
]

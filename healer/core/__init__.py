"""The healer's core: rules, detectors, the one incident lifecycle and its store, the remediation policy, the
goodput ledger. Pure where it can be; it acts on jobs only through a `Remediator` (healer.core.remediator) that a
front door hands it."""

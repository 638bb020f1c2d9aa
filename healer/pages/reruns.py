"""A re-run verdict in sentences (the `sdc` and `rerun` incidents, healer/detect/sdc.py): what made the step suspect,
what each re-run showed, what the trainer concluded and did. Pure: over the verdicts as the incident's evidence
holds them (healer.detect.sdc.evidence_of)."""

from __future__ import annotations

from typing import Any

WHAT = {"nan": "a NaN", "inf": "an infinity", "spike": "a loss spike", "gradient": "non-finite gradients",
        "weights": "nothing the loss showed"}
CONCLUDED = {
    "transient": "a one-off fault: the clean run's result was used, and nothing was lost",
    "persistent": "the host is faulty",
    "data": "the batch is bad, not a host",
    "state": "the model itself had gone bad (every replica): a rollback mends it",
    "inconclusive": "no host and no batch could be told apart",
    "diverged": "its memory or its link corrupted that copy; no re-run was needed to name it",
}


def verdicts_of(evidence: dict[str, Any]) -> list[dict[str, Any]]:
    """The verdicts an incident's evidence holds: a conviction's list, or a notice's one."""
    held = evidence.get("verdicts")
    if isinstance(held, list):
        return [v for v in held if isinstance(v, dict) and "verdict" in v]
    return [evidence] if "verdict" in evidence and "step" in evidence else []


def _ranks(v: dict[str, Any], key: str = "ranks") -> str:
    ranks = [str(r) for r in v.get(key) or []]
    said = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(ranks)}" if ranks else "no rank"
    nodes = v.get("nodes") or []
    return said + (f" on {', '.join(nodes)}" if nodes and key == "ranks" else "")


def sentence(v: dict[str, Any]) -> str:
    """One verdict, e.g. 'Step 12 (attempt 0): a NaN in its first run (ranks 2, 3). Run again on the same ranks, it
    was anomalous again, and rank 2 on n2 gave other results for the same work: the host is faulty. Its update was
    skipped; the re-runs took 0.25 s.'"""
    head = f"Step {v.get('step')}" + (f" (attempt {v['attempt']})" if v.get("attempt") is not None else "")
    out = [f"{head}: {WHAT.get(str(v.get('what')), str(v.get('what')))} in its first run ({_ranks(v, 'flagged_ranks')})."]
    verdict = str(v.get("verdict"))
    if verdict == "diverged":
        out.append(f"The gathered copy of the weights of {_ranks(v)} was not what its data-parallel group's shards "
                   "sum to:")
    elif not v.get("reproduced"):
        out.append(f"Run again on the same ranks and batches, it came out clean; the first run differed first at "
                   f"{_ranks(v)}:")
    elif v.get("moved_same") is None:
        out.append("Run again on the same ranks and batches, it was anomalous again"
                   + (f", and {_ranks(v)} gave other results for the same work:" if v.get("ranks") else ":"))
    elif v.get("moved_same"):
        out.append("Run again, it was the same; moved to other ranks, the same batches gave the same results:")
    else:
        out.append(f"Run again, it was the same; moved to other ranks, the same batches gave other results, and "
                   f"{_ranks(v)} had the anomalous ones:")
    out.append(CONCLUDED.get(verdict, verdict) + ".")
    if verdict == "data" and v.get("samples"):
        out.append("Samples " + ", ".join(f"{a}-{b - 1}" for a, b in v["samples"]) + " were passed over.")
    if v.get("skipped") and verdict != "data":
        out.append("Its update was skipped.")
    if isinstance(v.get("rerun_s"), (int, float)):
        out.append(f"The re-runs took {v['rerun_s']:.2f} s.")
    return " ".join(out)


def rerun_sentences(evidence: dict[str, Any]) -> list[str]:
    return [sentence(v) for v in verdicts_of(evidence)]

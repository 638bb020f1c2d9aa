"""A healer that takes a job over adopts the attempt left running when a strict majority of its hosts run it, stops
it when fewer than a majority can, and asks the unreached hosts again while they could tip it
(healer/launchers/takeover_vote.py)."""

from __future__ import annotations

import pytest

from healer.launchers.takeover_vote import HostSays, vote

pytestmark = pytest.mark.unit
R, N, U = HostSays.RUNS, HostSays.NOT_RUNNING, HostSays.UNREACHED
HOSTS = ("n1", "n2", "n3", "n4")


@pytest.mark.parametrize("says, final, adopt", [
    ((R, R, R, R), False, True),
    ((R, R, R, U), False, True),  # one host missed its state check: the job is adopted, not stopped
    ((R, R, R, N), True, True),  # the host that does not run it is left to the detectors
    ((R, R, U, U), False, None),  # two of four is no majority, but the unreached could make it one: ask again
    ((R, R, U, U), True, False),  # ... until the asking is over
    ((R, R, N, U), False, None),
    ((R, R, N, N), False, False),  # half is not a majority
    ((R, U, N, N), False, False),  # no more can run it: stopped at once
    ((U, U, U, U), False, None),
    ((U, U, U, U), True, False),
])
def test_it_adopts_on_a_strict_majority_only(says: tuple[HostSays, ...], final: bool, adopt: bool | None) -> None:
    ballot = vote(7, HOSTS, dict(zip(HOSTS, says, strict=True)), final)
    assert ballot.adopt is adopt
    assert ballot.to_payload()["adopt"] is adopt and "attempt 7" in ballot.decision_basis


def test_its_basis_names_the_hosts_that_do_not_run_it() -> None:
    ballot = vote(3, HOSTS, {"n1": R, "n2": R, "n3": R}, final=False)  # n4 never answered
    assert ballot.adopt and ballot.unreached == ("n4",) and ballot.running == ("n1", "n2", "n3")
    assert ballot.decision_basis == "3 of 4 host(s) run attempt 3 (a majority is 3): adopted; not running there: n4"
    assert vote(3, ("n1",), {"n1": R}, final=False).adopt
    assert vote(3, ("n1", "n2"), {"n1": R}, final=True).adopt is False

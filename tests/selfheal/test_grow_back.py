"""Growing back (healer/launchers/placement.py): which hosts a passing screening takes back, and how far a job that
came back smaller grows again with its spares; which hosts an incident keeps out for good (healer.decide.plans.
kept_out)."""

from __future__ import annotations

import pytest

from ground import slurm
from healer.decide.catalogue import Remedy
from healer.decide.plans import Plan, kept_out
from healer.launchers.placement import Placement

pytestmark = pytest.mark.unit


def test_a_repaired_host_comes_back_as_a_spare_unless_it_is_kept_out() -> None:
    p = Placement(nodes=("n1",), dp=1, excluded=frozenset({"n2", "n3"}))
    p = p.leaving_out(("n1",), (), kept_out=("n3",))
    assert p.returnable() == ("n2",)
    back = p.taking_back({"n2", "n3"})
    assert back.spares == ("n2",) and back.excluded == {"n3"} and back.kept_out == {"n3"}


def test_a_smaller_job_grows_back_to_the_largest_layout_its_spares_and_degrees_allow() -> None:
    shrunk = Placement(nodes=("n1",), spares=("n3",), dp=1)
    assert shrunk.grown(full=2, full_dp=2, valid_dp=()) == (("n1", "n3"), 2)
    assert Placement(nodes=("n1", "n2"), dp=2, spares=("n3",)).grown(2, 2, ()) is None  # whole already
    assert Placement(nodes=("n1",), dp=1).grown(2, 2, ()) is None  # no spare
    # 4 hosts at dp 4 shrunk to 2: one spare grows it to 3 hosts, dp 3, where the layout accepts 3.
    four = Placement(nodes=("a", "b"), dp=2, spares=("c",))
    assert four.grown(4, 4, ()) == (("a", "b", "c"), 3)
    assert four.grown(4, 4, (1, 2, 4)) is None
    assert Placement(nodes=("a", "b"), dp=2, spares=("c", "d", "e")).grown(4, 4, (1, 2, 4)) == (("a", "b", "c", "d"), 4)


def test_lemons_and_hosts_convicted_of_sdc_are_kept_out_and_others_are_not() -> None:
    plan = Plan(Remedy.EXCLUDE_AND_RESTART, {"lemons": {"n2": 3}}, exclude=("n2", "n4"))
    assert kept_out("crash", plan) == ("n2",)
    assert kept_out("sdc", plan) == ("n2", "n4")
    assert kept_out("host_lost", Plan(Remedy.EXCLUDE_AND_RESTART, {}, exclude=("n4",))) == ()


def test_a_host_is_given_back_to_slurm_by_its_name_as_an_argument() -> None:
    assert slurm.resume_argv("h2") == ["scontrol", "update", "NodeName=h2", "State=RESUME"]
    with pytest.raises(ValueError):
        slurm.resume_argv("h2 State=DOWN")

"""Where a job runs (healer/launchers/placement.py): a restart that leaves hosts out, takes spares and releases
healthy hosts; rollbacks' skipped steps accumulating; a take-over going on with what the healer before had."""

from __future__ import annotations

import pytest

from healer.launchers.placement import Placement

pytestmark = pytest.mark.unit


def test_a_restart_takes_a_spare_leaves_the_bad_host_out_and_releases_the_healthy_one() -> None:
    p = Placement(nodes=("n1", "n2", "n3"), spares=("n4", "n5"), dp=3)
    ordered = p.leaving_out(("n1", "n4"), released=("n3",))
    assert ordered.excluded == {"n2"} and ordered.nodes == p.nodes, "out from the order on, still running until stopped"
    moved, left_out = ordered.moved_to(("n1", "n4"), 2, released=("n3",))
    assert left_out == {"n2"} and moved.nodes == ("n1", "n4") and moved.dp == 2
    assert moved.spares == ("n5", "n3") and moved.excluded == {"n2"}


def test_skipped_steps_accumulate_and_make_one_override() -> None:
    p = Placement(nodes=("n1",)).skipping((11, 12)).skipping(frozenset({4}))
    assert p.skip_steps == {4, 11, 12} and p.skip_override() == ("skip_steps=[4,11,12]",)
    assert p.skip_override((2,)) == ("skip_steps=[2,4,11,12]",) and Placement(nodes=("n1",)).skip_override() == ()


def test_a_take_over_goes_on_with_the_last_hosts_and_keeps_what_was_left_out() -> None:
    p = Placement(nodes=("n1", "n2"), spares=("n3", "n4"), dp=2)
    taken = p.taken_over(("n1", "n3"), None, spares=("n3", "n4", "n5"), excluded={"n2", "n5"}, skip_steps={7})
    assert taken.nodes == ("n1", "n3") and taken.dp == 2 and taken.spares == ("n4",)
    assert taken.excluded == {"n2", "n5"} and taken.skip_steps == {7}
    assert p.taken_over(None, None, spares=("n3",), excluded=set(), skip_steps=set()).nodes == ("n1", "n2")


def test_a_take_over_in_a_successors_allocation_has_its_new_hosts_as_spares() -> None:
    # The healer's host n1 was lost; the successor job got n2, n3 and n4: n4 waits to take n1's place.
    configured = Placement(nodes=("n2", "n3", "n4"), dp=3)
    taken = configured.taken_over(("n1", "n2", "n3"), 3, spares=("n2", "n3", "n4"), excluded=set(), skip_steps=set())
    assert taken.nodes == ("n1", "n2", "n3") and taken.spares == ("n4",) and taken.dp == 3


def test_a_host_both_running_and_spare_or_a_bad_name_is_refused() -> None:
    with pytest.raises(ValueError, match="none of them a spare"):
        Placement(nodes=("n1", "n2"), spares=("n2",))
    with pytest.raises(ValueError):
        Placement(nodes=("n1;reboot",))

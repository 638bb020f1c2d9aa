"""An attempt's lifecycle (healer/launchers/attempt.py): running, stopping, ended, superseded, each change through
the one table; what an attempt says of itself (done, stopping, succeeded) follows from where it is."""

from __future__ import annotations

import pytest

from healer.launchers.attempt import AgentAttempt, AttemptState, IllegalAttemptTransition

pytestmark = pytest.mark.unit


def attempt() -> AgentAttempt:
    return AgentAttempt(number=4, nodes=("n1", "n2"), started_at=0.0, dp=2, resume="auto")


def test_it_ends_when_every_hosts_part_ended_and_succeeds_only_with_every_exit_zero() -> None:
    a = attempt()
    assert not a.host_ended("n1", 0) and a.state is AttemptState.RUNNING and not a.done
    assert not a.host_ended("n1", 0), "a host's end is counted once"
    assert not a.host_ended("n9", 0), "a host that is not the attempt's changes nothing"
    assert a.host_ended("n2", 0) and a.state is AttemptState.ENDED and a.done and a.succeeded and not a.stopping
    failed = attempt()
    failed.host_ended("n1", 1)
    assert failed.host_ended("n2", 0) and failed.done and not failed.succeeded


def test_a_stopped_attempt_ends_stopped_and_never_counts_as_succeeded() -> None:
    a = attempt()
    a.stop()
    assert a.state is AttemptState.STOPPING and a.stopping and not a.done
    a.host_ended("n1", 0)
    assert a.hosts_lost({"n2"}), "a host that could not be reached ends its part"
    assert a.state is AttemptState.ENDED and a.stopping and a.lost == {"n2"} and not a.succeeded
    a.stop()  # nothing changes for an attempt that is over
    assert a.state is AttemptState.ENDED


def test_a_superseded_attempt_is_done_and_neither_ends_nor_runs_again() -> None:
    a = attempt()
    a.supersede()
    assert a.superseded and a.done and a.ended == {"n1", "n2"} and not a.succeeded and not a.stopping
    assert not a.host_ended("n1", 0) and a.state is AttemptState.SUPERSEDED
    with pytest.raises(IllegalAttemptTransition, match="attempt 4 cannot go from superseded to ended"):
        a.advance(AttemptState.ENDED)
    ended = attempt()
    ended.hosts_lost({"n1", "n2"})
    for to in AttemptState:
        with pytest.raises(IllegalAttemptTransition):
            ended.advance(to)

"""The live state a replica group hands a joining one (train/ft/transport.py): only between holders of the run's key,
sealed, and parsed without unpickling objects."""

from __future__ import annotations

import io
import pickle
import time
import urllib.error
import urllib.request
from datetime import timedelta

import pytest
import torch

from train.ft.transport import (
    SignedTransport,
    TransportError,
    open_state,
    request_allowed,
    request_auth,
    seal_state,
)

pytestmark = pytest.mark.unit
KEY = b"k" * 32
OTHER = b"o" * 32
T = timedelta(seconds=5)


@pytest.fixture
def pair():
    a, b = SignedTransport(KEY, "127.0.0.1", T), SignedTransport(KEY, "127.0.0.1", T)
    yield a, b
    a.shutdown()
    b.shutdown()


def test_a_peer_with_the_key_takes_the_state_it_was_sent_and_nothing_once_it_is_withdrawn(pair) -> None:
    a, b = pair
    state = {"user": {"default": {"model": {"w": torch.arange(6.0).view(2, 3)}}}, "torchft": {"step": 7}}
    a.send_checkpoint([1], 7, state, T)
    got = b.recv_checkpoint(0, a.metadata(), 7, T)
    assert torch.equal(got["user"]["default"]["model"]["w"], state["user"]["default"]["model"]["w"])
    assert got["torchft"] == {"step": 7}
    with pytest.raises(TransportError, match="HTTP 404"):
        b.recv_checkpoint(0, a.metadata(), 8, timedelta(seconds=0.3))  # another step: not staged
    a.disallow_checkpoint()
    with pytest.raises(TransportError, match="HTTP 404"):
        b.recv_checkpoint(0, a.metadata(), 7, timedelta(seconds=0.3))


def test_a_request_without_the_key_gets_nothing_of_the_state(pair) -> None:
    a, _ = pair
    a.send_checkpoint([1], 3, {"w": torch.ones(2)}, T)
    for auth in (None, request_auth(OTHER, 3, time.time()), request_auth(KEY, 4, time.time()),
                 request_auth(KEY, 3, time.time() - 600), "garbage"):
        headers = {"X-Megaheal-Auth": auth} if auth else {}
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{a.metadata()}/state/3", headers=headers), timeout=5)
        assert err.value.code == 403, auth
    # A peer that holds another key is refused the same way, and says so.
    stranger = SignedTransport(OTHER, "127.0.0.1", T)
    try:
        with pytest.raises(TransportError, match="HTTP 403"):
            stranger.recv_checkpoint(0, a.metadata(), 3, T)
    finally:
        stranger.shutdown()


def test_state_that_is_not_sealed_with_the_key_is_refused_unread_and_a_pickled_object_never_loads() -> None:
    body = io.BytesIO()
    torch.save({"w": torch.zeros(1)}, body)
    assert torch.equal(open_state(KEY, 5, body.getvalue(), seal_state(KEY, 5, body.getvalue()))["w"], torch.zeros(1))
    for seal in (None, "", "\u00e9", seal_state(OTHER, 5, body.getvalue()), seal_state(KEY, 6, body.getvalue())):
        with pytest.raises(TransportError, match="not sealed with this run's key"):
            open_state(KEY, 5, body.getvalue(), seal)

    class Boom:
        def __reduce__(self):  # what a forged state would carry: code that runs on unpickling
            return (exec, ("raise SystemExit('ran')",))

    evil = io.BytesIO()
    torch.save({"w": Boom()}, evil, pickle_module=pickle)
    with pytest.raises(pickle.UnpicklingError):  # even sealed (a key holder gone bad): weights_only refuses it
        open_state(KEY, 5, evil.getvalue(), seal_state(KEY, 5, evil.getvalue()))


def test_the_request_header_is_good_for_its_step_and_a_minute() -> None:
    now = 1_000_000.0
    header = request_auth(KEY, 9, now)
    assert request_allowed(KEY, 9, header, now + 59)
    assert not request_allowed(KEY, 9, header, now + 61)
    assert not request_allowed(KEY, 10, header, now)
    assert not request_allowed(OTHER, 9, header, now)
    assert not request_allowed(KEY, 9, None, now) and not request_allowed(KEY, 9, "x:y", now)
    assert not request_allowed(KEY, 9, f"{now}:\u00e9t\u00e9", now)  # not ASCII: refused, not an error


def test_a_short_key_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        SignedTransport(b"short", "127.0.0.1", T)

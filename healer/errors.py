"""The healer's errors: a small hierarchy, so callers catch what they can handle and nothing else."""

from __future__ import annotations

from ground.httpclient import RequestFailed


class HealerError(Exception):
    """Base of every error the healer raises on purpose."""


class BadRequest(HealerError):
    """A request body or parameter is wrong; `field` names the offending part (answered with HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class WrongSender(HealerError):
    """A heartbeat batch for one host that came with another's certificate (answered with HTTP 403)."""


class IllegalTransition(HealerError):
    """An incident was asked to move between two states that the transition table does not connect."""


class NotFound(HealerError):
    """No such incident."""


class DatabaseError(HealerError):
    """The database cannot be used: unreachable, or its schema is not the one this code expects."""


class DatabaseNotAtHead(DatabaseError):
    """The schema revision differs from the newest migration; the message says what to run."""


class SinkError(HealerError, RequestFailed):
    """A notification could not be delivered. Permanent failures (a 4xx) are not retried; transient ones are.
    A failed request (ground.httpclient) is caught as its base, RequestFailed, with every other failure to deliver."""

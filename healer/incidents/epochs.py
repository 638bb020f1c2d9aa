"""Healer epochs: every healer that starts driving a job (`megaheal run`, a take-over's included) claims the next
epoch of the job before its first order, and every order carries it (wire/orders.py). An agent refuses an order of
an epoch below the highest it has taken, so of two healers that both believe they drive the job (one thought dead,
or cut off, that comes back), only the newer can act; the older learns it from the first refusal and stops.

The claim is a conditional UPDATE (`... SET epoch = :next WHERE job = :job AND epoch = :seen`, rowcount 1), or an
INSERT for a job with none yet; a claim that lost a race to another healer is tried again, a few times, then is an
error naming the job. NOTE: the next epoch is one above the highest of every job in the database, not only this
job's: an agent's floor is kept in its work directory, which outlives a job's name (a run directory run again under
another job name), and must never be above a new healer's epoch there.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from sqlalchemy import func, insert, select, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from healer.errors import HealerError
from healer.incidents.models import HealerEpoch
from healer.incidents.store import utcnow

TRIES = 5


class EpochRace(HealerError):
    """Other healers kept claiming the job's epoch first: two healers are starting on one job at once."""


def claim(engine: Engine, job: str, holder: str, tries: int = TRIES,
          clock: Callable[[], datetime] = utcnow) -> int:
    """Claim the next epoch for `job` on behalf of `holder` (who, for people); the epoch. EpochRace after `tries`
    claims lost to other healers."""
    for _ in range(tries):
        try:
            with engine.begin() as conn:
                seen = conn.execute(select(HealerEpoch.epoch).where(HealerEpoch.job == job)).scalar()
                top = conn.execute(select(func.max(HealerEpoch.epoch))).scalar() or 0
                epoch = max(top, seen or 0) + 1
                values = {"epoch": epoch, "claimed_at": clock(), "claimed_by": holder[:200]}
                if seen is None:
                    conn.execute(insert(HealerEpoch).values(job=job, **values))
                    return epoch
                done = conn.execute(update(HealerEpoch).where(HealerEpoch.job == job, HealerEpoch.epoch == seen)
                                    .values(**values)).rowcount
                if done == 1:
                    return epoch
        except IntegrityError:
            continue  # another healer inserted the job's first epoch a moment ago
    raise EpochRace(f"job {job}: {tries} claims of its healer epoch were all lost to other healers claiming it at "
                    "the same time; only one healer may drive a job")


def current(engine: Engine, job: str) -> int | None:
    """The job's epoch now (the newest healer's); None when no healer has claimed one."""
    with engine.connect() as conn:
        return conn.execute(select(HealerEpoch.epoch).where(HealerEpoch.job == job)).scalar()

"""The fuzz tier: property-based tests (Hypothesis) of every parser that takes outside input. Each asserts that an
input gives a clear error or success, never an unhandled exception, and that nothing is stored from a rejected
input. The example count is bounded so the tier fits `make test` (MEGAHEAL_FUZZ_EXAMPLES raises it for a longer
hunt); no deadline, because the tests share two cores with everything else."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "megaheal", max_examples=int(os.environ.get("MEGAHEAL_FUZZ_EXAMPLES", "150")), deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("megaheal")

"""The engine property tests' hypothesis settings: `fuzz_settings(n)` runs n examples, or
FUZZ_EXAMPLES of them when the environment sets it (more to hunt bugs, fewer for a quick run),
with no deadline (a runtime step takes what it takes) and no complaint about slow data."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def fuzz_settings(examples: int):
    return settings(
        max_examples=int(os.environ.get("FUZZ_EXAMPLES", examples)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )

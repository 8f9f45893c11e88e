"""A large cohort through the real protocol (small vectors): the Harary graph, batched Shamir
reconstruction and the dropout path at scale. `make test` runs 500 devices; `make test-full` (which
CI also runs) the full 10,000, about eleven minutes of one core."""

from __future__ import annotations

import numpy as np
import pytest

from tally.codec import Field, Kind, PayloadSchema
from tally.secagg import Dropout, ThreatModel, secure_sum


@pytest.mark.parametrize("n", [500, pytest.param(10_000, marks=pytest.mark.full)])
def test_a_large_cohort_with_dropouts_sums_exactly(n: int) -> None:
    rng = np.random.default_rng(10)
    schema = PayloadSchema((Field("count", (2,), kind=Kind.COUNT, clip=1000),))
    values = {i: {"s": {"count": rng.integers(0, 1001, size=2)}} for i in range(1, n + 1)}
    victims = rng.choice(np.arange(1, n + 1), size=n // 20, replace=False)
    # The default run checks consistency: devices also drop when asked to sign their view.
    phases = ("share_keys", "masked_input", "consistency_check", "unmask")
    dropouts = {int(v): Dropout(phases[j % 4]) for j, v in enumerate(victims)}
    decoded, run = secure_sum(
        {"s": schema}, values, threat=ThreatModel(dropout_rate=0.1, corrupt_rate=0.05), dropouts=dropouts, rng=rng
    )
    assert run.aborted is None
    assert run.config.params.k < 200 and run.config.consistency_check
    contributors = run.results["s"].contributors
    expected = sum(values[i]["s"]["count"] for i in contributors)
    assert np.array_equal(decoded["s"]["count"], expected)
    dropped_before_masking = {int(v) for j, v in enumerate(victims) if j % 4 < 2}
    assert set(contributors) == set(range(1, n + 1)) - dropped_before_masking

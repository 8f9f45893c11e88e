"""Synthetic devices: contributions without data, training or torch, for load tests at scale.

A synthetic device's input to a sum is a deterministic function of (fleet seed, job, round,
step, device id), so any process can recompute it, and it lies exactly on the codec's
fixed-point grid, so encoding it is exact: the ring vector a device sends does not depend on its
rounding randomness, and the sum a round must commit is known in advance to the last bit. Values
stay well inside each field's clip, scalars are positive (every algorithm's scalars are weights
and counts it divides by), vectors are centred on zero so a model driven by them drifts little.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

from tally.algorithms.base import Arrays
from tally.algorithms.packages import TRAINER_CAPABILITIES
from tally.codec import Kind, PayloadSchema

# Counts are drawn from 1..COUNT_CEILING (or the field's own maximum when lower).
COUNT_CEILING = 1000


class SyntheticUpdates:
    """Stands in for a device's data and training (``Device(trainer=SyntheticUpdates(...))``)."""

    # Its inputs are drawn for any payload schema, so it answers any algorithm's needs.
    capabilities = TRAINER_CAPABILITIES

    def __init__(self, device_id: str, seed: int = 0) -> None:
        self.device_id, self.seed = device_id, seed
        self.num_examples = 1 + self._rng("examples").integers(COUNT_CEILING)

    def values(self, job_id: str, round_: int, step: str, schema: PayloadSchema) -> Arrays:
        rng = self._rng(f"{job_id}/{round_}/{step}")
        out: dict[str, np.ndarray] = {}
        for f in schema.fields:
            size = int(np.prod(f.shape, dtype=np.int64))
            if f.kind is Kind.COUNT:
                drawn = rng.integers(1, min(int(f.clip), COUNT_CEILING), size, endpoint=True)
            else:
                # Grid points up to a quarter of the clip: (integer) * 2^-frac_bits is exact.
                top = max(int(f.clip * 2 ** f.frac_bits) // 4, 1)
                ints = rng.integers(1, top, size, endpoint=True) if not f.shape else rng.integers(-top, top, size,
                                                                                                  endpoint=True)
                drawn = np.ldexp(ints.astype(np.float64), -f.frac_bits)
            out[f.name] = drawn.reshape(f.shape)
        return out

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        raise TypeError("a synthetic device has no data to train on: its inputs come from SyntheticUpdates.values")

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        raise TypeError("a synthetic device has no data to evaluate on")

    def _rng(self, what: str) -> np.random.Generator:
        digest = hashlib.sha256(f"tally-synthetic/{self.seed}/{self.device_id}/{what}".encode()).digest()
        return np.random.default_rng(int.from_bytes(digest[:16], "little"))

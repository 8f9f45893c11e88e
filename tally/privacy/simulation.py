"""A private job in the in-process simulator: the devices' ring encodings added mod 2^b.

It is the simulator's counterpart of the secure sum for DP jobs: each device's payload is
encoded exactly as the SDK encodes it (``payload.ring_encode``: a distributed-DP payload goes in
as integers mod 2^b, modular clipping included), a ``dropout`` fraction of the cohort is dropped
after encoding, the survivors' encodings are added in the ring, and the total is decoded with
the coordinator's range check. There is no masking: it measures what DP does to a model, not
the secure sum, which the full-stack tests run with DP on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from tally.algorithms.base import Arrays, StepSpec
from tally.codec.packing import wire_width
from tally.codec.schema import ring_dtype, ring_mask
from tally.privacy.payload import ring_encode
from tally.privacy.server import PrivateServer


@dataclass
class RingSum:
    """A ``run_rounds`` sum function that accounts each released sum in ``server``'s ledger."""

    server: PrivateServer
    dropout: float = 0.0
    seed: int = 0
    wire_bytes: list[int] = field(default_factory=list)  # per device per sum, as the codec packs it

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, round_: int, step: StepSpec, contributions: Mapping[int, Arrays]) -> tuple[Arrays, list[int]]:
        devices = sorted(contributions)
        bits = step.schema.required_bits(len(devices))
        dropped = int(self.dropout * len(devices))
        survivors = sorted(self.rng.choice(devices, size=len(devices) - dropped, replace=False).tolist())
        total = np.zeros(step.schema.dim, dtype=np.uint64)
        for d in survivors:
            vector, _ = ring_encode(step.schema, contributions[d], self.rng, bits)
            total = (total + vector.astype(np.uint64)) & np.uint64(ring_mask(bits))
        self.wire_bytes.append(-(-step.schema.dim * wire_width(bits) // 8))
        decoded = step.schema.decode_sum(total.astype(ring_dtype(bits)), bits, contributors=len(survivors))
        self.server.account(round_, step.name, len(survivors))
        return decoded, survivors

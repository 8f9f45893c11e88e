"""Adversaries beside the protocol: device halves that break it on purpose, for load tests and
attack tests. Each subclasses the honest ``SecAggClient`` and overrides one step, so the honest
code has no switch for them and every other step stays the protocol's own.
"""

from __future__ import annotations

import os
from typing import ClassVar

import numpy as np

from tally.secagg import shamir
from tally.secagg.client import SecAggClient


class CorruptDealer(SecAggClient):
    """A dealer whose shares do not reconstruct its secrets. It then answers the complaints
    with its real keys, which convict it: the aggregator must exclude it and the sum go on."""

    # What a load test counts it as (tally_client_misbehaviours_total{kind}).
    kind: ClassVar[str]


class InconsistentDealer(CorruptDealer):
    """Deals shares that lie on no polynomial: each holder's own share looks fine."""

    kind = "inconsistent"

    def dealt_rows(self, rows: np.ndarray) -> np.ndarray:
        columns = [0, shamir.CHUNKS]  # the first chunk of the key and of the seed
        rows[:, columns] = (rows[:, columns] + shamir.random_polynomials(len(rows), 2)) % shamir.P
        return rows


class GarbageDealer(CorruptDealer):
    """Sends random bytes instead of the sealed share to its lowest neighbour."""

    kind = "garbage"

    def sealed_share(self, holder: int, ciphertext: bytes) -> bytes:
        return os.urandom(len(ciphertext)) if holder == 0 else ciphertext


CORRUPT_DEALERS: tuple[type[CorruptDealer], ...] = (InconsistentDealer, GarbageDealer)

"""Adversaries beside the protocol: device halves that break it on purpose, for load tests and
attack tests. Each subclasses the honest ``SecAggClient`` and overrides one step, so the honest
code has no switch for them and every other step stays the protocol's own.
"""

from __future__ import annotations

import os
from typing import ClassVar

from tally.secagg import crypto
from tally.secagg.client import SecAggClient


class CorruptDealer(SecAggClient):
    """A dealer whose shares do not reconstruct its secrets. It then answers the complaints
    with its real keys, which convict it: the aggregator must exclude it and the sum go on."""

    # What a load test counts it as (tally_client_misbehaviours_total{kind}).
    kind: ClassVar[str]


class InconsistentDealer(CorruptDealer):
    """Deals shares that lie on no polynomial: each holder's own share looks fine."""

    kind = "inconsistent"

    def dealt_rows(self, rows: list[list[int]]) -> list[list[int]]:
        for row in rows:  # the key share and the seed share of every holder, shifted at random
            row[0] += crypto.random_scalar()
            row[1] += crypto.random_scalar()
        return rows


class WrongSecretDealer(CorruptDealer):
    """Deals a consistent polynomial whose constant is not its committed seed (issue 38 problem
    1): every holder's share checks against the polynomial; only the constant term gives it away."""

    kind = "wrong_secret"

    def shared_secrets(self, key: int, seed: int) -> tuple[int, int]:
        return key, crypto.random_scalar()


class GarbageDealer(CorruptDealer):
    """Sends random bytes instead of the sealed share to its lowest neighbour."""

    kind = "garbage"

    def sealed_share(self, holder: int, ciphertext: bytes) -> bytes:
        return os.urandom(len(ciphertext)) if holder == 0 else ciphertext


class FramingDealer(CorruptDealer):
    """Seals its lowest neighbour's good share under a key of its own (issue 38 problem 5), hoping
    the holder's complaint is then judged false: the key it can prove opens nothing."""

    kind = "framing"

    def sealing_key(self, holder: int, key: bytes) -> bytes:
        return os.urandom(len(key)) if holder == 0 else key


CORRUPT_DEALERS: tuple[type[CorruptDealer], ...] = (InconsistentDealer, WrongSecretDealer, GarbageDealer,
                                                    FramingDealer)

"""Shared builders for the secure-sum tests: ring inputs and an independent feasibility oracle."""

from __future__ import annotations

import numpy as np

from tally.codec import ring_dtype, ring_mask
from tally.secagg import Dropout, SessionConfig, SessionRef, SumSpec
from tally.secagg.params import GraphParams


def make_config(
    n: int,
    k: int,
    t: int,
    sums: tuple[tuple[str, int, int], ...] = (("s", 8, 20),),
    consistency: bool = False,
    min_survivors: int = 2,
    seed: bytes = b"\x07" * 32,
) -> SessionConfig:
    return SessionConfig(
        ref=SessionRef("job", 1, "sess"),
        sums=tuple(SumSpec(*s) for s in sums),
        params=GraphParams(n, k, t),
        graph_seed=seed,
        consistency_check=consistency,
        min_survivors=min_survivors,
    )


def random_inputs(config: SessionConfig, rng: np.random.Generator) -> dict[int, dict[str, np.ndarray]]:
    return {
        i: {
            s.sum_id: rng.integers(0, ring_mask(s.bits) + 1, size=s.dim, dtype=np.uint64).astype(
                ring_dtype(s.bits)
            )
            for s in config.sums
        }
        for i in range(1, config.n + 1)
    }


def expected_outcome(config: SessionConfig, dropouts: dict[int, Dropout]):
    """What must happen, computed from the protocol rules without the server's code.

    Returns (feasible, {sum_id: contributors}) for the sums that complete before the
    first infeasible one.
    """
    n, t = config.n, config.threshold
    first = config.sums[0].sum_id

    def drops(i: int, phase: str, sum_id: str = "") -> bool:
        d = dropouts.get(i)
        if d is None or d.phase != phase:
            return False
        return phase in ("advertise_keys", "share_keys") or (d.sum_id or first) == sum_id

    nb = {i: set(int(j) for j in config.neighbours(i)) for i in range(1, n + 1)}
    u1 = {i for i in range(1, n + 1) if not drops(i, "advertise_keys")}
    while starved := {i for i in u1 if len(nb[i] & u1) < t}:
        u1 -= starved
    if len(u1) < config.min_survivors:
        return False, {}
    u2 = {i for i in u1 if not drops(i, "share_keys")}
    if len(u2) < config.min_survivors:
        return False, {}
    alive = set(u2)
    outcome = {}
    for spec in config.sums:
        s = spec.sum_id
        u3 = {i for i in alive if not drops(i, "masked_input", s)}
        if len(u3) < config.min_survivors:
            return False, outcome
        signers = set(u3)
        refused = set()
        if config.consistency_check:
            signers = {i for i in u3 if not drops(i, "consistency_check", s)}
            if len(signers) < config.min_survivors:
                return False, outcome
            # A device unmasks only with t neighbours' signatures over the survivor set.
            refused |= {i for i in signers if len(nb[i] & signers) < t}
        # ... and only if t of its share-holding neighbours survived.
        refused |= {i for i in signers if len(nb[i] & u2 & u3) < t}
        responders = {i for i in signers - refused if not drops(i, "unmask", s)}
        dropped = u2 - u3
        for i in u3:
            if len(nb[i] & responders) < t:
                return False, outcome
        for j in dropped:
            if nb[j] & u3 and len(nb[j] & responders) < t:
                return False, outcome
        outcome[s] = u3
        alive = {i for i in signers - refused if not drops(i, "unmask", s)}
    return True, outcome

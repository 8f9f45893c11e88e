"""Session configuration: everything both sides must agree on before the first message.

It is public: devices receive it with their session ticket and recompute their own
neighbourhood from ``graph_seed``, so a server cannot quietly hand a device a
different graph than the one it uses. It also carries the cohort's roster, each index's
enrolled identity key: the coordinator signs the config (through the session ticket) and hands
it to every device over the device's own channel, so the aggregator, which relays every
protocol message, cannot substitute a device's keys.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tally.codec import OverflowRefused, PayloadSchema
from tally.secagg.crypto import PUBLIC_KEY_BYTES
from tally.secagg.graph import HararyGraph
from tally.secagg.messages import SessionRef, SumSpec
from tally.secagg.params import GraphParams, ThreatModel, choose_params, validate_params

MAX_BITS = 64
# The server looks up neighbourhoods per message; below this many entries (8 bytes each) they
# are kept as one table instead of recomputed per call.
_NEIGHBOUR_TABLE_MAX = 1 << 24


@dataclass(frozen=True)
class SessionConfig:
    ref: SessionRef
    sums: tuple[SumSpec, ...]
    params: GraphParams
    graph_seed: bytes
    consistency_check: bool = False
    min_survivors: int = 2
    # identities[i - 1]: the Ed25519 identity public key device i enrolled with (empty only
    # for a plain session, which has no keys to authenticate).
    identities: tuple[bytes, ...] = ()
    # Benchmark-only: devices send their inputs unmasked, so the aggregator sees every
    # individual contribution. It exists to measure what secure aggregation costs.
    plain: bool = False

    def __post_init__(self) -> None:
        if not self.sums:
            raise ValueError("a session needs at least one sum")
        ids = [s.sum_id for s in self.sums]
        if len(set(ids)) != len(ids):
            raise ValueError(f"sum ids must be unique, got {ids}")
        for spec in self.sums:
            if spec.dim < 1:
                raise ValueError(f"sum {spec.sum_id!r}: dim must be >= 1")
            if not 1 <= spec.bits <= MAX_BITS:
                raise OverflowRefused(
                    f"sum {spec.sum_id!r}: {spec.bits} bits is outside 1..{MAX_BITS}"
                )
        if len(self.graph_seed) != 32:
            raise ValueError("graph_seed must be 32 bytes")
        if not 2 <= self.min_survivors <= self.params.n:
            raise ValueError(f"min_survivors must be in 2..{self.params.n}")
        if self.plain and self.consistency_check:
            raise ValueError("a plain-sum session has no survivor sets to check")
        object.__setattr__(self, "identities", tuple(bytes(k) for k in self.identities))
        if (self.identities or not self.plain) and len(self.identities) != self.params.n:
            raise ValueError(
                f"a secure session needs one identity key per device: {len(self.identities)} "
                f"for n={self.params.n}"
            )
        if any(len(k) != PUBLIC_KEY_BYTES for k in self.identities):
            raise ValueError(f"identity keys must be {PUBLIC_KEY_BYTES}-byte Ed25519 public keys")
        if len(set(self.identities)) != len(self.identities):
            raise ValueError("two devices of the cohort have the same identity key")

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def threshold(self) -> int:
        return self.params.t

    @cached_property
    def graph(self) -> HararyGraph:
        return HararyGraph(self.params.n, self.params.k, self.graph_seed)

    @cached_property
    def neighbour_table(self) -> np.ndarray | None:
        """(n + 1, k) read-only: row i holds ``neighbours(i)`` (row 0 is unused); None for a
        cohort too large to tabulate (more than 2^24 entries)."""
        n, k = self.params.n, self.params.k
        if (n + 1) * k > _NEIGHBOUR_TABLE_MAX:
            return None
        table = np.empty((n + 1, k), dtype=np.int64)
        table[0] = 0
        np.add(self.graph.table(), 1, out=table[1:])
        table.setflags(write=False)
        return table

    def neighbour_rows(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), k): row r holds ``neighbours(indices[r])``, from the table when the
        cohort has one, else computed for just these devices."""
        table = self.neighbour_table
        if table is not None:
            rows: np.ndarray = table[indices]
            return rows
        return self.graph.rows(np.asarray(indices, dtype=np.int64) - 1) + 1

    def two_hop_rows(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), m): row r holds, ascending, the devices at most two hops from
        ``indices[r]`` (itself included): all whose neighbourhoods meet its own."""
        return self.graph.ball_rows(np.asarray(indices, dtype=np.int64) - 1, 2) + 1

    def neighbours(self, index: int) -> np.ndarray:
        """1-based indices of the devices holding ``index``'s shares (the graph is 0-based).

        Read-only when it comes from the table: copy it before changing it."""
        table = self.neighbour_table
        if table is None:
            return self.graph.neighbours(index - 1) + 1
        if not 1 <= index <= self.params.n:
            raise IndexError(f"device {index} outside [1, {self.params.n}]")
        row: np.ndarray = table[index]
        return row

    def identity(self, index: int) -> bytes:
        return self.identities[index - 1]

    def sum_spec(self, sum_id: str) -> SumSpec:
        for spec in self.sums:
            if spec.sum_id == sum_id:
                return spec
        raise KeyError(sum_id)

    def sum_position(self, sum_id: str) -> int:
        return [s.sum_id for s in self.sums].index(sum_id)

    @classmethod
    def plan(
        cls,
        ref: SessionRef,
        schemas: Sequence[tuple[str, PayloadSchema]],
        n: int,
        threat: ThreatModel | None = None,
        *,
        identities: Sequence[bytes] = (),
        k: int | None = None,
        t: int | None = None,
        consistency_check: bool | None = None,
        min_survivors: int | None = None,
        graph_seed: bytes | None = None,
        plain: bool = False,
    ) -> SessionConfig:
        """Choose graph, threshold and bit widths for a cohort of ``n`` devices.

        Refuses, before any device is contacted, a schema whose sum over ``n`` devices
        could wrap 64 bits, and any (k, t) override that is unsafe or infeasible.
        ``plain`` is for benchmarks only: see the field's comment. The consistency check is on
        unless the session is plain or the caller turns it off (devices with a semi-honest
        policy only: every other device refuses such a session).
        """
        threat = threat or ThreatModel()
        if k is None and t is None:
            params = choose_params(n, threat)
        else:
            if k is None or t is None:
                auto = choose_params(n, threat)
                k, t = k if k is not None else auto.k, t if t is not None else auto.t
            params = GraphParams(n, k, t)
            validate_params(params, threat)
        sums = []
        for sum_id, schema in schemas:
            bits = schema.required_bits(n)
            schema.check_bits(n, min(bits, MAX_BITS))
            sums.append(SumSpec(sum_id, schema.dim, bits))
        return cls(
            ref=ref,
            sums=tuple(sums),
            params=params,
            graph_seed=graph_seed if graph_seed is not None else os.urandom(32),
            consistency_check=not plain if consistency_check is None else consistency_check,
            min_survivors=min_survivors if min_survivors is not None else max(2, params.t),
            identities=tuple(identities),
            plain=plain,
        )

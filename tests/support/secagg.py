"""Shared builders for the secure-sum tests: ring inputs and an independent feasibility oracle."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable

import numpy as np

from tally.codec import ring_dtype, ring_mask
from tally.secagg import (
    CohortRun,
    DevicePolicy,
    Dropout,
    MalformedMessage,
    OutOfPhase,
    SecAggClient,
    SessionAbortedError,
    SessionConfig,
    SessionRef,
    SigningKey,
    SumSpec,
    run_cohort,
    shamir,
)
from tally.secagg.messages import Outgoing, UnmaskResponse
from tally.secagg.params import GraphParams
from tally.secagg.server import SecAggServer

# The protocol tests use thresholds below what a real device accepts (small t makes dropout
# patterns easy to reach); devices in them run this policy. The policy tests use the default.
LAX = DevicePolicy(threat=None)
# Devices of a benchmark's plain (unmasked) session opt in explicitly.
PLAIN_OK = DevicePolicy(threat=None, allow_plain=True)


@functools.cache
def identities(n: int) -> dict[int, SigningKey]:
    """Deterministic identity keys of devices 1..n (the roster ``make_config`` lists)."""
    return {i: SigningKey(hashlib.sha256(b"tally-test-device|%d" % i).digest()) for i in range(1, n + 1)}


def roster(n: int) -> tuple[bytes, ...]:
    return tuple(key.public for key in identities(n).values())


def lax_client(config: SessionConfig, index: int, **kwargs) -> SecAggClient:
    policy = PLAIN_OK if config.plain else LAX
    return SecAggClient(config, index, identities(config.n)[index], policy=policy, **kwargs)


def lax_cohort(config: SessionConfig, inputs, dropouts=None, **kwargs) -> CohortRun:
    policy = PLAIN_OK if config.plain else LAX
    return run_cohort(config, inputs, dropouts, identities=identities(config.n), policy=policy, **kwargs)


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
        identities=roster(n),
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
    # A device masks only with shares from at least t neighbours delivered to it.
    alive = {i for i in u2 if len(nb[i] & u2) >= t}
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


def share_pairs(owners: tuple, block: bytes) -> list[tuple[object, bytes]]:
    """An answer's (owner, share) pairs, the way a test varies them."""
    size = shamir.SHARE_BYTES
    return [(owner, block[size * i : size * (i + 1)]) for i, owner in enumerate(owners)]


def with_shares(answer: UnmaskResponse, seeds=None, keys=None) -> UnmaskResponse:
    """``answer`` with its seed or key (owner, share) pairs replaced."""
    fields = {}
    for kind, given in (("seed", seeds), ("key", keys)):
        if given is not None:
            fields[f"{kind}_owners"] = tuple(owner for owner, _ in given)
            fields[f"{kind}_shares"] = b"".join(share for _, share in given)
    return dataclasses.replace(answer, **fields)


ServerHook = Callable[[Outgoing], Outgoing]
ClientHook = Callable[[object], object]


class ProtocolCohort:
    """Real server and clients; ``tamper_server`` rewrites what the aggregator sends,
    ``tamper_client`` what devices send; refusals are recorded, not raised."""

    def __init__(self, config: SessionConfig, seed: int = 0, policy: DevicePolicy = LAX,
                 server: SecAggServer | None = None, dealers: dict[int, type[SecAggClient]] | None = None) -> None:
        self.config = config
        self.server = server or SecAggServer(config)
        keys = identities(config.n)
        dealers = dealers or {}
        self.clients = {i: dealers.get(i, SecAggClient)(config, i, keys[i], policy=policy)
                        for i in range(1, config.n + 1)}
        self.inputs = random_inputs(config, np.random.default_rng(seed))
        for i, client in self.clients.items():
            for sum_id, vector in self.inputs[i].items():
                client.provide_input(sum_id, vector)
        self.refused: dict[int, Exception] = {}
        self.rejected: dict[int, Exception] = {}
        self.sent: list[object] = []

    def run(self, tamper_server: ServerHook = lambda o: o, tamper_client: ClientHook = lambda m: m) -> None:
        pending = [m for c in self.clients.values() for m in c.start()]
        while not self.server.finished:
            while pending:
                message = tamper_client(pending.pop(0))
                self.sent.append(message)
                try:
                    out = self.server.receive(message)
                except MalformedMessage as exc:
                    self.rejected[message.sender] = exc
                    continue
                except (OutOfPhase, SessionAbortedError):
                    # a late answer, which a finished session refuses (an aborted one says so);
                    # anything else it raises is a bug the test must see
                    if self.server.finished:
                        continue
                    raise
                pending += self._deliver(out, tamper_server)
            if not self.server.finished:
                pending += self._deliver(self.server.on_deadline(), tamper_server)

    def _deliver(self, out: list[Outgoing], tamper: ServerHook) -> list[object]:
        replies = []
        for o in map(tamper, out):
            if o.recipient in self.refused:
                continue
            try:
                replies += self.clients[o.recipient].receive(o.message)
            except (MalformedMessage, SessionAbortedError) as exc:
                self.refused[o.recipient] = exc
        return replies

    def exact(self, sum_id: str, contributors) -> list[int]:
        bits = self.config.sum_spec(sum_id).bits
        total = sum(self.inputs[i][sum_id].astype(object) for i in contributors)
        return [int(v) % (1 << bits) for v in total]

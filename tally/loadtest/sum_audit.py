"""Checking committed sums against the inputs a fleet sent (load tests, fault campaigns).

Each device of a fleet records the fingerprint of every input it computes
(``InputFingerprint``); the coordinator records, per cohort sum it accepted, the contributing
device indices and the fingerprint of the unmasked total (admin ``GetRoundSums``). A committed
sum is exact when the fingerprints of its contributors' inputs add up to its own. Fingerprints
are linear, so shards of one fleet merge their partial records by adding them (``merge``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from tally.codec.fingerprint import add_fingerprints
from tally.wire.v1 import admin_pb2

EXACT, MISMATCH, FOREIGN = "exact", "mismatch", "foreign"


@dataclass(frozen=True)
class InputFingerprint:
    """What a device put into one sum, as a fingerprint (``tally.codec.fingerprint``): with the
    coordinator's record of the sum's contributors and fingerprint, a fleet proves each
    committed sum exact without keeping any input."""

    job_id: str
    round: int
    session_id: str
    sum_id: str
    device_index: int
    bits: int
    fingerprint: tuple[int, ...]


class CommittedSum(Protocol):
    """One cohort's sum as the coordinator recorded it (``admin_pb2.CohortSumFingerprint``)."""

    session_id: str
    sum_id: str
    cohort: int
    bits: int
    contributors: Sequence[int]
    fingerprint: Sequence[int]


@dataclass(frozen=True)
class SumCheck:
    job_id: str
    round: int
    sum_id: str
    cohort: int
    contributors: int
    # exact; mismatch (the total is not the sum of its contributors' inputs); foreign (some
    # contributors are devices this audit has no record of: another shard's, or not simulated).
    outcome: str


@dataclass
class SumAudit:
    """Per (session, sum): the fingerprint of each device index's input, and the job and round."""

    inputs: dict[tuple[str, str], dict[int, tuple[int, ...]]] = field(default_factory=dict)
    rounds: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, fingerprints: Iterable[InputFingerprint]) -> SumAudit:
        audit = cls()
        for f in fingerprints:
            key = (f.session_id, f.sum_id)
            audit.inputs.setdefault(key, {})[f.device_index] = f.fingerprint
            audit.rounds[key] = (f.job_id, f.round)
        return audit

    def merge(self, other: SumAudit) -> SumAudit:
        """The audit of two shards together (device indices of one session never collide)."""
        merged = SumAudit({k: dict(v) for k, v in self.inputs.items()}, dict(self.rounds))
        for key, by_index in other.inputs.items():
            merged.inputs.setdefault(key, {}).update(by_index)
        merged.rounds.update(other.rounds)
        return merged

    def job_rounds(self) -> list[tuple[str, int]]:
        """Every (job, round) some input was computed for, in order."""
        return sorted(set(self.rounds.values()))

    def check(self, job_id: str, round_: int, committed: Iterable[CommittedSum]) -> list[SumCheck]:
        checks = []
        for s in committed:
            mine = self.inputs.get((s.session_id, s.sum_id), {})
            contributors = list(s.contributors)
            if not all(i in mine for i in contributors):
                outcome = FOREIGN
            else:
                expected = add_fingerprints((mine[i] for i in contributors), s.bits)
                outcome = EXACT if expected == tuple(s.fingerprint) else MISMATCH
            checks.append(SumCheck(job_id, round_, s.sum_id, s.cohort, len(contributors), outcome))
        return checks

    def to_json(self) -> dict[str, Any]:
        return {"inputs": [
            {"session_id": session, "sum_id": sum_id, "job_id": self.rounds[(session, sum_id)][0],
             "round": self.rounds[(session, sum_id)][1],
             "fingerprints": {str(i): [str(x) for x in fp] for i, fp in by_index.items()}}
            for (session, sum_id), by_index in self.inputs.items()
        ]}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SumAudit:
        audit = cls()
        for entry in raw["inputs"]:
            key = (entry["session_id"], entry["sum_id"])
            audit.inputs[key] = {int(i): tuple(int(x) for x in fp) for i, fp in entry["fingerprints"].items()}
            audit.rounds[key] = (entry["job_id"], int(entry["round"]))
        return audit


def outcome_counts(checks: Iterable[SumCheck]) -> dict[str, int]:
    counts = Counter(c.outcome for c in checks)
    return {outcome: counts.get(outcome, 0) for outcome in (EXACT, MISMATCH, FOREIGN)}


async def check_committed(stub: Any, metadata: Sequence[tuple[str, str]], audit: SumAudit,
                          timeout_s: float = 30.0) -> list[SumCheck]:
    """Check every committed round the audit has inputs for against the coordinator's record
    (``stub``: an ``admin_pb2_grpc.AdminStub``). Rounds that never committed are skipped: their
    inputs went into attempts that failed."""
    checks: list[SumCheck] = []
    for job_id, round_ in audit.job_rounds():
        try:
            committed = await stub.GetRoundSums(admin_pb2.GetRoundSumsRequest(job_id=job_id, round=round_),
                                                metadata=metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                continue
            raise
        checks += audit.check(job_id, round_, committed.sums)
    return checks

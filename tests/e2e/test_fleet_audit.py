"""Synthetic fleets and the sum audit (issue 8): a synthetic device's input is a deterministic
grid point, so its encoding is exact; fingerprints are linear; a fleet of synthetic devices runs a
FedAvg job through the real coordinator and two aggregators with dropouts, and every committed
cohort sum equals the sum of the inputs its contributors sent, while a total corrupted on an
aggregator is caught."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from support.jobs import run_synthetic_job
from tally.codec import Field, Kind, PayloadSchema, to_ring
from tally.codec.fingerprint import add_fingerprints, ring_fingerprint
from tally.loadtest.behaviour import BehaviourProfile
from tally.loadtest.sum_audit import EXACT, FOREIGN, MISMATCH, SumAudit, outcome_counts
from tally.loadtest.synthetic import SyntheticUpdates
from tally.secagg.adversary import CorruptDealer, GarbageDealer, InconsistentDealer, WrongSecretDealer
from tally.secagg.messages import SumResult

SCHEMA = PayloadSchema((
    Field("weighted_delta", (50,), clip=4.0, frac_bits=20),
    Field("weight", (), clip=1.0, frac_bits=20),
    Field("examples", (), kind=Kind.COUNT, clip=10**6),
))


@settings(max_examples=25, deadline=None)
@given(device=st.integers(0, 10**6), round_=st.integers(1, 500), seed=st.integers(0, 2**32))
def test_synthetic_inputs_are_deterministic_grid_points_whose_encoding_is_exact(device, round_, seed):
    source = SyntheticUpdates(f"sim-{device}", seed)
    values = source.values("job-a", round_, "update", SCHEMA)
    again = SyntheticUpdates(f"sim-{device}", seed).values("job-a", round_, "update", SCHEMA)
    assert all(np.array_equal(values[k], again[k]) for k in values)
    assert values["weight"] > 0 and 1 <= values["examples"] <= 1000
    assert np.abs(values["weighted_delta"]).max() <= 1.0
    # Two different rounding streams give the same ring vector: nothing is left to chance.
    first = SCHEMA.encode(values, np.random.default_rng(seed)).vector
    second = SCHEMA.encode(values, np.random.default_rng(seed + 1)).vector
    np.testing.assert_array_equal(first, second)
    other_round = source.values("job-a", round_ + 1, "update", SCHEMA)
    assert not np.array_equal(values["weighted_delta"], other_round["weighted_delta"])


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(8, 64), parts=st.integers(1, 6), dim=st.integers(1, 300), seed=st.integers(0, 2**32))
def test_fingerprints_add_like_the_vectors_they_fingerprint(bits, parts, dim, seed):
    rng = np.random.default_rng(seed)
    vectors = [to_ring(rng.integers(-(2**62), 2**62, dim), bits) for _ in range(parts)]
    total = vectors[0]
    for v in vectors[1:]:
        total = to_ring(total.astype(np.uint64) + v.astype(np.uint64), bits)
    key = f"s{seed}/update"
    assert (add_fingerprints([ring_fingerprint(v, bits, key) for v in vectors], bits)
            == ring_fingerprint(total, bits, key))
    changed = total.astype(np.uint64).copy()
    changed[seed % dim] = (int(changed[seed % dim]) + 1) & ((1 << bits) - 1)
    assert ring_fingerprint(changed, bits, key) != ring_fingerprint(total, bits, key)


def test_a_synthetic_fleet_imports_no_torch():
    code = ("import sys, tally.loadtest.fleet, tally.loadtest.synthetic, tally.loadtest.sum_audit, tally.cli.client; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_committed_sum_of_a_synthetic_fleet_is_exact(tmp_path):
    rounds = 3
    result = run_synthetic_job(tmp_path, n=40, rounds=rounds, cohort=16)
    job, stats, checks, inputs = result.job, result.stats, result.checks, result.inputs
    assert job.committed_round == rounds, job.message
    counts = outcome_counts(checks)
    # Every round's sum comes from one or two aggregators' cohorts (two unless one was unhealthy
    # when the round began), all checked and all exact.
    assert counts[MISMATCH] == counts[FOREIGN] == 0 and rounds <= counts[EXACT] <= 2 * rounds
    assert {c.round for c in checks} == set(range(1, rounds + 1))
    assert stats.dropouts > 0 and sum(c.contributors for c in checks) < len(inputs)
    # A shard's audit alone sees the other shard's devices as foreign; merged, it is exact again.
    half = len(inputs) // 2
    shard_a, shard_b = SumAudit.of(inputs[:half]), SumAudit.of(inputs[half:])
    merged = shard_a.merge(SumAudit.from_json(shard_b.to_json()))
    assert merged.inputs == SumAudit.of(inputs).inputs


def test_a_total_corrupted_on_an_aggregator_is_caught(tmp_path, monkeypatch):
    # Every total an aggregator produces gains 1 in one coordinate, and the audit must flag each
    # committed one. No planned dropouts: with 20 devices they can leave a cohort of 5 below its
    # threshold in every attempt, failing the job before anything is committed to audit.
    original = SumResult.__init__
    corrupted = []

    def corrupt(self, sum_id, total, *rest):
        total = total.copy()
        total[3] = total[3] + 1
        corrupted.append(sum_id)
        original(self, sum_id, total, *rest)

    monkeypatch.setattr(SumResult, "__init__", corrupt)
    result = run_synthetic_job(tmp_path, n=20, rounds=1, cohort=10, dropout=0.0)
    job, checks = result.job, result.checks
    assert corrupted and job.committed_round == 1
    counts = outcome_counts(checks)
    assert checks and counts[MISMATCH] == len(checks) and counts[EXACT] == 0


class _CorruptDealers:
    """A profile whose draws stand, except that the fleet's first sessions deal as the given
    adversaries do, one session each; it records who did."""

    def __init__(self, profile: BehaviourProfile, adversaries: list[type[CorruptDealer]]) -> None:
        self._profile = profile
        self._left = list(adversaries)
        self.dealers: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._profile, name)

    def traits(self, seed: int, device_id: str):
        traits = self._profile.traits(seed, device_id)
        drawn = traits.session_events

        def session_events():
            events = drawn()
            if self._left:
                self.dealers.append(device_id)
                return dataclasses.replace(events, dealer=self._left.pop(0))
            return events

        traits.session_events = session_events
        return traits


def test_corrupt_dealers_are_excluded_named_and_every_committed_sum_is_exact(tmp_path):
    """Issue 23, findings 2 and 3 over the real services: devices that deal shares on no
    polynomial, or garbage to one neighbour, are excluded before any masked input; the rounds
    commit, every committed sum is exact, and each dealer is counted and named."""
    profile = _CorruptDealers(BehaviourProfile(), [InconsistentDealer] * 2 + [GarbageDealer] * 2)
    result = run_synthetic_job(tmp_path, n=40, rounds=2, cohort=20, dropout=0.0, profile=profile)
    job, checks = result.job, result.checks
    assert job.committed_round == 2, job.message
    counts = outcome_counts(checks)
    assert counts[EXACT] >= 2 and counts[MISMATCH] == counts[FOREIGN] == 0
    assert result.misbehaved.get("inconsistent") == result.misbehaved.get("garbage") == 2, result.misbehaved
    assert result.excluded == 4
    named = [m for m in result.events if "excluded from cohort" in m]
    assert sorted(m.split()[1] for m in named) == sorted(profile.dealers), named
    assert all("fails under the share key it proved" in m for m in named)


def test_a_dealer_of_a_wrong_secret_is_excluded_before_any_input_and_the_rounds_commit(tmp_path):
    """Issue 38 problem 1 over the real services: two devices deal consistent polynomials whose
    constant is not their committed seed (every holder's share checks). The aggregator's check of
    the constant term excludes each before any masked input and names it; no session aborts, both
    rounds commit on their first attempt with every honest input counted, every sum is exact."""
    profile = _CorruptDealers(BehaviourProfile(), [WrongSecretDealer] * 2)
    result = run_synthetic_job(tmp_path, n=40, rounds=2, cohort=20, dropout=0.0, profile=profile)
    job, checks = result.job, result.checks
    assert job.committed_round == 2, job.message
    counts = outcome_counts(checks)
    assert counts[EXACT] >= 2 and counts[MISMATCH] == counts[FOREIGN] == 0
    assert result.misbehaved.get("wrong_secret") == 2 and result.excluded == 2, (result.misbehaved, result.excluded)
    named = [m for m in result.events if "excluded from cohort" in m]
    assert sorted(m.split()[1] for m in named) == sorted(profile.dealers), named
    assert all("does not open the mask key and seed it committed to" in m for m in named)
    assert all("proven: it sits in no later selection of this job" in m for m in named)
    assert result.convicted == set(profile.dealers)  # what every later selection of the job turns away
    # Without the constant check the first attempt fails in Unmask after every input was sent
    # ("attempt 1 failed: ... do not rebuild the secrets they committed to"), spending them.
    assert not [m for m in result.events if "failed" in m], result.events

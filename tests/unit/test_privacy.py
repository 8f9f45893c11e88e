"""Differential privacy (tally/privacy): the noise the decoded sum carries, dropouts, the
accountant against dp-accounting's published values, the rotation, and refusals at submit.

Device noise comes from the OS CSPRNG and cannot be seeded, so the statistical tests use
tolerances of many standard errors; the inputs (the tests' own draws) use fixed seeds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.codec import CodecError
from tally.codec.schema import ring_mask
from tally.coordinator.spec.jobspec import JobSpecError, parse
from tally.privacy import randomness
from tally.privacy.accounting import PrivacyLedger, calibrate, epsilon_of
from tally.privacy.errors import PrivacyRefused
from tally.privacy.mechanisms import conditional_round
from tally.privacy.payload import PARAMS, NoiseBelowFloor, PrivateClient, check_noise_floor, ring_encode
from tally.privacy.planning import DP_FIELD, plan_distributed, rounding_bound_sq
from tally.privacy.rotation import rotate, unrotate
from tally.privacy.server import PrivacySettings, PrivateServer


class ShiftTrainer:
    """A device whose training moves every parameter by ``shift`` (its update is known)."""

    def __init__(self, shift: float, examples: int = 1) -> None:
        self.shift, self.examples = shift, examples

    @property
    def num_examples(self) -> int:
        return self.examples

    def train(self, params, epochs, lr, batch_size):
        return {k: v + self.shift for k, v in params.items()}, 0.0

    def evaluate(self, params):
        return 0.0, 0.0


class RecordingFedAvg(FedAvgServer):
    """FedAvg's server half that also keeps the total it was given."""

    def apply(self, state, step, total):
        self.received = dict(total)
        return super().apply(state, step, total)


def fedavg_job(mechanism: str, cohort: int, z: float, **extra):
    server, client = RecordingFedAvg(FedAvgOptions(example_cap=1)), FedAvgClient(FedAvgOptions(example_cap=1))
    settings = PrivacySettings(mechanism, 1.0, z, 1e-5, cohort_size=cohort, **extra)
    private = PrivateServer(server, "fedavg", settings)
    state = private.init({"w": np.zeros((127, 128)), "b": np.zeros(128)})  # 16384 values + weight
    return private, PrivateClient(client), state


def ring_total(schema, payloads, bits):
    total = np.zeros(schema.dim, dtype=np.uint64)
    for payload in payloads:
        vector, clipped = ring_encode(schema, payload, np.random.default_rng(0), bits)
        assert clipped == 0
        total = (total + vector.astype(np.uint64)) & np.uint64(ring_mask(bits))
    return total


def released_noise(mechanism: str, cohort: int, survivors: int, z: float, **extra):
    """One round of devices that all shift by 0.001 (so no clipping); the server's total minus
    the true sum, in the payload's coordinates, and the server (for its ledger)."""
    private, client, state = fedavg_job(mechanism, cohort, z, **extra)
    (step,) = private.steps(state)
    broadcast = private.broadcast(state, "update")
    payloads = [client.contribute("update", broadcast, ShiftTrainer(0.001), None)[0] for _ in range(survivors)]
    bits = step.schema.required_bits(cohort)
    total = step.schema.decode_sum(
        ring_total(step.schema, payloads, bits).astype(np.dtype(np.uint32 if bits <= 32 else np.uint64)),
        bits, contributors=survivors)
    private.account(1, "update", survivors)
    private.apply(state, "update", total)
    released = private.inner.received
    # FedAvg's weight is 1 per device (example_cap 1): its total is the contributor count.
    assert released["weight"] == survivors
    return released["weighted_delta"].ravel() - survivors * 0.001, private


def test_discrete_gaussian_sampler_has_the_declared_variance():
    sigma, n = 3.7, 400_000
    draws = randomness.discrete_gaussian(sigma, n)
    assert draws.dtype == np.int64
    # Var N_Z(0, s^2) = s^2 (1 - O(e^{-2 pi^2 s^2})); standard error of the variance ~ s^2 sqrt(2/n).
    assert abs(draws.var() / sigma**2 - 1) < 6 * math.sqrt(2 / n)
    assert abs(draws.mean()) < 6 * sigma / math.sqrt(n)


def test_secure_uniforms_are_fresh_and_in_range():
    a, b = randomness.uniform(10_000), randomness.uniform(10_000)
    assert not np.array_equal(a, b)
    assert a.min() > 0 and a.max() <= 1
    assert abs(a.mean() - 0.5) < 6 * math.sqrt(1 / 12 / 10_000)


@pytest.mark.parametrize("mechanism", ["central", "distributed"])
def test_the_decoded_sum_carries_the_declared_noise(mechanism):
    noise, private = released_noise(mechanism, cohort=20, survivors=20, z=0.7, dropout_rate=0.1,
                                    corrupt_rate=0.05, min_survivors=5)
    if mechanism == "central":
        declared = 0.7 * 1.0
    else:
        plan = private.plan_of("update")
        # All 20 devices' discrete noise, plus conditional rounding (variance <= 1/4 per device).
        declared = math.sqrt(20 * plan.sigma_device**2) / plan.scale
        assert math.sqrt(20 * plan.sigma_device**2 + 20 / 4) / plan.scale < declared * 1.001
    # 16384 coordinates: the sample std is within 5 standard errors (0.55% each) of the declared
    # one, tight enough to tell 20 devices' noise from the 17 the plan assumed.
    assert abs(noise.std() / declared - 1) < 5 / math.sqrt(2 * noise.size)
    assert abs(noise.mean()) < 5 * declared / math.sqrt(noise.size)


def test_distributed_noise_survives_dropouts_as_accounted():
    """Planned for 20 with 10% dropouts; only 12 devices survive. The sum carries 12 devices'
    noise, and the ledger records exactly that (a larger epsilon), not the plan's."""
    full, full_server = released_noise("distributed", 20, 20, 1.0, dropout_rate=0.1, corrupt_rate=0.0, min_survivors=5)
    dropped, dropped_server = released_noise("distributed", 20, 12, 1.0, dropout_rate=0.1, corrupt_rate=0.0,
                                             min_survivors=5)
    plan = dropped_server.plan_of("update")
    assert abs(dropped.std() * plan.scale / (math.sqrt(12) * plan.sigma_device) - 1) < 5 / math.sqrt(2 * dropped.size)
    assert dropped.std() < full.std()
    recorded = dropped_server.ledger.rounds[-1]
    assert recorded.noise_devices == 12
    # The recorded multiplier is what the measured noise says: sigma of the sum over Delta_2.
    measured = dropped.std() * plan.scale / plan.sensitivity
    assert abs(recorded.noise_multiplier / measured - 1) < 5 / math.sqrt(2 * dropped.size)
    assert recorded.epsilon_round > full_server.ledger.rounds[-1].epsilon_round


def test_corrupt_devices_noise_is_not_counted():
    private, _, state = fedavg_job("distributed", 20, 1.0, corrupt_rate=0.1, min_survivors=5)
    private.steps(state)
    assert private.account(1, "update", 20).noise_devices == 18
    # At the planned honest survivors (floor(20 * 1.0) - 2), the noise is exactly the spec's.
    assert private.plan_of("update").noise_devices == 18
    assert private.ledger.rounds[-1].noise_multiplier == pytest.approx(1.0, rel=1e-3)


def test_accountant_agrees_with_dp_accountings_published_examples():
    # rdp_privacy_accountant_test.test_compute_epsilon_delta_gaussian: multiplier 4.530877117
    # gives exactly (1, 1e-6)-DP.
    ledger = PrivacyLedger(1e-6)
    assert ledger.record(1, 4.530877117).epsilon_total == pytest.approx(1.0, abs=1e-3)
    # Composition is the library's: T rounds of z equal one SelfComposed event.
    ledger = PrivacyLedger(1e-5, sampling_rate=0.1)
    for r in range(30):
        entry = ledger.record(r, 1.1)
    assert entry.epsilon_total == pytest.approx(epsilon_of(1.1, 30, 1e-5, 0.1), rel=1e-9)
    assert entry.epsilon_round < entry.epsilon_total


@pytest.mark.parametrize("target", [1.0, 2.0, 4.0, 8.0])
def test_calibration_meets_the_target(target):
    z = calibrate(target, 1e-5, 25, 0.1)
    assert epsilon_of(z, 25, 1e-5, 0.1) <= target * (1 + 1e-3)
    assert epsilon_of(z * 0.97, 25, 1e-5, 0.1) > target


def test_ledger_replays_committed_rounds():
    ledger = PrivacyLedger(1e-5)
    ledger.record(1, 2.0)
    ledger.record(1, 3.0)  # a failed attempt's sum, then the committed one
    first = ledger.commit()
    ledger.record(2, 2.5)
    second = ledger.commit()
    restored = PrivacyLedger(1e-5)
    restored.replay(1, first)
    restored.replay(2, second)
    assert restored.epsilon == pytest.approx(ledger.epsilon)
    assert second["privacy.epsilon"] == pytest.approx(ledger.epsilon)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=300), st.integers(0, 2**63 - 1))
def test_hadamard_rotation_is_invertible_and_keeps_norms(values, seed):
    x = np.array(values)
    y = rotate(x, seed)
    assert y.size & (y.size - 1) == 0 and y.size >= x.size
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-9, abs=1e-9)
    np.testing.assert_allclose(unrotate(y, seed, x.size), x, rtol=1e-9, atol=1e-9)


def test_conditional_rounding_respects_its_norm_bound():
    rng = np.random.default_rng(3)
    x = rng.normal(size=512)
    x *= 40 / np.linalg.norm(x)
    bound = rounding_bound_sq(40, 512)
    for _ in range(20):
        r = conditional_round(x, bound)
        assert r @ r <= bound and np.max(np.abs(r - x)) < 1


def test_bits_follow_noise_cohort_and_dropouts():
    base = dict(clip=1.0, dim=1000, noise_multiplier=1.0, cohort_size=100, dropout_rate=0.1, corrupt_rate=0.0,
                min_survivors=10)
    bits = plan_distributed(**base).bits(100)
    assert plan_distributed(**{**base, "cohort_size": 1000}).bits(1000) > bits
    assert plan_distributed(**{**base, "noise_multiplier": 16.0}).bits(100) > bits
    # More expected dropouts: each device adds more noise, so each needs a wider share.
    assert plan_distributed(**{**base, "dropout_rate": 0.5}).share > plan_distributed(**base).share
    narrow = plan_distributed(**base, bits=bits - 3)
    assert narrow.bits(100) <= bits - 3 and narrow.inflation > plan_distributed(**base).inflation


SPEC = "name: dp\nalgorithm: {algorithm}\nrounds: 20\ncohort_size: 20\noptions: {{example_cap: 1}}\n"


@pytest.mark.parametrize("privacy, reason", [
    ("{mechanism: distributed, clip: 1.0, target_epsilon: 0.001}", "target_epsilon 0.001"),
    ("{mechanism: central, clip: 1.0}", "exactly one of noise_multiplier and target_epsilon"),
    ("{mechanism: distributed, clip: 1.0, noise_multiplier: 2.0, bits: 8}", "8 bits cannot hold"),
    ("{mechanism: distributed, clip: 1.0, noise_multiplier: 1.0, population: 10}", "population 10"),
    ("{mechanism: laplace, clip: 1.0, noise_multiplier: 1.0}", "privacy.mechanism"),
])
def test_a_refused_spec_names_the_reason(privacy, reason):
    with pytest.raises(JobSpecError, match=reason):
        parse(SPEC.format(algorithm="fedavg") + f"privacy: {privacy}\n")


def test_a_target_epsilon_is_checked_over_the_rounds_that_only_evaluate_too():
    """The runner calibrates over every release, evaluation-only rounds included; the submit check
    must count the same rounds, or a job it accepts could fail at its start."""
    privacy = "privacy: {mechanism: distributed, clip: 1.0, target_epsilon: 0.001}\n"
    with pytest.raises(JobSpecError, match="over 20 rounds"):
        parse(SPEC.format(algorithm="fedavg") + privacy)
    with pytest.raises(JobSpecError, match="over 21 rounds"):
        parse(SPEC.format(algorithm="fedavg") + "evaluation: {final: true}\n" + privacy)


def test_distributed_dp_needs_honest_survivors():
    text = SPEC.format(algorithm="fedavg").replace("cohort_size: 20", "cohort_size: 2\nmin_cohort: 2") + (
        "secure: {dropout_rate: 0.5, corrupt_rate: 0.4}\n"
        "privacy: {mechanism: distributed, clip: 1.0, noise_multiplier: 1.0}\n")
    with pytest.raises(JobSpecError, match="no honest survivor|min_cohort"):
        parse(text)


def test_an_accepted_spec_round_trips():
    spec = parse(SPEC.format(algorithm="fedavg") + "privacy: {mechanism: distributed, clip: 0.5, target_epsilon: 4}\n")
    assert spec.privacy.target_epsilon == 4 and parse(spec.to_yaml()).privacy == spec.privacy


def test_refused_plan_reports_kls_requirement():
    with pytest.raises(PrivacyRefused):
        plan_distributed(clip=1.0, dim=10, noise_multiplier=1.0, cohort_size=3, dropout_rate=0.0,
                         corrupt_rate=0.9, min_survivors=1)


def test_a_counted_field_must_be_one_on_every_device():
    private, client, state = fedavg_job("central", 20, 1.0)
    private.steps(state)
    broadcast = private.broadcast(state, "update")
    with pytest.raises(CodecError, match="'weight' is counted"):
        client.contribute("update", broadcast, ShiftTrainer(0.001, examples=0), None)


def test_without_example_cap_one_the_weight_is_clipped_with_the_update():
    server = FedAvgServer(FedAvgOptions(example_cap=4))
    client = PrivateClient(FedAvgClient(FedAvgOptions(example_cap=4)))
    private = PrivateServer(server, "fedavg", PrivacySettings("central", 1.0, 1.0, 1e-5, cohort_size=5))
    state = private.init({"w": np.zeros(100)})
    (step,) = private.steps(state)
    assert [f.name for f in step.schema.fields] == ["weighted_delta", "weight"]
    payload, _ = client.contribute("update", private.broadcast(state, "update"), ShiftTrainer(1.0), None)
    joint = np.concatenate([payload["weighted_delta"], [payload["weight"]]])
    assert np.linalg.norm(joint) == pytest.approx(1.0)  # (0.25 * 1, 0.25) scaled onto the unit ball
    assert payload["weighted_delta"][0] / payload["weight"] == pytest.approx(1.0)  # the mean update kept


def floor_broadcast(mechanism: str, z: float, cohort: int = 20):
    private, client, state = fedavg_job(mechanism, cohort, z)
    private.steps(state)
    return private, client, state, private.broadcast(state, "update")


@pytest.mark.parametrize("mechanism, z, floor, reason", [
    ("distributed", 0.5, 1.0, "below_floor"),
    ("central", 2.0, 1.0, "central"),
])
def test_a_device_refuses_noise_below_its_floor(mechanism, z, floor, reason):
    _, client, _, broadcast = floor_broadcast(mechanism, z)
    guarded = PrivateClient(client.inner, min_noise_multiplier=floor, cohort=20)
    with pytest.raises(NoiseBelowFloor, match=">= 1|floor 1") as refused:
        guarded.contribute("update", broadcast, ShiftTrainer(0.001), None)
    assert refused.value.reason == reason


def test_a_device_refuses_a_step_without_noise_and_accepts_enough():
    plain = FedAvgClient(FedAvgOptions(example_cap=1))
    with pytest.raises(NoiseBelowFloor, match="no DP noise") as refused:
        PrivateClient(plain, 1.0, 20).contribute("update", {"w": np.zeros(3)}, ShiftTrainer(0.001), None)
    assert refused.value.reason == "no_noise"
    _, client, _, broadcast = floor_broadcast("distributed", 1.0)
    payload, _ = PrivateClient(client.inner, 1.0, 20).contribute("update", broadcast, ShiftTrainer(0.001), None)
    assert set(payload) == {DP_FIELD}


@given(shrink=st.floats(0.05, 0.99), inflate=st.integers(1, 40))
@settings(max_examples=30, deadline=None)
def test_a_share_smaller_than_the_declared_noise_is_refused(shrink, inflate):
    """A server that declares z but asks each device for a smaller share, or claims more noisy
    devices than the cohort holds, gets no input from a device whose floor is z."""
    _, client, _, broadcast = floor_broadcast("distributed", 1.0)
    params = broadcast[PARAMS].copy()
    cheat = dict(broadcast)
    cheat[PARAMS] = np.concatenate([params[:4], [params[4] * shrink], params[5:]])
    with pytest.raises(NoiseBelowFloor, match="share") as refused:
        check_noise_floor(cheat, 1.0, cohort=20)
    assert refused.value.reason == "share_mismatch"
    # Claiming more honest devices than the cohort: each share is smaller by sqrt of the claim.
    claimed = params[6] + inflate
    cheat[PARAMS] = np.concatenate([params[:4], [params[4] * math.sqrt(params[6] / claimed)], params[5:6], [claimed]])
    with pytest.raises(NoiseBelowFloor):
        check_noise_floor(cheat, 1.0, cohort=int(params[6]))

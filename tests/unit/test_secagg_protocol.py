"""The secure sum end to end through the sans-IO state machines (in-process driver)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.secagg import expected_outcome, lax_client, lax_cohort, make_config, random_inputs, roster
from tally.codec import Field, Kind, OverflowRefused, PayloadSchema, ring_mask
from tally.secagg import (
    Dropout,
    SecAggServer,
    SessionConfig,
    SessionRef,
    ThreatModel,
    UnsafeParameters,
    choose_params,
    secure_sum,
)
from tally.secagg.phases import DROPPABLE, Phase


def exact_total(inputs, contributors, sum_id, bits) -> list[int]:
    """The sum in Python integers: no numpy wrap-around can hide an error."""
    columns = zip(*(inputs[i][sum_id].tolist() for i in contributors))
    return [sum(c) % (1 << bits) for c in columns]


@st.composite
def cohorts(draw):
    n = draw(st.integers(3, 16))
    full = draw(st.booleans()) or n < 6
    if full:
        k = n - 1
    else:
        k = draw(st.sampled_from([d for d in range(2, n - 1, 2)]))
    t = draw(st.integers(1 if k < 2 else 2, k))
    n_sums = draw(st.integers(1, 3))
    sums = tuple(
        (f"s{j}", draw(st.integers(1, 12)), draw(st.sampled_from([1, 7, 16, 31, 32, 33, 64])))
        for j in range(n_sums)
    )
    consistency = draw(st.booleans())
    phases = [p for p in DROPPABLE if consistency or p != Phase.CONSISTENCY_CHECK]
    dropouts = {}
    for i in range(1, n + 1):
        if draw(st.integers(0, 3)) == 0:
            dropouts[i] = Dropout(draw(st.sampled_from(phases)), draw(st.sampled_from([s[0] for s in sums])))
    return make_config(n, k, t, sums, consistency, min_survivors=2), dropouts, draw(st.integers(0, 2**32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cohorts())
def test_sum_is_exact_whenever_enough_devices_survive(case):
    config, dropouts, seed = case
    inputs = random_inputs(config, np.random.default_rng(seed))
    run = lax_cohort(config, inputs, dropouts)
    feasible, outcome = expected_outcome(config, dropouts)
    if feasible:
        assert run.aborted is None, run.aborted
    else:
        assert run.aborted, "an infeasible dropout pattern must abort the session"
    for sum_id, contributors in outcome.items():
        result = run.results[sum_id]
        assert set(result.contributors) == contributors
        bits = config.sum_spec(sum_id).bits
        expected = exact_total(inputs, contributors, sum_id, bits)
        assert [int(v) for v in result.total] == expected
    if not feasible:
        assert len(run.results) == len(outcome)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(3, 30),
    dim=st.integers(1, 30),
    clip=st.floats(0.1, 100.0),
    frac_bits=st.integers(4, 24),
    seed=st.integers(0, 2**32),
)
def test_real_sums_within_documented_quantisation_bound(n, dim, clip, frac_bits, seed):
    rng = np.random.default_rng(seed)
    schema = PayloadSchema(
        (Field("x", (dim,), clip=clip, frac_bits=frac_bits), Field("n", (), kind=Kind.COUNT, clip=50))
    )
    values = {
        i: {"s": {"x": rng.normal(scale=clip, size=dim), "n": int(rng.integers(0, 51))}}
        for i in range(1, n + 1)
    }
    threat = ThreatModel(dropout_rate=0.0, corrupt_rate=0.0, malicious_server=False)
    decoded, run = secure_sum({"s": schema}, values, threat=threat, rng=rng)
    assert run.aborted is None
    exact = sum(np.clip(values[i]["s"]["x"], -clip, clip) for i in values)
    bound = schema.quantisation_bound(n)["x"]
    assert np.max(np.abs(decoded["s"]["x"] - exact)) <= bound
    assert decoded["s"]["n"] == sum(values[i]["s"]["n"] for i in values)


def test_auto_parameters_survive_their_expected_dropout_rate():
    threat = ThreatModel(dropout_rate=0.1, corrupt_rate=0.05)
    n = 300
    rng = np.random.default_rng(1)
    schema = PayloadSchema((Field("x", (4,), clip=1.0, frac_bits=16),))
    values = {i: {"s": {"x": rng.uniform(-1, 1, 4)}} for i in range(1, n + 1)}
    phases = ["share_keys", "masked_input", "unmask"]
    victims = rng.choice(np.arange(1, n + 1), size=30, replace=False)
    dropouts = {int(i): Dropout(phases[j % 3]) for j, i in enumerate(victims)}
    decoded, run = secure_sum({"s": schema}, values, threat=threat, dropouts=dropouts, rng=rng)
    assert run.config.params.k < n - 1, "a 300-device cohort should use a sparse SecAgg+ graph"
    assert run.aborted is None
    contributors = run.results["s"].contributors
    assert len(contributors) == n - 20
    exact = sum(values[i]["s"]["x"] for i in contributors)
    assert np.max(np.abs(decoded["s"]["x"] - exact)) <= schema.quantisation_bound(n)["x"]


def test_too_many_dropouts_abort_with_a_clear_reason():
    config = make_config(8, 7, 5)
    inputs = random_inputs(config, np.random.default_rng(0))
    dropouts = {i: Dropout("masked_input") for i in (1, 2, 3, 4)}
    run = lax_cohort(config, inputs, dropouts)
    assert run.aborted and "unmask" in run.aborted
    assert run.results == {}


def test_dropout_in_second_sum_keeps_first_sum_and_reveals_only_second_sum_keys():
    config = make_config(10, 9, 5, sums=(("losses", 3, 20), ("updates", 5, 24)))
    inputs = random_inputs(config, np.random.default_rng(3))
    run = lax_cohort(config, inputs, {4: Dropout("masked_input", "updates")})
    assert run.aborted is None
    assert 4 in run.results["losses"].contributors
    assert 4 not in run.results["updates"].contributors
    server = run.server
    assert 4 in server.revealed_seeds["losses"] and 4 not in server.revealed_keys["losses"]
    assert 4 in server.revealed_keys["updates"] and 4 not in server.revealed_seeds["updates"]
    # Different sums use independent keys: the revealed mask key of sum 2 is not the one of sum 1.
    clients_keys = {s.sum_id: s for s in run.server.advertised[4].keys}
    assert clients_keys["losses"].mask_public != clients_keys["updates"].mask_public


def test_overflow_is_refused_before_any_device_is_asked():
    wide = PayloadSchema((Field("x", (2,), clip=2.0**20, frac_bits=40),))
    with pytest.raises(OverflowRefused, match="64"):
        SessionConfig.plan(SessionRef("j", 0, "s"), [("s", wide)], 1000, identities=roster(1000))


def test_bit_width_grows_with_cohort_so_the_sum_cannot_wrap():
    schema = PayloadSchema((Field("x", (1,), clip=1.0, frac_bits=19),))
    small = SessionConfig.plan(SessionRef("j", 0, "s"), [("s", schema)], 10, identities=roster(10))
    large = SessionConfig.plan(SessionRef("j", 0, "s"), [("s", schema)], 1024, identities=roster(1024))
    assert small.sums[0].bits < large.sums[0].bits == 31
    # Every device at +clip: the true total 1024 must come back, not a wrapped value.
    n = 40
    values = {i: {"s": {"x": np.array([1.0])}} for i in range(1, n + 1)}
    threat = ThreatModel(dropout_rate=0.0, corrupt_rate=0.0, malicious_server=False)
    decoded, _ = secure_sum({"s": schema}, values, threat=threat)
    assert decoded["s"]["x"][0] == pytest.approx(n, abs=schema.quantisation_bound(n)["x"])


def test_unsafe_overrides_are_refused_with_a_message():
    schema = PayloadSchema((Field("x", (1,)),))
    threat = ThreatModel(dropout_rate=0.1, corrupt_rate=0.05)
    auto = choose_params(1000, threat)
    with pytest.raises(UnsafeParameters):
        SessionConfig.plan(SessionRef("j", 0, "s"), [("s", schema)], 1000, threat, k=auto.k, t=2,
                           identities=roster(1000))
    with pytest.raises(UnsafeParameters):
        SessionConfig.plan(SessionRef("j", 0, "s"), [("s", schema)], 1000, threat, k=auto.k, t=auto.k,
                           identities=roster(1000))
    with pytest.raises(UnsafeParameters):
        SessionConfig.plan(SessionRef("j", 0, "s"), [("s", schema)], 1000, threat, k=auto.k + 1,
                           identities=roster(1000))
    ok = SessionConfig.plan(SessionRef("j", 0, "s"), [("s", schema)], 1000, threat, k=auto.k, t=auto.t,
                            identities=roster(1000))
    assert (ok.params.k, ok.params.t) == (auto.k, auto.t)


def test_ring_wraps_only_mod_2_to_the_bits():
    config = make_config(5, 4, 3, sums=(("s", 4, 7),))
    inputs = {i: {"s": np.full(4, ring_mask(7), dtype=np.uint32)} for i in range(1, 6)}
    run = lax_cohort(config, inputs)
    assert [int(v) for v in run.results["s"].total] == [(5 * 127) % 128] * 4


def test_a_lost_device_closes_the_phase_without_waiting_for_the_deadline():
    from tally.secagg import SecAggServer

    config = make_config(6, 5, 3, sums=(("s", 4, 16),))
    inputs = random_inputs(config, np.random.default_rng(5))
    server = SecAggServer(config)
    clients = {i: lax_client(config, i) for i in range(1, 7)}
    for i, c in clients.items():
        c.provide_input("s", inputs[i]["s"])
    pending = [m for i, c in clients.items() if i != 6 for m in c.start()]
    out = []
    for m in pending:
        out += server.receive(m)
    assert out == [] and server.phase == "advertise_keys"
    # Device 6's connection drops: the phase closes at once, nobody waits for a deadline.
    out = server.device_lost(6)
    assert server.phase == "share_keys" and {o.recipient for o in out} == {1, 2, 3, 4, 5}
    while out:
        replies = [r for o in out for r in clients[o.recipient].receive(o.message)]
        # Once Unmask has t shares per secret the server is done; later answers are late.
        out = [o for r in replies if not server.finished for o in server.receive(r)]
    assert server.finished and server.aborted is None
    expected = sum(inputs[i]["s"].astype(np.int64) for i in range(1, 6)) % (1 << 16)
    assert np.array_equal(server.results["s"].total.astype(np.int64), expected)


def _plain(config: SessionConfig) -> SessionConfig:
    return dataclasses.replace(config, plain=True)


def test_plain_mode_sums_exactly_the_devices_that_answered():
    config = _plain(make_config(9, 8, 5, sums=(("losses", 3, 20), ("updates", 6, 33))))
    inputs = random_inputs(config, np.random.default_rng(11))
    dropouts = {2: Dropout("masked_input", "losses"), 7: Dropout("masked_input", "updates")}
    run = lax_cohort(config, inputs, dropouts)
    assert run.aborted is None
    server = run.server
    # Only plain-sum phases ran: nothing was advertised, shared or unmasked.
    assert server.advertised == {} and server.revealed_seeds == {} and server.revealed_keys == {}
    losses, updates = run.results["losses"], run.results["updates"]
    assert losses.contributors == (1, 3, 4, 5, 6, 7, 8, 9) and losses.dropped == (2,)
    assert updates.contributors == (1, 3, 4, 5, 6, 8, 9) and updates.dropped == (2, 7)
    for result in (losses, updates):
        bits = config.sum_spec(result.sum_id).bits
        assert result.total.tolist() == exact_total(inputs, result.contributors, result.sum_id, bits)


def test_plain_mode_enforces_min_survivors_and_starts_only_on_request():
    config = _plain(make_config(4, 3, 2, min_survivors=3))
    assert lax_client(config, 1).start() == []
    assert SecAggServer(make_config(4, 3, 2)).start() == []
    inputs = random_inputs(config, np.random.default_rng(5))
    run = lax_cohort(config, inputs, {1: Dropout("masked_input"), 2: Dropout("advertise_keys")})
    assert run.aborted and "plain_sum" in run.aborted and run.results == {}
    with pytest.raises(ValueError, match="plain"):
        dataclasses.replace(config, consistency_check=True)

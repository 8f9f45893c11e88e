"""Differential privacy for every algorithm that runs on secure sums (issue 13): each declares
the L2 sensitivity of its fields (tally/privacy/sensitivity.py), a job spec with ``privacy:``
validates (or is refused naming why), a DP run in process completes with the accountant's
epsilon recorded, and no payload a client half produces leaves the declared bound once clipped.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tally import algorithms
from tally.algorithms import packages
from tally.algorithms.base import StepSpec
from tally.algorithms.fedavg import FedAvgOptions
from tally.codec import Field, PayloadSchema
from tally.coordinator.spec.jobspec import JobSpecError, parse
from tally.privacy.accounting import calibrate
from tally.privacy.errors import PrivacyRefused
from tally.privacy.payload import FIELD_PREFIX, PARAMS, PrivateClient, privatise
from tally.privacy.sensitivity import Role, declared_roles, layout
from tally.privacy.server import PrivacySettings, PrivateServer
from tally.privacy.simulation import RingSum
from tally.sim import scenarios
from tally.sim.rounds import run_rounds
from tally.training import single_threaded

PRIVACY = "privacy: {{mechanism: {mechanism}, clip: 1.0, target_epsilon: 8}}\n"
# Per algorithm: the job's model and options (each a valid job without privacy).
JOBS: dict[str, tuple[str, str]] = {
    "fedavg": ("{kind: mlp, inputs: 8, classes: 3, hidden: 4}", "{example_cap: 1}"),
    "lg_fedavg": ("{kind: mlp, inputs: 8, classes: 3, hidden: 4}", "{example_cap: 1}"),
    "superfed": ("{kind: mlp, inputs: 8, classes: 3, hidden: 4}", "{}"),
    "agnostic_fedavg": ("{kind: mlp, inputs: 8, classes: 3, hidden: 4}", "{domains: 2, count_clip: 1000}"),
    "aaggff_d": ("{kind: mlp, inputs: 8, classes: 3, hidden: 4}", "{num_clients: 40}"),
    "aaggff_s": ("{kind: mlp, inputs: 8, classes: 3, hidden: 4}", "{num_clients: 40, solver: separable}"),
    "feddar_wa": ("{kind: domain_mlp, inputs: 8, classes: 3, hidden: 4, domains: 2}", "{}"),
    "feddar_sa": ("{kind: domain_mlp, inputs: 8, classes: 3, hidden: 4, domains: 2}", "{}"),
    "fedevg": ("{kind: energy_mlp, inputs: 2, classes: 4, hidden: 8}", "{classes: 4, inputs: 2, per_class: 5}"),
}


def job(algorithm: str, mechanism: str = "distributed") -> str:
    model, options = JOBS[algorithm]
    return (f"name: dp\nalgorithm: {algorithm}\nrounds: 10\ncohort_size: 20\nmodel: {model}\n"
            f"options: {options}\n" + PRIVACY.format(mechanism=mechanism))


def test_every_algorithm_on_secure_sums_declares_its_sensitivities():
    assert set(algorithms.NAMES) == set(JOBS)
    assert all(packages.get(name).privacy for name in JOBS)
    assert set(packages.ROLES) == {role.value for role in Role}


@pytest.mark.parametrize("mechanism", ["central", "distributed"])
@pytest.mark.parametrize("algorithm", sorted(JOBS))
def test_a_private_job_spec_validates(algorithm, mechanism):
    spec = parse(job(algorithm, mechanism))
    assert spec.privacy.mechanism == mechanism and spec.privacy.target_epsilon == 8


def test_aaggff_s_ons_is_refused_naming_its_reveal():
    text = job("aaggff_s").replace("solver: separable", "solver: ons") + "reveal: [response]\n"
    with pytest.raises(JobSpecError, match="aaggff_s step 'response' reveals per-device values"):
        parse(text)


class UndeclaredServer:
    """An algorithm that declares no sensitivity for its exact count."""

    name = "undeclared"

    def steps(self, state: Any) -> list[StepSpec]:
        return [StepSpec("sum", PayloadSchema((Field("n", (), kind="count", clip=10),)))]


def test_a_field_without_a_declared_sensitivity_is_refused_by_name():
    (step,) = UndeclaredServer().steps(None)
    with pytest.raises(PrivacyRefused, match="'n' \\(an exact count\\) declares no L2 sensitivity"):
        layout("undeclared", UndeclaredServer(), step)


def test_a_counted_role_on_a_count_field_is_refused_by_name():
    server = UndeclaredServer()
    server.privacy_fields = {"n": Role.CLIPPED}
    with pytest.raises(PrivacyRefused, match="'n' is a count and cannot be clipped"):
        layout("undeclared", server, server.steps(None)[0])


class OptionsElsewhere(UndeclaredServer):
    """A server half that keeps its options under another name than ``options``."""

    config = FedAvgOptions(example_cap=1)


@pytest.mark.parametrize("algorithm", ["fedavg", "aaggff_d"])
def test_a_declaration_reading_options_refuses_a_half_without_them(algorithm):
    """Issue 43: a declaration read ``server.config`` and fell back to defaults; a half whose options
    moved would have had FedAvg's weight clipped, not counted, or AAggFF's scale bounded by 1."""
    with pytest.raises(TypeError, match="OptionsElsewhere.options is NoneType"):
        declared_roles(algorithm, OptionsElsewhere())


def test_fedavg_counts_its_weight_as_its_options_say():
    counted, _ = algorithms.make("fedavg", {"example_cap": 1})
    weighted, _ = algorithms.make("fedavg", {"example_cap": 10})
    assert declared_roles("fedavg", counted)["weight"] is Role.COUNTED
    assert declared_roles("fedavg", weighted)["weight"] is Role.CLIPPED


def scenario_for(algorithm: str, clients: int) -> tuple[scenarios.Scenario, dict[str, Any]]:
    """A small scenario each algorithm runs on, and its options."""
    single_threaded()
    if algorithm == "fedevg":
        from tally.datasets.energy_toy import four_blobs
        from tally.models.energy import energy_mlp
        from tally.models.params import get_params
        from tally.training.energy import EnergyTrainer

        data = four_blobs(clients=clients, alpha=1.0, samples=600, seed=0)
        factory = lambda: energy_mlp(2, 4, 16, 0)  # noqa: E731
        devices = [EnergyTrainer(factory, X, y, seed=i) for i, (X, y) in enumerate(data.clients)]
        options = {"classes": 4, "inputs": 2, "per_class": 5, "local_iterations": 2, "batch_size": 32,
                   "example_cap": 60}
        return scenarios.Scenario(devices, get_params(factory()), lambda m: (0.0, None), dict), options
    dataset = {"agnostic_fedavg": "toy-regression", "feddar_wa": "domain-linear", "feddar_sa": "domain-linear",
               "lg_fedavg": "pathological-digits", "superfed": "pathological-digits"}.get(algorithm, "digits")
    scenario = scenarios.build(
        dataset, scenarios.ScenarioArgs(clients=clients, samples=30, algorithm=algorithm, domains=2))
    options = {} if "feddar" in algorithm else {"local_epochs": 1}
    if algorithm.startswith("aaggff"):
        options.update(weight_clip=1.0, **({"solver": "separable"} if algorithm == "aaggff_s" else {}))
    # Under DP a bound is also the noise's scale (z times it): the jobs below set their caps and
    # clips near what these devices hold, as a DP job must.
    if algorithm.startswith("feddar"):
        options.update(max_examples=100, example_cap=30, encoder_lr=0.05)
    if algorithm == "feddar_sa":  # Hessian-weighted heads are bounded by size * hessian_clip * head_clip
        options.update(hessian_clip=2.0, head_clip=2.0)
    if algorithm == "agnostic_fedavg":
        options.update(count_clip=100, loss_clip=5000.0)
    return scenario, scenario.options(algorithm, options)


# A large epsilon: 8 devices carry little signal under DP (the noisy total weights of AAggFF and
# FedDAR's encoder step go negative at epsilon 50, which their server halves refuse); this checks
# the mechanics and the accounting, not accuracy.
TARGET = 2000.0


@pytest.mark.parametrize("algorithm", sorted(JOBS))
def test_an_in_process_dp_run_completes_with_its_epsilon_recorded(algorithm):
    clients, rounds = 8, 2
    scenario, options = scenario_for(algorithm, clients)
    server, client = algorithms.make(algorithm, options)
    clip = 40.0 if algorithm == "fedevg" else 4.0  # FedEvg's energy gradients are O(10) per sample
    one_sum = calibrate(TARGET, 1e-5, rounds)  # what the spec resolves; init recalibrates for k sums
    settings_ = PrivacySettings("distributed", clip, one_sum, 1e-5, cohort_size=clients, min_survivors=clients - 1,
                                dropout_rate=0.1, target_epsilon=TARGET, rounds=rounds)
    private = PrivateServer(server, algorithm, settings_)
    ring = RingSum(private, dropout=0.1)
    state, logs = run_rounds(private, PrivateClient(client), scenario.devices, scenario.initial, rounds, clients, ring)
    sums = len(private.steps(state))
    assert len(logs) == rounds and len(private.ledger.rounds) == rounds * sums
    assert private.settings.sums_per_round == sums
    # Calibrated for every sum the job releases: within the target, with noise in every sum.
    assert 0 < private.ledger.epsilon <= TARGET * 1.05
    for name, value in server.model(state).items():
        assert np.all(np.isfinite(value)), name


def payload_from(draw, step: StepSpec) -> dict[str, np.ndarray]:
    """Any payload the step's schema admits, at up to 100x the codec's per-value clip."""
    out = {}
    for f in step.schema.fields:
        scale = draw(st.floats(0.0, 100.0)) * f.clip
        values = np.asarray(draw(st.lists(st.floats(-1.0, 1.0), min_size=f.size, max_size=f.size)))
        out[f.name] = (values * scale).reshape(f.shape)
    return out


def small_steps() -> list[tuple[str, StepSpec, Any]]:
    """Every accepted algorithm's steps on a tiny model (one state each)."""
    from tally.coordinator.spec import catalogue

    out = []
    for algorithm in sorted(JOBS):
        spec = parse(job(algorithm))
        server = catalogue.make_server(algorithm, spec.options)
        for step in server.steps(server.init(catalogue.initial_model(spec.model))):
            out.append((algorithm, step, server))
    return out


STEPS = small_steps()


@settings(max_examples=60, deadline=None)
@given(data=st.data(), index=st.integers(0, len(STEPS) - 1), clip=st.floats(0.05, 20.0))
def test_no_clipped_payload_exceeds_the_declared_sensitivity(data, index, clip):
    """Central mechanism: what a device sends moves the sum by at most C in units of the joint
    clip, so each field by at most its declared bound (C for clipped, its L2 bound for bounded)."""
    algorithm, step, server = STEPS[index]
    private = PrivateServer(server, algorithm, PrivacySettings("central", clip, 1.0, 1e-5, cohort_size=20))
    fields = private.prepare(step).layout
    public = private._public(step.name)
    values = payload_from(data.draw, step)
    for f in fields.counted:
        values[f.name] = np.ones(f.shape)
    sent = privatise(values, public)
    units = dict(zip((f.name for f in fields.clipped), fields.units(clip), strict=True))
    assert set(sent) == set(units)  # withheld fields never leave the device
    normalised = np.concatenate([np.ravel(sent[n]) / u for n, u in units.items()])
    assert np.linalg.norm(normalised) <= clip * (1 + 1e-9)
    for f, bound in zip(fields.clipped, fields.bounds, strict=True):
        assert np.linalg.norm(sent[f.name]) <= (clip if bound is None else bound) * (1 + 1e-9)
    assert public[PARAMS][1] == clip and all(FIELD_PREFIX + n in public for n in units)

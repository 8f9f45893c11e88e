"""Federated evaluation in process (tally/evaluation): the figures a round's metric sums give equal
what each device's own numbers say, a device never trains on what it reports, out-of-bounds values
are clipped and counted, a metric a device cannot compute is refused by name, and under DP the
metric fields are released with the update (noised, accounted)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tally import algorithms, models
from tally.codec import Kind
from tally.datasets.digits import digits
from tally.evaluation import (
    CustomMetric,
    EvaluatedClient,
    EvaluatedServer,
    EvaluationError,
    EvaluationPlan,
    worst_decile,
)
from tally.evaluation.plan import PLAN, PREFIX
from tally.models.params import get_params
from tally.privacy.accounting import epsilon_of
from tally.privacy.payload import FIELD_PREFIX, PrivateClient
from tally.privacy.server import PrivacySettings, PrivateServer
from tally.privacy.simulation import RingSum
from tally.sim.rounds import plain_sum, run_rounds
from tally.training import TorchTrainer, single_threaded

N = 8


def _factory():
    return models.build("mlp", 64, 10, 16, 0)


def _devices(cls=TorchTrainer) -> list:
    single_threaded()
    return [cls(_factory, x, y, seed=i) for i, (x, y) in enumerate(digits(N, seed=3).clients)]


def _run(plan: EvaluationPlan, devices: list, rounds: int = 2, algorithm: str = "fedavg", settings=None,
         evaluate: bool = True):
    """``settings``: DP around the evaluated halves (the coordinator's and the device's order)."""
    # Under DP, FedAvg's weight is counted (example_cap 1): a noised weight could sum to zero.
    options = {"local_epochs": 1, **({"example_cap": 1} if settings is not None else {})}
    server, client = algorithms.make(algorithm, options)
    evaluated = EvaluatedServer(server, plan)
    outer, device_half, sum_fn = (evaluated if evaluate else server), EvaluatedClient(client), plain_sum
    if settings is not None:
        outer, device_half = PrivateServer(outer, algorithm, settings), PrivateClient(device_half, 0.0, N)
        sum_fn = RingSum(outer)
    figures: list[dict[str, float]] = []
    state, _ = run_rounds(outer, device_half, devices, get_params(_factory()), rounds, N, sum_fn,
                          on_round=lambda log: figures.append(dict(evaluated.round_quality)))
    return outer, state, figures


def test_each_figure_is_the_example_weighted_mean_of_the_devices_own_numbers():
    """Oracle: each device's held-out view evaluated directly, before any training."""
    plan = EvaluationPlan(holdout=0.25)
    devices = _devices()
    initial = get_params(_factory())
    own = []
    for d in devices:
        _, held = d.held_out(plan.holdout, plan.seed)
        loss, accuracy = held.evaluate(initial)
        own.append((min(held.num_examples, plan.example_cap) / plan.example_cap, loss, accuracy))
    _, _, figures = _run(plan, _devices(), rounds=1)
    first = figures[0]
    w = np.array([o[0] for o in own])
    assert first["eval.devices"] == N
    assert abs(first["eval.loss"] - np.dot(w, [o[1] for o in own]) / w.sum()) < 1e-9
    assert abs(first["eval.accuracy"] - np.dot(w, [o[2] for o in own]) / w.sum()) < 1e-9
    # The histogram's counts are the devices' own buckets.
    buckets = np.bincount([min(int(o[2] * plan.bins), plan.bins - 1) for o in own], minlength=plan.bins)
    assert [first[f"eval.accuracy_hist.{i:02d}"] for i in range(plan.bins)] == buckets.tolist()


def test_a_device_never_trains_on_its_held_out_examples():
    device = _devices()[0]
    train, held = device.held_out(0.3, seed=7)
    rows = lambda t: {tuple(r) for r in t.features.numpy().round(6)}  # noqa: E731
    assert train.num_examples + held.num_examples == device.num_examples and held.num_examples > 0
    assert not rows(train) & rows(held)
    again_train, _ = device.held_out(0.3, seed=7)  # the same split every round
    assert rows(again_train) == rows(train)
    seen: list[int] = []

    class Counting(TorchTrainer):
        def train(self, params, epochs, lr, batch_size):
            seen.append(self.num_examples)
            return super().train(params, epochs, lr, batch_size)

    devices = _devices(Counting)
    _run(EvaluationPlan(holdout=0.3), devices, rounds=2)
    assert seen and all(n < max(d.num_examples for d in devices) for n in seen)
    assert sorted(set(seen)) == sorted({d.held_out(0.3, 0)[0].num_examples for d in devices})


@given(st.lists(st.integers(0, 50), min_size=2, max_size=20))
def test_the_worst_decile_estimate_is_within_one_bin_of_the_truth(counts):
    """Devices anywhere in their bins: the estimate is within a bin width of their true worst decile."""
    if sum(counts) == 0:
        assert np.isnan(worst_decile(np.array(counts)))
        return
    bins = len(counts)
    lows = np.repeat(np.arange(bins) / bins, counts)
    for values in (lows, lows + 1.0 / bins):  # every device at its bin's bottom, then its top
        k = len(values) / 10
        ordered = np.sort(values)
        whole = int(np.floor(k))
        truth = (ordered[:whole].sum() + (k - whole) * (ordered[whole] if whole < len(ordered) else 0)) / k
        assert abs(worst_decile(np.array(counts)) - truth) <= 1.0 / bins + 1e-9


class Reporting(TorchTrainer):
    """A trainer with metrics of its own (``LocalTrainer.metrics``)."""

    def metrics(self, params):
        loss, accuracy = self.evaluate(params)
        return {"confidence": 5.0 + accuracy, "wrong": round((1 - accuracy) * self.num_examples)}


def test_custom_metrics_are_summed_and_a_value_out_of_bounds_is_clipped_and_counted():
    plan = EvaluationPlan(custom=(CustomMetric("confidence", "mean", 0.0, 1.0),
                                  CustomMetric("wrong", "count", 0.0, 10_000.0)))
    devices = _devices(Reporting)
    wrong = [round((1 - d.held_out(plan.holdout, 0)[1].evaluate(get_params(_factory()))[1])
                   * d.held_out(plan.holdout, 0)[1].num_examples) for d in devices]
    _, _, figures = _run(plan, devices, rounds=1)
    assert figures[0]["custom.confidence"] == pytest.approx(1.0)  # every 5.x clipped to the bound 1
    assert figures[0]["eval.clipped"] >= N  # ... and counted, once per device at least
    assert figures[0]["custom.wrong"] == sum(wrong)


def test_a_metric_the_device_cannot_compute_is_refused_by_name():
    plan = EvaluationPlan(custom=(CustomMetric("f1"),))
    with pytest.raises(EvaluationError, match="f1"):
        _run(plan, _devices(), rounds=1)
    with pytest.raises(EvaluationError, match="domain"):
        _run(EvaluationPlan(metrics=("loss", "domain"), domains=2), _devices(), rounds=1)


def test_a_personalised_algorithm_reports_the_personal_model_beside_the_global_one():
    from tally.datasets.personal import pathological_digits
    from tally.training.personal import MixingTrainer

    single_threaded()
    data = pathological_digits(N, 2, seed=0)
    devices = [MixingTrainer(_factory, *d.train, seed=i) for i, d in enumerate(data.devices)]
    plan = EvaluationPlan(metrics=("accuracy", "personal_accuracy"), holdout=0.2)
    server, client = algorithms.make("lg_fedavg", {"warmup_rounds": 1, "local_epochs": 2, "local_lr": 0.05})
    evaluated = EvaluatedServer(server, plan)
    figures: list[dict[str, float]] = []
    run_rounds(evaluated, EvaluatedClient(client), devices, get_params(_factory()), 4, N, plain_sum,
               on_round=lambda log: figures.append(dict(evaluated.round_quality)))
    last = figures[-1]
    # Each device's personal layers fit its two classes; the shared model alone does not.
    assert last["personal.accuracy"] > last["eval.accuracy"] + 0.2


def test_under_dp_the_metric_fields_are_clipped_and_noised_with_the_update_and_cost_no_extra_release():
    plan = EvaluationPlan(device_weighted=True)  # as a private job's plan is: exact denominators
    settings = PrivacySettings("central", clip=1.0, noise_multiplier=1.0, delta=1e-5, cohort_size=N)
    server, state, figures = _run(plan, _devices(), rounds=2, settings=settings)
    broadcast = server.broadcast(state, "update")
    released = {k[len(FIELD_PREFIX):] for k in broadcast if k.startswith(FIELD_PREFIX)}
    assert {"metric.loss", "metric.accuracy", "metric.accuracy_histogram"} <= released
    assert PLAN in broadcast
    roles = EvaluatedServer(algorithms.make("fedavg", {})[0], plan).privacy_roles()
    assert roles[PREFIX + "devices"] == roles[PREFIX + "weight"] == "counted"
    assert roles[PREFIX + "examples"] == "withheld"
    assert len(figures) == 2 and all("eval.loss" in f and "eval.examples" not in f for f in figures)
    # Noised: the histogram's counts are no longer whole numbers of devices.
    assert any(not float(figures[0][f"eval.accuracy_hist.{i:02d}"]).is_integer() for i in range(plan.bins))
    # The metrics ride in the update's release: one event per round, the epsilon of the same job
    # without them, as the accountant computes it for two releases at this noise.
    without, _, _ = _run(plan, _devices(), rounds=2, settings=settings, evaluate=False)
    assert server.ledger.epsilon == pytest.approx(without.ledger.epsilon)
    assert server.ledger.epsilon == pytest.approx(epsilon_of(1.0, 2, 1e-5))


def test_metrics_never_widen_the_ring_of_a_sum():
    server, _ = algorithms.make("fedavg", {})
    state = server.init(get_params(_factory()))
    schema = server.steps(state)[0].schema
    extended = EvaluationPlan(custom=(CustomMetric("big", "count", 0, 1000.0),)).extend(schema)
    assert extended.required_bits(1000) == schema.required_bits(1000)
    metric_fields = [f for f in extended.fields if f.name.startswith(PREFIX)]
    assert all(f.kind is Kind.COUNT or f.frac_bits >= 8 for f in metric_fields)


def test_a_job_evaluates_by_default_and_enabled_false_turns_it_off():
    from tally.coordinator.spec.evaluation_spec import plan_for
    from tally.coordinator.spec.jobspec import parse

    base = "name: e\nalgorithm: lg_fedavg\nrounds: 1\ncohort_size: 10\n"
    plan = plan_for(parse(base))
    assert plan is not None and "personal_accuracy" in plan.metrics  # a personalised algorithm's default
    assert plan_for(parse(base + "evaluation: null\n")) == plan  # null is the default, as for every section
    assert plan_for(parse(base + "evaluation: {enabled: false}\n")) is None


def _evaluate_only(outer, evaluated: EvaluatedServer, device_half, devices: list, state, sum_fn=plain_sum):
    """One round that only evaluates, as the coordinator runs it: its one step, summed."""
    evaluated.evaluate_round(True, only=True)
    [step] = outer.steps(state)
    broadcast = outer.broadcast(state, step.name)
    inputs = {d: device_half.contribute(step.name, broadcast, device, None)[0] for d, device in enumerate(devices)}
    total, _ = sum_fn(99, step, inputs)
    return outer.apply(state, step.name, total), dict(evaluated.round_quality), step


def test_a_round_that_only_evaluates_scores_the_model_it_is_given_and_trains_nothing():
    plan = EvaluationPlan(holdout=0.25)
    trained: list[int] = []

    class Counting(TorchTrainer):
        def train(self, params, epochs, lr, batch_size):
            trained.append(1)
            return super().train(params, epochs, lr, batch_size)

    server, client = algorithms.make("fedavg", {"local_epochs": 1})
    evaluated = EvaluatedServer(server, plan)
    devices = _devices(Counting)
    state, _ = run_rounds(evaluated, EvaluatedClient(client), devices, get_params(_factory()), 1, N, plain_sum)
    model = evaluated.model(state)
    trained.clear()
    after, figures, step = _evaluate_only(evaluated, evaluated, EvaluatedClient(client), devices, state)
    assert not trained  # no device trained
    assert after is state  # the algorithm's state is left as it was
    assert {f.name for f in step.schema.fields} == {f.name for f in plan.evaluation_only().fields()}
    assert PREFIX + "train_loss" not in {f.name for f in step.schema.fields} and "train.loss" not in figures
    # Oracle: each device's held-out view scoring the model directly.
    own = []
    for d in devices:
        _, held = d.held_out(plan.holdout, plan.seed)
        loss, accuracy = held.evaluate(model)
        own.append((min(held.num_examples, plan.example_cap) / plan.example_cap, loss, accuracy))
    w = np.array([o[0] for o in own])
    assert figures["eval.devices"] == N
    assert abs(figures["eval.loss"] - np.dot(w, [o[1] for o in own]) / w.sum()) < 1e-9
    assert abs(figures["eval.accuracy"] - np.dot(w, [o[2] for o in own]) / w.sum()) < 1e-9


def test_under_dp_a_round_that_only_evaluates_is_one_more_release_of_the_metrics_alone():
    plan = EvaluationPlan(device_weighted=True)
    settings = PrivacySettings("central", clip=1.0, noise_multiplier=1.0, delta=1e-5, cohort_size=N)
    outer, state, _ = _run(plan, _devices(), rounds=2, settings=settings)
    evaluated = outer.inner
    device_half = PrivateClient(EvaluatedClient(algorithms.make("fedavg", {"example_cap": 1})[1]), 0.0, N)
    sum_fn = RingSum(outer)
    outer.evaluate_round(True, only=True)  # reaches the evaluation through DP's wrapper
    [step] = outer.steps(state)
    broadcast = outer.broadcast(state, step.name)
    assert {k[len(FIELD_PREFIX):] for k in broadcast if k.startswith(FIELD_PREFIX)} >= {"metric.loss",
                                                                                        "metric.accuracy"}
    inputs = {d: device_half.contribute(step.name, broadcast, device, None)[0] for d, device in enumerate(_devices())}
    total, _ = sum_fn(2, step, inputs)  # accounted as it is decoded
    assert outer.apply(state, step.name, total) is state
    assert "eval.loss" in evaluated.round_quality and "eval.examples" not in evaluated.round_quality
    # Two training releases and this one, as the accountant computes three at this noise.
    assert outer.ledger.epsilon == pytest.approx(epsilon_of(1.0, 3, 1e-5))

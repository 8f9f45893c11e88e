"""FedEvg (issue 13): the spec's oracles (docs/specs/fedevg.md §8), the 2-D toy with the secure sum,
the exact-weight variant's instability, the exported synthetic set, and the real services."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from support.devices import FEDEVG_TOY, fedevg_toy_devices
from tally.algorithms import fedevg
from tally.algorithms.fedevg import (
    SYNTHETIC_X,
    SYNTHETIC_Y,
    FedEvgClient,
    FedEvgOptions,
    FedEvgServer,
    mixture_gradient,
    sample_weights,
    step_size,
)
from tally.datasets.energy_toy import four_blobs, in_own_region
from tally.models.energy import energy_mlp
from tally.models.params import get_params
from tally.secagg import ThreatModel
from tally.sim.rounds import SecureSum, plain_sum, run_rounds
from tally.training import single_threaded
from tally.training.energy import EnergyTrainer, export_synthetic, pcd_loss, synthetic_classifier_accuracy

# The spec's 1-D example: E_1 = (x+2)^2/2, E_2 = (x-2)^2/2, w = (1/2, 1/2), at x = 0.5.
W = np.array([0.5, 0.5])


def _energies(x: float) -> np.ndarray:
    return np.array([0.5 * (x + 2) ** 2, 0.5 * (x - 2) ** 2])


def _gradients(x: float) -> np.ndarray:
    return np.array([x + 2, x - 2])


def _mixture_energy(x: float) -> float:
    return -math.log(float(np.sum(W * np.exp(-_energies(x)))))


def _server_gradient(x: float, s: np.ndarray, w: np.ndarray = W) -> float:
    """G from the two sums the secure sum delivers: sum w s g and sum w s."""
    numerator = np.array([np.sum(w * s * _gradients(x))])
    return float(mixture_gradient(numerator, np.array([np.sum(w * s)]))[0, 0])


def test_oracle_1_exact_weights_give_the_mixture_energys_gradient():
    exact = _server_gradient(0.5, np.exp(-_energies(0.5)))
    h = 1e-6
    finite = (_mixture_energy(0.5 + h) - _mixture_energy(0.5 - h)) / (2 * h)
    assert exact == pytest.approx(-1.023188, abs=1e-6) and exact == pytest.approx(finite, abs=1e-6)


def test_oracles_2_to_4_single_client_scale_invariance_and_the_sign_tricks_convex_combination():
    single = mixture_gradient(np.array([0.3 * 2.7 * 2.5]), np.array([0.3 * 2.7]))  # K = 1: G = g_1
    assert single[0, 0] == pytest.approx(2.5)
    s = np.exp(-_energies(0.5))
    assert _server_gradient(0.5, 7 * s, 3 * W) == pytest.approx(_server_gradient(0.5, s))
    signed = sample_weights(-_energies(0.5), FedEvgOptions())  # both logits negative: signs agree
    assert set(signed) == {math.exp(-1)}
    assert _server_gradient(0.5, signed) == pytest.approx(float(np.sum(W * _gradients(0.5))))  # +0.5
    mixed = sample_weights(np.array([2.0, -3.0]), FedEvgOptions())
    g = _server_gradient(0.5, mixed)
    assert min(_gradients(0.5)) <= g <= max(_gradients(0.5))
    assert g == pytest.approx((math.e * 2.5 + math.exp(-1) * -1.5) / (math.e + math.exp(-1)))


def test_oracle_5_a_server_step_lowers_the_mixture_energy():
    g = _server_gradient(0.5, np.exp(-_energies(0.5)))
    assert _mixture_energy(0.5) == pytest.approx(1.691219, abs=1e-6)
    assert _mixture_energy(0.5 - 0.1 * g) == pytest.approx(1.583836, abs=1e-6)
    assert _mixture_energy(0.5 - 0.5 * g) == pytest.approx(1.164286, abs=1e-6)


def _toy_trainer(seed: int = 0) -> tuple[EnergyTrainer, FedEvgOptions]:
    single_threaded()
    data = four_blobs(clients=2, alpha=1.0, samples=400, seed=seed)
    options = FedEvgOptions(classes=4, inputs=2, per_class=5, sgld_step=0.05, sgld_noise=0.0, local_iterations=5)
    return EnergyTrainer(lambda: energy_mlp(2, 4, 16, seed), *data.clients[0], seed=seed), options


def test_oracles_6_and_7_client_sgld_and_the_pcd_term_move_the_right_way():
    trainer, options = _toy_trainer()
    x = torch.randn(8, 2).to(trainer.device)
    y = (torch.arange(8) % 4).to(trainer.device)
    before = trainer._at_label(x, y).detach()
    after = trainer._at_label(trainer.sgld(x, y, options), y).detach()
    assert torch.all(after > before)  # one step up f(x)[y] (down the energy) raises the logit
    real_x, real_y, fake_x, fake_y = x[:4], y[:4], x[4:], y[4:]
    model = trainer.model
    real0, fake0 = (model(v).gather(1, w[:, None]).mean().item() for v, w in ((real_x, real_y), (fake_x, fake_y)))
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-2)
    optimiser.zero_grad()
    pcd_loss(model, real_x, real_y, fake_x, fake_y).backward()
    optimiser.step()
    real1, fake1 = (model(v).gather(1, w[:, None]).mean().item() for v, w in ((real_x, real_y), (fake_x, fake_y)))
    assert real1 > real0 and fake1 < fake0


class _MovingBuffer:
    """A device whose local training moves the synthetic points it was handed (its PCD chains)."""

    num_examples = 10

    def __init__(self) -> None:
        self.signals_at: np.ndarray | None = None

    def train_energy(self, params, synthetic_x, synthetic_y, options):
        synthetic_x += 100.0
        return dict(params)

    def energy_signals(self, params, x, y):
        self.signals_at = x.copy()
        return np.ones(len(x)), np.ones_like(x)


def test_oracles_8_9_11_uploads_at_the_downloaded_set_balanced_initialisation_and_the_payload():
    options = FedEvgOptions(classes=3, inputs=4, per_class=5)
    server = FedEvgServer(options)
    state = server.init({"w": np.zeros(2)})
    x, y = state.synthetic[SYNTHETIC_X], state.synthetic[SYNTHETIC_Y]
    assert x.shape == (15, 4) and np.bincount(y).tolist() == [5, 5, 5]  # M = L * spc, spc per class
    assert abs(x.mean()) < 0.5 and 0.6 < x.std() < 1.4  # N(0, I)
    device = _MovingBuffer()
    values, _ = FedEvgClient(options).contribute(fedevg.STEP, server.broadcast(state, fedevg.STEP), device, None)
    np.testing.assert_array_equal(device.signals_at, x)  # not the buffer the device moved
    (step,) = server.steps(state)
    assert step.schema.dim == 15 * (4 + 1) == sum(np.size(v) for v in values.values())
    assert set(values) == {"weighted_gradient", "weight"}  # no parameter of any model
    np.testing.assert_allclose(values["weight"], 0.01 * math.e)  # n_i s_ij: 10 of 1,000 examples, f > 0


def test_oracle_10_the_step_size_anneals_from_start_to_end():
    options = FedEvgOptions(schedule_rounds=500)
    steps = [step_size(options, t) for t in range(500)]
    assert steps[0] == pytest.approx(10.0) and steps[-1] == pytest.approx(0.01)
    assert all(a >= b for a, b in zip(steps, steps[1:]))
    assert step_size(options, 900) == pytest.approx(0.01)  # past the schedule: its end value


def test_exact_weights_overflow_without_the_public_clamp_and_are_bounded_with_it():
    """The thesis' instability: exp(f) of a confident device's logit is unbounded, so the sums
    overflow (inf / inf) and the Langevin step turns the synthetic set to NaN. A public clamp keeps
    every weight in [e^-c, e^c], which also bounds the secure sum's fixed-point range."""
    logits = np.array([900.0, 1.0])  # one confident device
    with np.errstate(over="ignore", invalid="ignore"):
        raw = np.exp(logits)  # what exp(f) without a clamp gives
        unclamped = mixture_gradient(np.array([np.sum(raw * _gradients(0.5))]), np.array([np.sum(raw)]))
    assert np.isnan(unclamped).all()
    options = FedEvgOptions(weighting="exact", logit_clamp=5.0)
    clamped = sample_weights(logits, options)
    assert clamped.max() == pytest.approx(math.exp(5.0)) and options.max_weight == pytest.approx(math.exp(5.0))
    assert np.isfinite(_server_gradient(0.5, clamped))
    with pytest.raises(ValueError, match="weighting must be one of"):
        FedEvgOptions(weighting="raw")


@pytest.mark.full
def test_the_toys_synthetic_points_move_into_their_class_regions_through_the_secure_sum():
    """Spec §6 / oracle 12 with the real secure-sum protocol (masking, fixed point): ten devices
    with Dirichlet(0.1) labels (none holds every class), 150 rounds. Points start in their own
    class's quadrant 25 % of the time; they end in it > 90 %, and a classifier trained on the 100
    synthetic points alone scores >= 90 % on real held-out data."""
    rounds = 150
    data, factory, devices = fedevg_toy_devices(seed=0)
    options = FedEvgOptions(**FEDEVG_TOY, schedule_rounds=rounds)
    start = fedevg.initial_synthetic(options)
    assert in_own_region(start[SYNTHETIC_X], start[SYNTHETIC_Y]).mean() < 0.4
    state, _ = run_rounds(FedEvgServer(options), FedEvgClient(options), devices, get_params(factory()), rounds, 10,
                          SecureSum(ThreatModel(dropout_rate=0.1, corrupt_rate=0.05)))
    synthetic = state.synthetic
    assert in_own_region(synthetic[SYNTHETIC_X], synthetic[SYNTHETIC_Y]).mean() > 0.9
    assert synthetic_classifier_accuracy(synthetic, *data.test) >= 0.9


def test_the_synthetic_set_exports_as_numpy_and_an_image_grid(tmp_path):
    options = FedEvgOptions(classes=10, inputs=64, per_class=3)
    synthetic = fedevg.initial_synthetic(options)
    npz, png = export_synthetic(synthetic, tmp_path / "out", image_side=8)
    loaded = np.load(npz)
    np.testing.assert_array_equal(loaded["x"], synthetic[SYNTHETIC_X])
    np.testing.assert_array_equal(loaded["y"], synthetic[SYNTHETIC_Y])
    assert png.read_bytes().startswith(b"\x89PNG")


def test_a_short_toy_run_is_the_same_through_plain_and_secure_sums():
    """The secure sum changes only fixed-point rounding: 3 rounds, the two synthetic sets agree to
    the codec's resolution."""
    options = FedEvgOptions(**{**FEDEVG_TOY, "local_iterations": 5}, schedule_rounds=3)
    results = []
    for sum_fn in (plain_sum, SecureSum(ThreatModel(dropout_rate=0.1, corrupt_rate=0.05))):
        _, factory, devices = fedevg_toy_devices(seed=1)
        state, _ = run_rounds(FedEvgServer(options), FedEvgClient(options), devices, get_params(factory()), 3, 10,
                              sum_fn)
        results.append(state.synthetic[SYNTHETIC_X])
    assert np.max(np.abs(results[0] - results[1])) < 1e-3

"""Simulated devices (trainers) that both an algorithm's own tests and its end-to-end test run, so
that the in-process reference and the run through the services train the very same devices."""

from __future__ import annotations

import numpy as np

from tally.datasets.energy_toy import four_blobs
from tally.models.energy import energy_mlp
from tally.training import single_threaded
from tally.training.energy import EnergyTrainer


class QuadraticDevice:
    """Loss ½‖w - target‖² + bias; training is ``epochs`` gradient steps of size lr (a contractive
    toy whose every step is checkable by hand)."""

    def __init__(self, target, bias: float = 0.0, examples: int = 1) -> None:
        self.target, self.bias, self.examples = np.asarray(target, float), bias, examples

    @property
    def num_examples(self) -> int:
        return self.examples

    def loss(self, w) -> float:
        return 0.5 * float(np.sum((np.asarray(w, float) - self.target) ** 2)) + self.bias

    def evaluate(self, params):
        return self.loss(params["w"]), 0.0

    def train(self, params, epochs, lr, batch_size):
        w = np.asarray(params["w"], float).copy()
        for _ in range(epochs):
            w -= lr * (w - self.target)
        return {"w": w}, self.loss(w)


def quadratic_fleet(k: int, dim: int = 3, seed: int = 0) -> list[QuadraticDevice]:
    """``k`` quadratic devices with random targets, biases and example counts (AAggFF's tests)."""
    rng = np.random.default_rng(seed)
    return [QuadraticDevice(rng.normal(size=dim), float(rng.uniform(0, 0.5)), int(rng.integers(5, 50)))
            for _ in range(k)]


# FedEvg's spec §6 toy: four 2-D Gaussian classes, the options its oracles were measured with.
FEDEVG_TOY = dict(classes=4, inputs=2, per_class=25, step_start=0.05, step_end=0.001, noise=0.01,
                  local_iterations=20, local_lr=1e-3, batch_size=64, sgld_step=0.05, sgld_noise=0.01)


def fedevg_toy_devices(seed: int):
    """Ten energy trainers on Dirichlet(0.1) splits of the toy: the data, the model factory, the
    trainers."""
    single_threaded()
    data = four_blobs(clients=10, alpha=0.1, seed=seed)
    factory = lambda: energy_mlp(2, 4, 64, seed)  # noqa: E731
    return data, factory, [EnergyTrainer(factory, X, y, seed=100 * seed + i) for i, (X, y) in enumerate(data.clients)]

"""A heterogeneous classification task where fairness across devices matters (``heterogeneous-digits``).

scikit-learn's digits split by Dirichlet label skew (``alpha``, ``tally.datasets.digits``); the
Dirichlet split already makes device sizes unequal, and ``size_sigma`` adds log-normal size skew on
top. A minority of the devices (``minority``, 10 % by default) sees every image turned a quarter turn
and holds less data (``minority_share``): an under-represented group, as in the fairness literature.
Example-weighted FedAvg fits the majority's view and leaves those devices far behind; AAggFF's
loss-driven mixing coefficients lift them.

Each device's accuracy is measured on its own test distribution: ``holdout_size`` images from the
pooled test pool (images no device trains on), drawn with the device's label frequencies and seen
through its view. This stands in for the paper's per-client 80/20 split (``specs/aaggff.md`` §6.1),
whose held-out parts would hold a handful of images per device here and make the worst-10 % figure
mostly noise. The fairness summaries (worst 10 %, Gini, parity gap) are over these accuracies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tally.algorithms.base import Arrays
from tally.datasets.digits import digits
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.training import TorchTrainer

SIDE = 8
Split = tuple[np.ndarray, np.ndarray]


@dataclass
class HeterogeneousData:
    train: list[Split]  # per device: what the algorithm trains on
    holdout: list[Split]  # per device: its own test distribution, for that device's accuracy
    test: Split  # pooled test set (the unrotated view) of images no device trains on
    num_features: int
    num_classes: int
    rotated: np.ndarray  # per device: whether it is in the rotated minority


def heterogeneous_digits(
    clients: int = 30,
    alpha: float = 0.5,
    minority: float = 0.1,
    minority_share: float = 0.3,
    size_sigma: float = 0.0,
    holdout_size: int = 50,
    seed: int = 0,
) -> HeterogeneousData:
    """Digits with Dir(``alpha``) label skew, a rotated minority and optional log-normal size skew.

    A ``minority`` fraction of the devices sees every image turned a quarter turn (a view the others
    never see) and keeps only ``minority_share`` of its examples; every device also keeps the share
    exp(σz - max_j σz_j), z standard normal, σ = ``size_sigma`` (0: no extra size skew). A device
    keeps at least 2 examples. Its held-out set has ``holdout_size`` images from the pooled test pool
    drawn with its own label frequencies and seen through its own view.
    """
    if not 0 <= minority < 1 or not 0 < minority_share <= 1:
        raise ValueError("minority must lie in [0, 1) and minority_share in (0, 1]")
    if size_sigma < 0 or holdout_size < 1:
        raise ValueError("size_sigma must be >= 0 and holdout_size >= 1")
    fed = digits(clients, alpha=alpha, seed=seed)
    rng = np.random.default_rng([seed, 1])
    log_share = size_sigma * rng.standard_normal(clients)
    shares = np.exp(log_share - log_share.max())
    rotated = rng.permutation(clients) < int(round(minority * clients))
    test_x, test_y = fed.test
    train, holdout = [], []
    for (X, y), share, turn in zip(fed.clients, shares, rotated):
        keep = rng.permutation(len(y))[: max(2, int(round(share * (minority_share if turn else 1.0) * len(y))))]
        X, y = X[keep], y[keep]
        frequencies = np.bincount(y, minlength=fed.num_classes) / len(y)
        labels = rng.choice(fed.num_classes, size=holdout_size, p=frequencies)
        picks = np.array([rng.choice(np.flatnonzero(test_y == c)) for c in labels])
        held = test_x[picks]
        if turn:
            X, held = _rotate(X), _rotate(held)
        train.append((X, y))
        holdout.append((held, test_y[picks]))
    return HeterogeneousData(train, holdout, fed.test, fed.num_features, fed.num_classes, rotated)


def _rotate(images: np.ndarray) -> np.ndarray:
    """A quarter turn of flat 8x8 images."""
    return np.rot90(images.reshape(-1, SIDE, SIDE), axes=(1, 2)).reshape(len(images), -1).copy()


@dataclass
class HeterogeneousDevices:
    """Torch devices for a :class:`HeterogeneousData`: trainers, per-device judges and the pooled test."""

    devices: list[TorchTrainer]
    holdout: list[TorchTrainer]
    test: TorchTrainer
    initial: Arrays

    def per_device_accuracy(self, params: Arrays) -> np.ndarray:
        """Accuracy of ``params`` on each device's held-out examples (what fairness is measured on)."""
        return np.array([judge.evaluate(params)[1] for judge in self.holdout])


def heterogeneous_devices(task: HeterogeneousData, hidden: int = 32, seed: int = 0) -> HeterogeneousDevices:
    """One MLP per device, all starting from the same initial parameters."""

    def factory():
        return mlp(task.num_features, task.num_classes, hidden=hidden, seed=seed)

    devices = [TorchTrainer(factory, X, y, seed=seed + i) for i, (X, y) in enumerate(task.train)]
    holdout = [TorchTrainer(factory, X, y) for X, y in task.holdout]
    return HeterogeneousDevices(devices, holdout, TorchTrainer(factory, *task.test), get_params(factory()))

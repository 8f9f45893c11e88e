"""scikit-learn's digits split over devices by Dirichlet label skew, and the ``FederatedData`` and the
split that the other datasets share: everything ships with the packages, nothing is downloaded at
run time."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits


@dataclass
class FederatedData:
    clients: list[tuple[np.ndarray, np.ndarray]]  # (features, labels) per device
    test: tuple[np.ndarray, np.ndarray]
    num_features: int
    num_classes: int


def dirichlet_label_split(
    labels: np.ndarray, clients: int, alpha: float, rng: np.random.Generator, min_size: int = 5
) -> list[np.ndarray]:
    """Index sets with per-class shares drawn from Dir(alpha): small alpha, strong label skew.

    Redrawn until every device has ``min_size`` examples, so no device is empty.
    """
    classes = np.unique(labels)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(clients)]
        for c in classes:
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for part, chunk in zip(parts, np.split(idx, cuts)):
                part.extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.array(sorted(p)) for p in parts]
    raise ValueError(f"cannot give {clients} devices {min_size} examples each; lower the client count")


def digits(clients: int, alpha: float = 0.5, seed: int = 0, test_fraction: float = 0.2) -> FederatedData:
    """scikit-learn's 8x8 digits, split non-IID across devices by Dirichlet label skew."""
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    parts = dirichlet_label_split(y[train], clients, alpha, rng)
    return FederatedData(
        clients=[(X[train][p], y[train][p]) for p in parts],
        test=(X[test], y[test]),
        num_features=X.shape[1],
        num_classes=10,
    )

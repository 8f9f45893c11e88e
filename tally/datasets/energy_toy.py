"""FedEvg's 2-D toy (``docs/specs/fedevg.md`` §6): four classes as Gaussian blobs at (±1.5, ±1.5)
with std 0.25, split over devices by Dirichlet(alpha) label skew, so no single device holds every
class while the synthetic points must still find all four regions."""

from __future__ import annotations

import numpy as np

from tally.datasets.digits import FederatedData, dirichlet_label_split

CENTRES = np.array([[1.5, 1.5], [-1.5, 1.5], [-1.5, -1.5], [1.5, -1.5]])
SPREAD = 0.25


def four_blobs(clients: int = 10, alpha: float = 0.1, samples: int = 4000, seed: int = 0,
               test_fraction: float = 0.2) -> FederatedData:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, len(CENTRES), size=samples)
    X = (CENTRES[y] + SPREAD * rng.standard_normal((samples, 2))).astype(np.float32)
    n_test = int(samples * test_fraction)
    train_x, train_y = X[n_test:], y[n_test:]
    parts = dirichlet_label_split(train_y, clients, alpha, rng)
    return FederatedData(
        clients=[(train_x[p], train_y[p]) for p in parts],
        test=(X[:n_test], y[:n_test]),
        num_features=2,
        num_classes=len(CENTRES),
    )


def in_own_region(points: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Whether each point's nearest class centre is its own label's (the spec's 'right quadrant')."""
    nearest = np.argmin(((points[:, None, :] - CENTRES[None]) ** 2).sum(-1), axis=1)
    return nearest == np.asarray(labels)

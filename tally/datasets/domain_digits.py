"""A classification task with domains: scikit-learn's 8x8 digits seen through per-domain transforms.

Domain i rotates every image by (i mod 4) quarter turns, inverts it when (i div 4) is odd, and adds
Gaussian pixel noise of standard deviation ``noise``·i/(domains-1), so later domains are both
different and harder. Each domain also has its own label distribution, drawn from
Dir(``label_alpha``) (label shift), and its own prevalence, falling geometrically so that the most
common domain is ``imbalance`` times as common as the rarest: example-weighted FedAvg then
neglects the rare, noisy domains, which is what AgnosticFedAvg's worst-domain objective corrects.

Devices hold ``samples_per_client`` examples each. With ``partition="data"`` a device's domain
mixture is drawn from Dir(``alpha``·p·prevalence) (small alpha: each device mostly one domain; the
mixtures average to the prevalence); with ``partition="client"`` every device holds a single domain
drawn by prevalence. Base images are split into train and test pools first, so no test image is
ever seen in training under any transform; the test set has ``test_per_domain`` examples of every
domain, each drawn by that domain's label distribution. Every example carries its domain id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits

PARTITIONS = ("data", "client")
SIDE = 8


@dataclass
class DomainFederatedData:
    clients: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # (features, labels, domains) per device
    test: tuple[np.ndarray, np.ndarray, np.ndarray]
    num_features: int
    num_classes: int
    num_domains: int
    prevalence: np.ndarray
    label_distributions: np.ndarray  # (domains, classes)


def transform(images: np.ndarray, domain: int, domains: int, noise: float, rng: np.random.Generator) -> np.ndarray:
    """Domain ``domain``'s view of flat 8x8 images in [0, 1] (see the module docstring)."""
    square = np.rot90(images.reshape(-1, SIDE, SIDE), k=domain % 4, axes=(1, 2))
    if (domain // 4) % 2 == 1:
        square = 1.0 - square
    std = noise * domain / max(domains - 1, 1)
    out = square.reshape(len(images), SIDE * SIDE) + std * rng.standard_normal((len(images), SIDE * SIDE))
    return out.astype(np.float32)


def _draw(pool_x: np.ndarray, pool_y: np.ndarray, labels: np.ndarray, domain: int, domains: int,
          noise: float, rng: np.random.Generator) -> np.ndarray:
    """One transformed image per requested label, drawn with replacement from the pool."""
    picks = np.empty(len(labels), dtype=np.int64)
    for c in np.unique(labels):
        wanted = labels == c
        picks[wanted] = rng.choice(np.flatnonzero(pool_y == c), size=int(wanted.sum()))
    return transform(pool_x[picks], domain, domains, noise, rng)


def domain_digits(
    clients: int = 20,
    domains: int = 4,
    alpha: float = 0.5,
    samples_per_client: int = 100,
    noise: float = 0.3,
    seed: int = 0,
    partition: str = "data",
    imbalance: float = 4.0,
    label_alpha: float = 2.0,
    test_per_domain: int = 200,
    test_fraction: float = 0.2,
) -> DomainFederatedData:
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if clients < 1 or domains < 1 or samples_per_client < 1 or test_per_domain < 1:
        raise ValueError("clients, domains, samples_per_client and test_per_domain must be >= 1")
    if alpha <= 0 or label_alpha <= 0 or imbalance < 1 or noise < 0:
        raise ValueError("alpha and label_alpha must be > 0, imbalance >= 1, noise >= 0")
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    classes = int(y.max()) + 1
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test_idx, train_idx = order[:n_test], order[n_test:]
    prevalence = imbalance ** (-np.arange(domains) / max(domains - 1, 1))
    prevalence /= prevalence.sum()
    label_dists = rng.dirichlet(np.full(classes, label_alpha), size=domains)
    if partition == "data":
        mixtures = rng.dirichlet(alpha * domains * prevalence, size=clients)
    else:
        mixtures = np.eye(domains)[rng.choice(domains, size=clients, p=prevalence)]
    devices = []
    for k in range(clients):
        per_domain = rng.multinomial(samples_per_client, mixtures[k])
        xs, ys, ds = [], [], []
        for d, count in enumerate(per_domain):
            labels = rng.choice(classes, size=count, p=label_dists[d])
            xs.append(_draw(X[train_idx], y[train_idx], labels, d, domains, noise, rng))
            ys.append(labels)
            ds.append(np.full(count, d))
        devices.append((np.concatenate(xs), np.concatenate(ys).astype(np.int64), np.concatenate(ds).astype(np.int64)))
    test_x, test_y, test_d = [], [], []
    for d in range(domains):
        labels = rng.choice(classes, size=test_per_domain, p=label_dists[d])
        test_x.append(_draw(X[test_idx], y[test_idx], labels, d, domains, noise, rng))
        test_y.append(labels)
        test_d.append(np.full(test_per_domain, d))
    return DomainFederatedData(
        clients=devices,
        test=(np.concatenate(test_x), np.concatenate(test_y).astype(np.int64), np.concatenate(test_d).astype(np.int64)),
        num_features=SIDE * SIDE,
        num_classes=classes,
        num_domains=domains,
        prevalence=prevalence,
        label_distributions=label_dists,
    )

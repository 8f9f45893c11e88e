"""Data for personalisation: devices whose own distributions differ, each with its own train,
validation and test split (a personal model is judged on its device's test data, and anything a
device tunes, such as SuPerFed's mixing weight, is chosen on its validation split).

* ``pathological_digits``: scikit-learn's 8x8 digits, k classes per device (McMahan et al.'s
  pathological non-IID, dealt per class as in LG-FedAvg's code, spec lg-fedavg 8.2), optionally
  with rotated-digits domains (device i's images turned by 90° x (i mod domains)).
* ``gaussian_classes``: SuPerFed's synthetic toy (spec superfed 6): 10 Gaussian classes in 20-d,
  two classes per device.
* ``rotated_gaussian``: LG-FedAvg's toy network setting (spec lg-fedavg 11.D): softmax labels of
  one teacher, half the devices seeing their inputs through a private random rotation.
* ``linear_devices`` and ``alpha_sweep``: LG-FedAvg's synthetic regression (App. C.1, spec 11.C).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.datasets import load_digits

Split = tuple[np.ndarray, np.ndarray]


@dataclass
class PersonalDevice:
    train: Split
    validation: Split
    test: Split
    classes: tuple[int, ...]
    domain: int = 0


@dataclass
class PersonalData:
    devices: list[PersonalDevice]
    num_features: int
    num_classes: int


def split_device(X: np.ndarray, y: np.ndarray, rng: np.random.Generator, validation: float, test: float,
                 domain: int = 0) -> PersonalDevice:
    """One device's examples, shuffled, cut into train / validation / test."""
    order = rng.permutation(len(y))
    n_test, n_val = int(round(len(y) * test)), int(round(len(y) * validation))
    te, va, tr = order[:n_test], order[n_test:n_test + n_val], order[n_test + n_val:]
    return PersonalDevice((X[tr], y[tr]), (X[va], y[va]), (X[te], y[te]), tuple(sorted(set(y.tolist()))), domain)


def deal_classes(labels: np.ndarray, devices: int, per_device: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Index sets with ``per_device`` class shards each: every class is cut into equal shards and
    a shuffled list of shard labels is dealt ``per_device`` to a device ([C]'s ``noniid``); a device
    may draw one class twice, so it holds at most ``per_device`` classes. When devices x per_device
    is not a multiple of the class count, the shards left over are not dealt."""
    classes = np.unique(labels)
    if devices < 1 or per_device < 1:
        raise ValueError(f"need at least one device and one class per device, got {devices} and {per_device}")
    shards_per_class = -(-devices * per_device // len(classes))
    shards = {int(c): np.array_split(rng.permutation(np.flatnonzero(labels == c)), shards_per_class) for c in classes}
    dealt = rng.permutation(np.repeat(classes, shards_per_class))[: devices * per_device]
    return [np.sort(np.concatenate([shards[int(c)].pop() for c in dealt[i * per_device:(i + 1) * per_device]]))
            for i in range(devices)]


def rotate_images(X: np.ndarray, quarter_turns: int) -> np.ndarray:
    side = int(np.sqrt(X.shape[1]))
    return np.rot90(X.reshape(-1, side, side), k=quarter_turns, axes=(1, 2)).reshape(len(X), -1).copy()


def pathological_digits(devices: int = 20, classes_per_device: int = 2, domains: int = 1, seed: int = 0,
                        validation: float = 0.2, test: float = 0.2) -> PersonalData:
    """Digits with ``classes_per_device`` classes per device, each device's examples cut into
    train / validation / test (so test shares its device's classes, as in the paper's shards)."""
    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    rng = np.random.default_rng(seed)
    out = []
    for i, idx in enumerate(deal_classes(y, devices, classes_per_device, rng)):
        domain = i % domains
        out.append(split_device(rotate_images(X[idx], domain), y[idx], rng, validation, test, domain))
    return PersonalData(out, X.shape[1], 10)


def gaussian_classes(devices: int = 20, classes_per_device: int = 2, samples: int = 200, seed: int = 0,
                     dim: int = 20, classes: int = 10, scale: float = 0.35, validation: float = 0.1,
                     test: float = 0.2) -> PersonalData:
    """Class means scale·N(0, I_dim), unit-variance noise; each device draws ``samples`` examples
    from its own classes (SuPerFed's toy: 80/20 train/test; here part of train is validation)."""
    rng = np.random.default_rng(seed)
    means = scale * rng.standard_normal((classes, dim))
    out = []
    for _ in range(devices):
        own = rng.choice(classes, size=classes_per_device, replace=False)
        y = rng.choice(own, size=samples)
        X = (means[y] + rng.standard_normal((samples, dim))).astype(np.float32)
        out.append(split_device(X, y, rng, validation, test))
    return PersonalData(out, dim, classes)


def rotated_gaussian(devices: int = 20, rotated: int = 10, dim: int = 10, classes: int = 4, train: int = 50,
                     test: int = 500, temperature: float = 3.0, seed: int = 0) -> PersonalData:
    """x ~ N(0, I), y ~ softmax(temperature·W*x); the first ``rotated`` devices see Q_m·x for a
    private random orthogonal Q_m (spec lg-fedavg 11.D), the rest x itself (domain 0)."""
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((classes, dim))
    out = []
    for m in range(devices):
        n = train + test
        x = rng.standard_normal((n, dim))
        logits = temperature * x @ teacher.T
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        y = np.array([rng.choice(classes, p=row) for row in p])
        domain = int(m < rotated)
        if domain:
            q, _ = np.linalg.qr(rng.standard_normal((dim, dim)))
            x = x @ q.T
        X = x.astype(np.float32)
        out.append(PersonalDevice((X[:train], y[:train]), (X[:0], y[:0]), (X[train:], y[train:]),
                                  tuple(range(classes)), domain))
    return PersonalData(out, dim, classes)


def linear_devices(rho: float, sigma: float = 1.5, devices: int = 100, dim: int = 20, train: int = 2000,
                   test: int = 1000, seed: int = 0) -> list[tuple[Split, Split]]:
    """LG-FedAvg App. C.1: x ~ U[-1, 1]^d, u_m = v + r_m with v ~ U[0, 1]^d and r_m ~ N(0, ρ²I),
    y = u_mᵀx + ε with noise *std* σ² (the code's convention, which reproduces the figures)."""
    rng = np.random.default_rng(seed)
    v = rng.uniform(0, 1, dim)
    out = []
    for _ in range(devices):
        u = v + rng.normal(0, rho, dim)
        X = rng.uniform(-1, 1, (train + test, dim))
        y = X @ u + rng.normal(0, sigma**2, train + test)
        out.append(((X[:train], y[:train]), (X[train:], y[train:])))
    return out


def alpha_sweep(data: list[tuple[Split, Split]], alphas: np.ndarray) -> np.ndarray:
    """Mean test MSE of α·û_m + (1 − α)·v̂ for each α: û_m device m's OLS, v̂ the pooled OLS."""
    local = [np.linalg.lstsq(X, y, rcond=None)[0] for (X, y), _ in data]
    pooled = np.linalg.lstsq(np.vstack([X for (X, _), _ in data]), np.concatenate([y for (_, y), _ in data]),
                             rcond=None)[0]
    errors = np.zeros(len(alphas))
    for u, (_, (Xt, yt)) in zip(local, data):
        for i, a in enumerate(alphas):
            errors[i] += np.mean((Xt @ (a * u + (1 - a) * pooled) - yt) ** 2)
    return errors / len(data)


def fair_toy(devices: int = 10, train: int = 600, test: int = 600, seed: int = 0
             ) -> list[tuple[tuple[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]]:
    """LG-FedAvg's fair toy (spec 11.E): p ~ Bernoulli(1/2), s = 2p − 1,
    x = [u1, u2, u3 + s, s + 0.5n, n2, n3], y = 1[u1 + u2 + 0.7s + 0.5n′ > 0]; per device
    ((x, y, p) train, (x, y, p) test). A perfectly fair encoder exists (h = f(u1, u2))."""
    rng = np.random.default_rng(seed)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        p = rng.integers(0, 2, n)
        s = 2.0 * p - 1
        u, noise = rng.standard_normal((n, 3)), rng.standard_normal((n, 4))
        x = np.column_stack([u[:, 0], u[:, 1], u[:, 2] + s, s + 0.5 * noise[:, 0], noise[:, 1], noise[:, 2]])
        y = (u[:, 0] + u[:, 1] + 0.7 * s + 0.5 * noise[:, 3] > 0).astype(np.int64)
        return x.astype(np.float32), y, p

    return [(draw(train), draw(test)) for _ in range(devices)]

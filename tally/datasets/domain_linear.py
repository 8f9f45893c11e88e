"""FedDAR's linear domain-mixture generator (specs/feddar.md section 5.4): ``domain-linear``.

Every client's data is a mixture of M domains that are the same at every client; a domain is a
linear head on a shared low-rank representation, so one model per domain on a shared encoder can
reach the noise floor while any single model (FedAvg) or per-client model (FedRep) cannot.

Paper: x ~ N(0, I_d), y ~ N(w*_z^T B*^T x, sigma), z ~ Categorical(pi_i), pi_i ~ Dir(alpha p),
B* (d x k) and W* (M x k) from the QR factors of standard Gaussian matrices, the same L training
samples per client for the whole run, noise-free test samples from the same generator. What the
paper leaves open is filled in as the spec reconstructs it from FedRep's code: d = 20, sigma a
standard deviation, p uniform (so each domain's Dirichlet concentration is alpha / M), rows of W*
normalised to unit length, 100 test samples per client drawn from that client's own mixture.

``federation`` turns the data into ``tally.training.domain.DomainTrainer`` devices with the model
the spec's reproduction uses, and reports the paper's metric (test ½·MSE averaged over clients).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tally.models.domain import linear_encoder
from tally.training.domain import PREFIX, DomainTrainer, initial_params


@dataclass(frozen=True)
class DomainSplit:
    """One client's samples: inputs (n, d), targets (n,), domain labels (n,) in 0..M-1."""

    x: np.ndarray
    y: np.ndarray
    z: np.ndarray


@dataclass(frozen=True)
class DomainLinearData:
    train: list[DomainSplit]  # per client, noisy
    test: list[DomainSplit]  # per client, from the same mixture, noise-free
    encoder: np.ndarray  # B*, (d, k), orthonormal columns
    heads: np.ndarray  # W*, (M, k), unit rows
    mixtures: np.ndarray  # pi, (n, M)

    @property
    def dim(self) -> int:
        return int(self.encoder.shape[0])

    @property
    def rank(self) -> int:
        return int(self.encoder.shape[1])

    @property
    def domains(self) -> int:
        return int(self.heads.shape[0])


def domain_linear(
    clients: int = 100,
    domains: int = 5,
    alpha: float = 0.4,
    samples: int = 10,
    noise: float = 1e-3,
    seed: int = 0,
    dim: int = 20,
    rank: int = 2,
    test_samples: int = 100,
) -> DomainLinearData:
    """Generate the synthetic task; ``samples`` is L, the training samples per client.

    The paper's runs: clients = 100, domains = 5, rank = 2, alpha = 0.4, samples in {5, 10, 20},
    noise = 1e-3. Small alpha makes clients nearly single-domain; large alpha makes every client
    match the uniform prior.
    """
    if min(clients, domains, samples, dim, rank, test_samples) < 1:
        raise ValueError("clients, domains, samples, dim, rank and test_samples must be >= 1")
    if rank > min(dim, domains):
        raise ValueError(f"rank {rank} needs dim >= rank and domains >= rank (domain diversity, A.2)")
    if alpha <= 0 or noise < 0:
        raise ValueError(f"alpha must be > 0 and noise >= 0, got {alpha}, {noise}")
    rng = np.random.default_rng(seed)
    encoder = np.linalg.qr(rng.standard_normal((dim, rank)))[0]
    heads = np.linalg.qr(rng.standard_normal((domains, rank)))[0]
    heads /= np.linalg.norm(heads, axis=1, keepdims=True)
    mixtures = rng.dirichlet(np.full(domains, alpha / domains), size=clients)

    def draw(pi: np.ndarray, n: int, sigma: float) -> DomainSplit:
        z = rng.choice(domains, size=n, p=pi / pi.sum())
        x = rng.standard_normal((n, dim))
        y = np.einsum("nk,nk->n", x @ encoder, heads[z]) + sigma * rng.standard_normal(n)
        return DomainSplit(x, y, z)

    train = [draw(pi, samples, noise) for pi in mixtures]
    test = [draw(pi, test_samples, 0.0) for pi in mixtures]
    return DomainLinearData(train, test, encoder, heads, mixtures)


def subspace_distance(estimate: np.ndarray, truth: np.ndarray) -> float:
    """Principal-angle distance ||(I - QQ^T) B*||_2 with Q an orthonormal basis of ``estimate``'s columns."""
    q = np.linalg.qr(estimate)[0]
    return float(np.linalg.norm(truth - q @ (q.T @ truth), ord=2))


@dataclass
class DomainFederation:
    """Devices over the training splits, one evaluator per client's test split, and the initial
    model (linear encoder B ~ N(0, 1/d), heads ~ N(0, 1), as in the spec's reproduction)."""

    devices: list[DomainTrainer]
    tests: list[DomainTrainer]
    initial: dict[str, np.ndarray]
    truth: DomainLinearData

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(test ½·MSE averaged over clients, NaN): the paper's metric; regression has no accuracy."""
        return float(np.mean([t.evaluate(params)[0] for t in self.tests])), float("nan")

    def final_metrics(self, params: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """``tally simulate``'s ``final`` fields for this dataset: per-domain test ½·MSE pooled over
        clients, the worst domain, per-client test ½·MSE and the encoder's subspace distance."""
        evals = [t.evaluate_domains(params) for t in self.tests]
        per_domain = sum(e.loss_sum for e in evals) / np.maximum(sum(e.count for e in evals), 1)
        per_device = [float(e.loss_sum.sum() / e.count.sum()) for e in evals]
        return {
            "test_loss": float(np.mean(per_device)),
            "per_domain_loss": per_domain.tolist(),
            "worst_domain_loss": float(per_domain.max()),
            "per_device_loss": per_device,
            "subspace_distance": subspace_distance(params[PREFIX + "weight"].T, self.truth.encoder),
        }


def federation(data: DomainLinearData, heads: int, seed: int = 0) -> DomainFederation:
    """Torch devices for ``data``. ``heads``: M for FedDAR (head z for domain z), 1 for
    domain-unaware algorithms such as FedAvg, which then train one linear model on the same data."""
    if heads not in (1, data.domains):
        raise ValueError(f"heads must be 1 or {data.domains}, got {heads}")
    cpu = torch.device("cpu")  # d = 20, k = 2: a GPU only adds launch latency

    def factory() -> nn.Module:
        return linear_encoder(data.dim, data.rank, seed=seed)

    def trainer(split: DomainSplit, index: int) -> DomainTrainer:
        return DomainTrainer(factory, split.x, split.y, split.z, data.domains, seed=seed + index, device=cpu)

    return DomainFederation(
        devices=[trainer(s, i) for i, s in enumerate(data.train)],
        tests=[trainer(s, i) for i, s in enumerate(data.test)],
        initial=initial_params(factory(), heads, 1, seed=seed),
        truth=data,
    )

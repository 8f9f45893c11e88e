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

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn

from tally.models.params import get_params, set_params
from tally.training import TorchTrainer

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


class TorchDomainTrainer(TorchTrainer):
    """A torch classification device whose examples carry domain ids.

    ``LocalTrainer`` (inherited: batch-mean cross-entropy, so FedAvg runs on it unchanged) plus
    AgnosticFedAvg's ``DomainDevice``: per-domain counts and cross-entropy sums, and training on the
    domain-weighted loss; ``evaluate_domains`` adds per-domain correct counts for reports.
    """

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        features: np.ndarray,
        labels: np.ndarray,
        domains: np.ndarray,
        seed: int = 0,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(model_factory, features, labels, seed, device)
        if len(domains) != self.num_examples:
            raise ValueError(f"{len(domains)} domain ids for {self.num_examples} examples")
        self.domains = torch.as_tensor(np.asarray(domains), dtype=torch.long, device=self.device)

    @torch.no_grad()
    def evaluate_domains(
        self, params: Mapping[str, np.ndarray], num_domains: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per-domain (example counts, cross-entropy sums, correct predictions)."""
        if self.num_examples and int(self.domains.max()) >= num_domains:
            raise ValueError(f"domain id {int(self.domains.max())} outside 0..{num_domains - 1}")
        set_params(self.model, params)
        self.model.eval()
        logits = self.model(self.features)
        losses = nn.functional.cross_entropy(logits, self.labels, reduction="none").double()
        correct = (logits.argmax(dim=1) == self.labels).double()
        counts = torch.bincount(self.domains, minlength=num_domains)
        return (counts.cpu().numpy().astype(np.int64),
                torch.bincount(self.domains, weights=losses, minlength=num_domains).cpu().numpy(),
                torch.bincount(self.domains, weights=correct, minlength=num_domains).cpu().numpy().astype(np.int64))

    def domain_metrics(self, params: Mapping[str, np.ndarray], num_domains: int) -> dict[str, float | list[float]]:
        """Per-domain mean loss and accuracy of ``params`` on this data and the worst of each
        (a domain without examples reports 0 loss and accuracy 1, so it is never the worst)."""
        counts, loss_sums, correct = self.evaluate_domains(params, num_domains)
        present = np.maximum(counts, 1)
        loss = loss_sums / present
        accuracy = np.where(counts > 0, correct / present, 1.0)
        return {"per_domain_loss": loss.tolist(), "worst_domain_loss": float(loss.max()),
                "per_domain_accuracy": accuracy.tolist(), "worst_domain_accuracy": float(accuracy.min())}

    def domain_statistics(self, params: Mapping[str, np.ndarray], num_domains: int) -> tuple[np.ndarray, np.ndarray]:
        counts, loss_sums, _ = self.evaluate_domains(params, num_domains)
        return counts, loss_sums

    def train_domain_weighted(
        self, params: Mapping[str, np.ndarray], domain_weights: np.ndarray, normaliser: float,
        epochs: int, lr: float, batch_size: int,
    ) -> dict[str, np.ndarray]:
        set_params(self.model, params)
        self.model.train()
        optimiser = torch.optim.SGD(self.model.parameters(), lr=lr)
        weights = torch.as_tensor(np.asarray(domain_weights, dtype=np.float32), device=self.device)
        per_example = weights[self.domains] / normaliser
        n = self.num_examples
        for _ in range(epochs):
            order = torch.randperm(n, generator=self.generator).to(self.device)
            for start in range(0, n, batch_size):
                idx = order[start:start + batch_size]
                optimiser.zero_grad()
                losses = nn.functional.cross_entropy(self.model(self.features[idx]), self.labels[idx], reduction="none")
                (per_example[idx] * losses).sum().backward()
                optimiser.step()
        return get_params(self.model)

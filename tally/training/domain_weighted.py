"""A torch device whose examples carry domain ids: AgnosticFedAvg's device side
(``tally.algorithms.agnostic_fedavg.DomainDevice``), and a plain ``LocalTrainer`` as well, so FedAvg
runs on the same data for comparison. Any dataset with domain labels hands devices this trainer."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn

from tally.algorithms.packages import DOMAIN_STATISTICS
from tally.models.params import get_params, set_params
from tally.training import TorchTrainer
from tally.training.sgd import sgd_epochs


class TorchDomainTrainer(TorchTrainer):
    """A torch classification device whose examples carry domain ids.

    ``LocalTrainer`` (inherited: batch-mean cross-entropy, so FedAvg runs on it unchanged) plus
    AgnosticFedAvg's ``DomainDevice``: per-domain counts and cross-entropy sums, and training on the
    domain-weighted loss; ``evaluate_domains`` adds per-domain correct counts for reports.
    """

    capabilities = (DOMAIN_STATISTICS,)  # declared at check-in: AgnosticFedAvg may seat it

    per_example = ("features", "labels", "domains")

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

        def loss_of_batch(idx: torch.Tensor) -> torch.Tensor:
            losses = nn.functional.cross_entropy(self.model(self.features[idx]), self.labels[idx], reduction="none")
            return (per_example[idx] * losses).sum()

        sgd_epochs(optimiser, loss_of_batch, self.num_examples, epochs, batch_size, self.generator, self.device)
        return get_params(self.model)

"""Local training with torch: the ``LocalTrainer`` a device (real or simulated) offers.

Parameters cross the algorithm boundary as numpy arrays keyed by state-dict name
(``tally.models.params``), so algorithms stay framework-free and the wire carries plain tensors.
The trainers of algorithms whose devices do more than plain SGD are beside this one: ``domain``
(FedDAR), ``energy`` (FedEvg), ``fair`` (LG-FedAvg+Adv) and ``personal`` (SuPerFed); all but
``energy`` (batches drawn with replacement) shuffle and batch through ``sgd``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Self

import numpy as np
import torch
from torch import nn

from tally.models.params import get_params, set_params
from tally.training.sgd import sgd_epochs

Arrays = dict[str, np.ndarray]


def default_device() -> torch.device:
    """Train on the GPU when the device has one."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def held_out_indices(n: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, held-out) indices: ``share`` of n examples held out, at least one left to train on."""
    order = np.random.default_rng(seed).permutation(n)
    k = max(min(int(round(n * share)), n - 1), 0)
    return order[k:], order[:k]


def single_threaded() -> None:
    """Small models on many simulated devices: thread handoff costs ~60x the math itself."""
    torch.set_num_threads(1)


class DeviceTensors:
    """One device's examples and model on its torch device, with its own seeded generator: what
    every trainer starts from, so a simulation and the same devices through the services agree."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        features: np.ndarray,
        labels: np.ndarray,
        seed: int = 0,
        device: torch.device | None = None,
    ) -> None:
        self.device = device or default_device()
        self.model = model_factory().to(self.device)
        self.features = torch.as_tensor(features, dtype=torch.float32, device=self.device)
        self.labels = torch.as_tensor(labels, dtype=torch.long, device=self.device)
        self.generator = torch.Generator().manual_seed(seed)

    # The tensors with one row per example: what a held-out view slices.
    per_example: tuple[str, ...] = ("features", "labels")

    @property
    def num_examples(self) -> int:
        return int(self.labels.shape[0])

    def held_out(self, share: float, seed: int) -> tuple[Self, Self]:
        """(training view, held-out view) of this device: the same split for the same ``seed`` in
        every round, so federated evaluation never scores a model on examples it trained on."""
        train, held = held_out_indices(self.num_examples, share, seed)
        return self._rows(train), self._rows(held)

    def _rows(self, rows: np.ndarray) -> Self:
        view = copy.copy(self)  # shares the model and the generator: views are used one at a time
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        for name in self.per_example:
            setattr(view, name, getattr(self, name)[index])
        return view


class TorchTrainer(DeviceTensors):
    """One device's data and a model factory; each call rebuilds state from the given params."""

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        set_params(self.model, params)
        self.model.train()
        optimiser = torch.optim.SGD(self.model.parameters(), lr=lr)

        def loss_of_batch(idx: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.model(self.features[idx]), self.labels[idx])

        mean = sgd_epochs(optimiser, loss_of_batch, self.num_examples, epochs, batch_size, self.generator, self.device)
        return get_params(self.model), mean

    @torch.no_grad()
    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        set_params(self.model, params)
        self.model.eval()
        logits = self.model(self.features)
        loss = float(nn.functional.cross_entropy(logits, self.labels))
        accuracy = float((logits.argmax(dim=1) == self.labels).float().mean())
        return loss, accuracy

"""LG-FedAvg+Adv's model (specs/lg-fedavg.md section 4): an ``encoder`` to the representation
h = tanh(ℓ(x)), a logistic ``head`` on h and a logistic ``adversary`` that tries to recover the
protected attribute from h; ``tally.training.fair`` trains it."""

from __future__ import annotations

import torch
from torch import nn


class FairModel(nn.Module):
    def __init__(self, inputs: int, width: int = 4) -> None:
        super().__init__()
        self.encoder = nn.Linear(inputs, width)
        self.head = nn.Linear(width, 1)
        self.adversary = nn.Linear(width, 1)

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.encoder(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.represent(x)).squeeze(-1)


def fair_model(inputs: int, width: int = 4, seed: int = 0) -> FairModel:
    torch.manual_seed(seed)
    return FairModel(inputs, width)

"""FedEvg's energy model (``docs/specs/fedevg.md`` §4, §6): a classifier read as an energy-based
model, with SiLU (Swish) activations and spectral norm on the last layer only, both of which
stabilise EBM training."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import spectral_norm


def energy_mlp(inputs: int, classes: int, hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
        spectral_norm(nn.Linear(hidden, classes)),
    )

"""The ``mlp`` model kind: one hidden ReLU layer, the default model of jobs and of the simulator."""

from __future__ import annotations

import torch
from torch import nn


def mlp(inputs: int, classes: int, hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, classes))

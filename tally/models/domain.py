"""Encoders for FedDAR's shared-encoder-plus-domain-heads model (``tally.training.domain``): the
encoder maps inputs to the k features every domain head reads."""

from __future__ import annotations

import torch
from torch import nn


def linear_encoder(inputs: int, features: int, seed: int = 0) -> nn.Module:
    """x -> B^T x without bias, B ~ N(0, 1/d) entries: the synthetic task's encoder (spec 5.4)."""
    generator = torch.Generator().manual_seed(seed)
    layer = nn.Linear(inputs, features, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(features, inputs, generator=generator) / inputs**0.5)
    return layer


def mlp_encoder(inputs: int, hidden: int, projection: int | None = None, seed: int = 0) -> nn.Module:
    """A one-hidden-layer ReLU backbone; ``projection`` appends a fully connected layer down to
    that many features, the paper's way to keep k (and the k²N² Hessians of SA) small."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs, hidden), nn.ReLU()]
    if projection:
        layers.append(nn.Linear(hidden, projection))
    return nn.Sequential(*layers)

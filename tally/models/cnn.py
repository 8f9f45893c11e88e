"""A small convolutional network for 8x8 digit images (scikit-learn's digits), fed the same
flattened 64 features as the mlp, so datasets, devices and the ONNX interface ([batch, 64] in,
[batch, classes] out) stay the same whichever model a job names."""

from __future__ import annotations

import math

import torch
from torch import nn


class DigitsCNN(nn.Module):
    def __init__(self, inputs: int, classes: int, channels: int) -> None:
        super().__init__()
        side = math.isqrt(inputs)
        if side * side != inputs or side < 4:
            raise ValueError(f"cnn needs square images of at least 4x4: inputs={inputs}")
        self.side = side
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.head = nn.Linear(2 * channels * (side // 2) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, 1, self.side, self.side)
        x = torch.relu(self.conv1(x))
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def digits_cnn(inputs: int, classes: int, hidden: int = 16, seed: int = 0) -> nn.Module:
    """``hidden`` is the first layer's channel count (the second has twice as many)."""
    torch.manual_seed(seed)
    return DigitsCNN(inputs, classes, hidden)

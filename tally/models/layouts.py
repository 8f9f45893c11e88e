"""Each built-in model kind's parameters as names, shapes and dtypes, without torch.

Checking a job spec needs the model's layout, never its values: whether an algorithm's options fit
its parameters (LG-FedAvg's ``global_patterns``, FedDAR's heads), what a privacy section costs,
which parameters an adaptation trains. Building the torch module for that would import torch,
seconds of the one-second budget of ``tally job validate``; a test keeps every layout here equal to
the module's own (``get_params`` and ``named_parameters`` of the built module).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """``state``: every entry of the state dict (what ``get_params`` returns) as (shape, dtype);
    ``trainable``: the names of the module's parameters (``named_parameters``), in order."""

    state: dict[str, tuple[Shape, str]]
    trainable: tuple[str, ...]

    def zeros(self) -> dict[str, np.ndarray]:
        """Arrays of the layout, all zero: a stand-in model for checks that read only shapes."""
        return {name: np.zeros(shape, dtype=dtype) for name, (shape, dtype) in self.state.items()}


def _linear(prefix: str, inputs: int, outputs: int, dtype: str = "<f4") -> dict[str, tuple[Shape, str]]:
    return {f"{prefix}weight": ((outputs, inputs), dtype), f"{prefix}bias": ((outputs,), dtype)}


def _mlp(inputs: int, classes: int, hidden: int) -> Layout:
    state = {**_linear("0.", inputs, hidden), **_linear("2.", hidden, classes)}
    return Layout(state, tuple(state))


def _cnn(inputs: int, classes: int, channels: int) -> Layout:
    side = math.isqrt(inputs)
    if side * side != inputs or side < 4:
        raise ValueError(f"cnn needs square images of at least 4x4: inputs={inputs}")
    state = {"conv1.weight": ((channels, 1, 3, 3), "<f4"), "conv1.bias": ((channels,), "<f4"),
             "conv2.weight": ((2 * channels, channels, 3, 3), "<f4"), "conv2.bias": ((2 * channels,), "<f4"),
             **_linear("head.", 2 * channels * (side // 2) ** 2, classes)}
    return Layout(state, tuple(state))


def _energy_mlp(inputs: int, classes: int, hidden: int) -> Layout:
    # The last layer is spectral-normed: its weight is a parametrisation with power-iteration buffers.
    norm = "4.parametrizations.weight."
    state = {**_linear("0.", inputs, hidden), **_linear("2.", hidden, hidden), "4.bias": ((classes,), "<f4"),
             f"{norm}original": ((classes, hidden), "<f4"), f"{norm}0._u": ((classes,), "<f4"),
             f"{norm}0._v": ((hidden,), "<f4")}
    return Layout(state, (*list(state)[:5], f"{norm}original"))


def _domain_mlp(inputs: int, classes: int, hidden: int, domains: int) -> Layout:
    # tally.coordinator.spec.catalogue's FedDAR model: an mlp encoder in float64 and one linear head
    # (with a bias column) per domain.
    state = {**_linear("encoder.0.", inputs, hidden, "<f8"), "heads": ((domains, classes, hidden + 1), "<f8")}
    return Layout(state, tuple(state))


def layout(kind: str, inputs: int, classes: int, hidden: int, domains: int = 1) -> Layout | None:
    """The layout of a built-in ``kind``; None for any other (a plug-in's, a registered one's),
    whose layout only its builder knows."""
    if kind == "domain_mlp":
        return _domain_mlp(inputs, classes, hidden, domains)
    make = {"mlp": _mlp, "cnn": _cnn, "energy_mlp": _energy_mlp}.get(kind)
    return None if make is None else make(inputs, classes, hidden)

"""The model kinds a job can name in ``model: {kind: ...}``: each is a torch module builder
``(inputs, classes, hidden, seed) -> nn.Module`` that the coordinator uses for the initial
parameters and the ONNX export of every committed round, and devices use to train.

Built in: ``mlp``, ``cnn`` (a small convolutional network for 8x8 digit images) and
``energy_mlp`` (FedEvg's energy model). Any other
comes from a plug-in module that an operator names on a command line (``--model-plugin``), never
from a job spec: a spec that could name a module would let whoever submits a job run code in the
coordinator. A plug-in module defines ``TALLY_MODELS``, a mapping of kind to builder.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

ModuleBuilder = Callable[[int, int, int, int], "nn.Module"]

# Kind -> (module, builder), imported when a model is built: naming the kinds (a job spec's check)
# needs no torch.
BUILTIN: Mapping[str, tuple[str, str]] = {
    "mlp": ("tally.models.mlp", "mlp"), "cnn": ("tally.models.cnn", "digits_cnn"),
    "energy_mlp": ("tally.models.energy", "energy_mlp"),
}
_PLUGGED: dict[str, ModuleBuilder] = {}


class PluginError(ValueError):
    """A plug-in module that cannot be imported or does not define usable models."""


def kinds() -> tuple[str, ...]:
    return (*BUILTIN, *_PLUGGED)


def builder(kind: str) -> ModuleBuilder:
    if kind in BUILTIN:
        module, name = BUILTIN[kind]
        found: ModuleBuilder = getattr(importlib.import_module(module), name)
        return found
    if kind not in _PLUGGED:
        raise KeyError(f"model kind {kind!r} is not one of {list(kinds())}")
    return _PLUGGED[kind]


def build(kind: str, inputs: int, classes: int, hidden: int, seed: int) -> nn.Module:
    return builder(kind)(inputs, classes, hidden, seed)


def load_plugins(modules: list[str]) -> list[str]:
    """Import each module and register its ``TALLY_MODELS``; the kinds added."""
    added = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise PluginError(f"model plug-in {name!r} cannot be imported: {exc}") from None
        models = getattr(module, "TALLY_MODELS", None)
        if not isinstance(models, Mapping) or not models:
            raise PluginError(f"model plug-in {name!r} defines no TALLY_MODELS mapping of kind to builder")
        for kind, make in models.items():
            if not isinstance(kind, str) or not kind or not callable(make):
                raise PluginError(f"model plug-in {name!r}: {kind!r} is not a kind name with a builder")
            if kind in kinds() and builder(kind) is not make:
                raise PluginError(f"model plug-in {name!r}: model kind {kind!r} is already taken")
            _PLUGGED[kind] = make
            added.append(kind)
    return added

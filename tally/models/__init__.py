"""The model kinds a job can name in ``model: {kind: ...}``: each is a torch module builder
``(inputs, classes, hidden, seed) -> nn.Module`` that the coordinator uses for the initial
parameters and the ONNX export of every committed round, and devices use to train.

Built in: ``mlp``, ``cnn`` (a small convolutional network for 8x8 digit images) and
``energy_mlp`` (FedEvg's energy model). Any other comes from what an operator installed, never
from a job spec (a spec that could name a module would let whoever submits a job run code in the
coordinator): a package's entry points of the group ``tally.models`` (the entry's name is the
kind, its object the builder; checked like algorithm packages, ``tally.algorithms.packages``), or
a plug-in module named on a command line (``--model-plugin``) that defines ``TALLY_MODELS``, a
mapping of kind to builder.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from typing import TYPE_CHECKING

from tally.algorithms.packages import Refused

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
GROUP = "tally.models"
log = logging.getLogger(__name__)


class ModelPackages:
    """The model kinds installed packages declare (kind -> (package, version, builder)), and the
    entries refused: one that fails to import or is no builder, a kind two packages claim (neither
    is served) or a built-in kind."""

    def __init__(self, entries: Iterable[tuple[str, str, metadata.EntryPoint]]) -> None:
        self.installed: dict[str, tuple[str, str, ModuleBuilder]] = {}
        self.refused: list[Refused] = []
        claims: dict[str, list[tuple[str, str, ModuleBuilder]]] = {}
        for package, version, entry in entries:
            try:
                make = entry.load()
            except Exception as exc:  # noqa: BLE001 - no package's import error may take the others down
                self._refuse(package, entry.name, f"cannot be loaded ({entry.value}): {type(exc).__name__}: {exc}")
                continue
            if not callable(make):
                self._refuse(package, entry.name, f"is a {type(make).__name__}, not a model builder")
            elif entry.name in BUILTIN:
                self._refuse(package, entry.name, f"model kind {entry.name!r} is built in")
            else:
                claims.setdefault(entry.name, []).append((package, version, make))
        for kind, claimed in claims.items():
            if len(claimed) == 1:
                self.installed[kind] = claimed[0]
                continue
            names = sorted(package for package, _, _ in claimed)
            for package, _, _ in claimed:
                self._refuse(package, kind, f"model kind {kind!r} is claimed by packages {names}")

    def _refuse(self, package: str, entry: str, reason: str) -> None:
        log.error("model package refused", extra={"package": package, "entry": entry, "reason": reason})
        self.refused.append(Refused(package, entry, reason))


_packages: ModelPackages | None = None


def packages() -> ModelPackages:
    """The installed model packages, loaded on first use."""
    global _packages
    if _packages is None:
        _packages = ModelPackages((e.dist.name if e.dist else "?", e.dist.version if e.dist else "?", e)
                                  for e in metadata.entry_points(group=GROUP))
    return _packages


class PluginError(ValueError):
    """A plug-in module that cannot be imported or does not define usable models."""


def kinds() -> tuple[str, ...]:
    return (*BUILTIN, *packages().installed, *_PLUGGED)


def builder(kind: str) -> ModuleBuilder:
    if kind in BUILTIN:
        module, name = BUILTIN[kind]
        built_in: ModuleBuilder = getattr(importlib.import_module(module), name)
        return built_in
    packaged = packages().installed.get(kind)
    found = packaged[2] if packaged is not None else _PLUGGED.get(kind)
    if found is None:
        raise KeyError(f"model kind {kind!r} is not one of {list(kinds())}")
    return found


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

"""The model kinds a job can name in ``model: {kind: ...}``: each is a torch module builder
``(inputs, classes, hidden, seed) -> nn.Module`` that the coordinator uses for the initial
parameters and the ONNX export of every committed round, and devices use to train.

A kind comes from what an operator installed, never from a job spec (a spec that could name a
module would let whoever submits a job run code in the coordinator): an entry of the entry-point
group ``tally.models`` whose object is a :class:`Model` (name, version, builder), loaded and checked
by ``tally.algorithms.packages.Catalogue`` as algorithm entries are, so a bad entry is refused with
its package and entry named while the other kinds are still served. Tally's own kinds (``mlp``,
``cnn``, ``energy_mlp``: ``tally.models.builtin``) are entries of the same group in its
``pyproject.toml``. A plug-in module named on a command line (``--model-plugin``) that defines
``TALLY_MODELS`` (kind -> ``Model`` or builder) adds its kinds to the same catalogue, so devices
declare them at check-in like any other.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tally.algorithms.packages import Catalogue, Installed, discover

if TYPE_CHECKING:
    from torch import nn

ModuleBuilder = Callable[[int, int, int, int], "nn.Module"]
GROUP = "tally.models"
# The version of a plug-in module's bare builder when the module states no ``__version__``.
UNVERSIONED = "0"


@dataclass(frozen=True)
class Model:
    """One installable model kind. ``version`` is what devices declare at check-in and what the
    coordinator requires of them: two builds of a kind with different layouts or initialisations
    must carry different versions."""

    name: str
    version: str
    builder: ModuleBuilder
    summary: str = ""


def imported(module: str, name: str) -> ModuleBuilder:
    """A builder that imports ``module`` when it is called: naming and checking the kinds (a job
    spec's check, ``tally models list``) needs no torch."""

    def build(inputs: int, classes: int, hidden: int, seed: int) -> nn.Module:
        made: nn.Module = getattr(importlib.import_module(module), name)(inputs, classes, hidden, seed)
        return made

    return build


def check(model: object) -> str | None:
    """Why ``model`` cannot be served as a model kind, or ``None``."""
    if not isinstance(model, Model):
        return f"is a {type(model).__name__}, not a tally.models.Model"
    if not model.name or not model.version:
        return "has no name or no version"
    if not callable(model.builder):
        return f"builder is a {type(model.builder).__name__}, not a callable (inputs, classes, hidden, seed)"
    return None


_catalogue: Catalogue[Model] | None = None


def catalogue() -> Catalogue[Model]:
    """The process's model kinds, loaded on first use."""
    global _catalogue
    if _catalogue is None:
        _catalogue = Catalogue(discover(GROUP), check, noun="model kind")
    return _catalogue


class PluginError(ValueError):
    """A plug-in module that cannot be imported or does not define usable models."""


def kinds() -> tuple[str, ...]:
    return tuple(catalogue().installed)


def versions() -> dict[str, str]:
    """kind -> version of every installed model kind: what a device declares at check-in."""
    return {kind: found.item.version for kind, found in catalogue().installed.items()}


def builder(kind: str) -> ModuleBuilder:
    found = catalogue().installed.get(kind)
    if found is None:
        raise KeyError(f"model kind {kind!r} is not one of {list(kinds())}")
    return found.item.builder


def build(kind: str, inputs: int, classes: int, hidden: int, seed: int) -> nn.Module:
    return builder(kind)(inputs, classes, hidden, seed)


def load_plugins(modules: list[str]) -> list[str]:
    """Import each module and serve its ``TALLY_MODELS`` (kind -> ``Model``, or a bare builder at
    the module's ``__version__``); the kinds added. A module is taken whole or not at all."""
    added = []
    served = catalogue().installed
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise PluginError(f"model plug-in {name!r} cannot be imported: {exc}") from None
        declared = getattr(module, "TALLY_MODELS", None)
        if not isinstance(declared, Mapping) or not declared:
            raise PluginError(f"model plug-in {name!r} defines no TALLY_MODELS mapping of kind to builder")
        version = str(getattr(module, "__version__", UNVERSIONED))
        taken: dict[str, Installed[Model]] = {}
        for kind, make in declared.items():
            model = make if isinstance(make, Model) else Model(kind, version, make)
            reason = check(model) if isinstance(kind, str) and kind == model.name else "is not a kind name with a Model"
            if reason is not None:
                raise PluginError(f"model plug-in {name!r}: {kind!r} {reason}")
            if kind in served and served[kind].item != model:
                raise PluginError(f"model plug-in {name!r}: model kind {kind!r} is already taken")
            taken[kind] = Installed(model, f"plug-in {name}", kind)
        served.update(taken)
        added.extend(taken)
    return added

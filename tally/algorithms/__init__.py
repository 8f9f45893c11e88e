"""Algorithms, one file each: a server half that sees only sums and a client half.

Which algorithms a process can run is the catalogue of installed packages
(``tally.algorithms.packages``): tally's own, declared as entry points like any other package's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tally.algorithms import packages
from tally.algorithms.base import ClientAlgorithm, LocalTrainer, ServerAlgorithm, StepSpec


def make(name: str, options: Mapping[str, Any] | None = None) -> tuple[ServerAlgorithm, ClientAlgorithm]:
    """The two halves of algorithm ``name`` with the job's options (validated)."""
    return packages.get(name).make(options)


def options_type(name: str) -> type:
    """The options dataclass of algorithm ``name``: its options and their types (job specs are
    validated against it)."""
    return packages.get(name).options


def __getattr__(attribute: str) -> tuple[str, ...]:
    """``NAMES``: the installed algorithms, read from the catalogue when first asked for rather
    than at import, so importing one algorithm's file does not load every package."""
    if attribute == "NAMES":
        return packages.names()
    raise AttributeError(f"module {__name__!r} has no attribute {attribute!r}")


__all__ = ["NAMES", "ClientAlgorithm", "LocalTrainer", "ServerAlgorithm", "StepSpec", "make", "options_type"]

"""Algorithms, one file each: a server half that sees only sums and a client half."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tally.algorithms.aaggff import (
    AAggFFClient,
    AAggFFDOptions,
    AAggFFDServer,
    AAggFFSOptions,
    AAggFFSServer,
)
from tally.algorithms.agnostic_fedavg import (
    AgnosticFedAvgClient,
    AgnosticFedAvgOptions,
    AgnosticFedAvgServer,
)
from tally.algorithms.base import ClientAlgorithm, LocalTrainer, ServerAlgorithm, StepSpec
from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.algorithms.feddar import (
    FedDARClient,
    FedDAROptions,
    FedDARSAOptions,
    FedDARSAServer,
    FedDARWAServer,
)
from tally.algorithms.fedevg import FedEvgClient, FedEvgOptions, FedEvgServer
from tally.algorithms.lg_fedavg import LGFedAvgClient, LGFedAvgOptions, LGFedAvgServer
from tally.algorithms.superfed import SuPerFedClient, SuPerFedOptions, SuPerFedServer

# name -> (options, server half, client half): what coordinators and devices build each algorithm from.
_BUILT_IN = {
    "fedavg": (FedAvgOptions, FedAvgServer, FedAvgClient),
    "agnostic_fedavg": (AgnosticFedAvgOptions, AgnosticFedAvgServer, AgnosticFedAvgClient),
    "aaggff_d": (AAggFFDOptions, AAggFFDServer, AAggFFClient),
    "aaggff_s": (AAggFFSOptions, AAggFFSServer, AAggFFClient),
    "feddar_wa": (FedDAROptions, FedDARWAServer, FedDARClient),
    "feddar_sa": (FedDARSAOptions, FedDARSAServer, FedDARClient),
    "lg_fedavg": (LGFedAvgOptions, LGFedAvgServer, LGFedAvgClient),
    "superfed": (SuPerFedOptions, SuPerFedServer, SuPerFedClient),
    "fedevg": (FedEvgOptions, FedEvgServer, FedEvgClient),
}

NAMES = tuple(_BUILT_IN)


def make(name: str, options: Mapping[str, Any] | None = None) -> tuple[ServerAlgorithm, ClientAlgorithm]:
    """The two halves of algorithm ``name`` with the job's options (validated)."""
    parsed = options_type(name).from_dict(options)
    _, server, client = _BUILT_IN[name]
    return server(parsed), client(parsed)


def options_type(name: str) -> type:
    """The options dataclass of algorithm ``name``: its options and their types (job specs are
    validated against it)."""
    try:
        return _BUILT_IN[name][0]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(NAMES)}") from None


__all__ = ["NAMES", "ClientAlgorithm", "LocalTrainer", "ServerAlgorithm", "StepSpec", "make", "options_type"]

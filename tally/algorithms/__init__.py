"""Algorithms, one file each: a server half that sees only sums and a client half."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tally.algorithms.base import ClientAlgorithm, LocalTrainer, ServerAlgorithm, StepSpec
from tally.algorithms.aaggff import (
    AAggFFClient,
    AAggFFDConfig,
    AAggFFDServer,
    AAggFFSConfig,
    AAggFFSServer,
)
from tally.algorithms.agnostic_fedavg import (
    AgnosticFedAvgClient,
    AgnosticFedAvgConfig,
    AgnosticFedAvgServer,
)
from tally.algorithms.fedavg import FedAvgClient, FedAvgConfig, FedAvgServer
from tally.algorithms.fedevg import FedEvgClient, FedEvgConfig, FedEvgServer
from tally.algorithms.feddar import (
    FedDARClient,
    FedDARConfig,
    FedDARSAConfig,
    FedDARSAServer,
    FedDARWAServer,
)
from tally.algorithms.lg_fedavg import LGFedAvgClient, LGFedAvgConfig, LGFedAvgServer
from tally.algorithms.superfed import SuPerFedClient, SuPerFedConfig, SuPerFedServer

# name -> (options, server half, client half): what coordinators and devices build each algorithm from.
_BUILT_IN = {
    "fedavg": (FedAvgConfig, FedAvgServer, FedAvgClient),
    "agnostic_fedavg": (AgnosticFedAvgConfig, AgnosticFedAvgServer, AgnosticFedAvgClient),
    "aaggff_d": (AAggFFDConfig, AAggFFDServer, AAggFFClient),
    "aaggff_s": (AAggFFSConfig, AAggFFSServer, AAggFFClient),
    "feddar_wa": (FedDARConfig, FedDARWAServer, FedDARClient),
    "feddar_sa": (FedDARSAConfig, FedDARSAServer, FedDARClient),
    "lg_fedavg": (LGFedAvgConfig, LGFedAvgServer, LGFedAvgClient),
    "superfed": (SuPerFedConfig, SuPerFedServer, SuPerFedClient),
    "fedevg": (FedEvgConfig, FedEvgServer, FedEvgClient),
}

NAMES = tuple(_BUILT_IN)


def make(name: str, options: Mapping[str, Any] | None = None) -> tuple[ServerAlgorithm, ClientAlgorithm]:
    """The two halves of algorithm ``name`` with the job's options (validated)."""
    config = options_type(name).from_dict(options)
    _, server, client = _BUILT_IN[name]
    return server(config), client(config)


def options_type(name: str) -> type:
    """The config dataclass of algorithm ``name``: its options and their types (job specs are
    validated against it)."""
    try:
        return _BUILT_IN[name][0]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(NAMES)}") from None


__all__ = ["NAMES", "ClientAlgorithm", "LocalTrainer", "ServerAlgorithm", "StepSpec", "make", "options_type"]

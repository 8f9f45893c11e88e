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
from tally.algorithms.feddar import (
    FedDARClient,
    FedDARConfig,
    FedDARSAConfig,
    FedDARSAServer,
    FedDARWAServer,
)

_REGISTRY = {
    "fedavg": (FedAvgConfig, FedAvgServer, FedAvgClient),
    "agnostic_fedavg": (AgnosticFedAvgConfig, AgnosticFedAvgServer, AgnosticFedAvgClient),
    "aaggff_d": (AAggFFDConfig, AAggFFDServer, AAggFFClient),
    "aaggff_s": (AAggFFSConfig, AAggFFSServer, AAggFFClient),
    "feddar_wa": (FedDARConfig, FedDARWAServer, FedDARClient),
    "feddar_sa": (FedDARSAConfig, FedDARSAServer, FedDARClient),
}

NAMES = tuple(_REGISTRY)


def make(name: str, options: Mapping[str, Any] | None = None) -> tuple[ServerAlgorithm, ClientAlgorithm]:
    """The two halves of algorithm ``name`` with the job's options (validated)."""
    try:
        config_type, server, client = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; available: {', '.join(NAMES)}") from None
    config = config_type.from_dict(options)
    return server(config), client(config)


__all__ = ["NAMES", "ClientAlgorithm", "LocalTrainer", "ServerAlgorithm", "StepSpec", "make"]

"""Which server halves the coordinator can run: the algorithms of ``tally.algorithms`` plus any
registered here.

The hook exists so an algorithm can be plugged into the round engine (and job-spec validation)
without editing ``tally/algorithms``: tests register tiny algorithms that exercise paths FedAvg
does not (several sums per round), and a deployment can add its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tally import algorithms
from tally.algorithms.base import ServerAlgorithm

ServerFactory = Callable[[Mapping[str, Any] | None], ServerAlgorithm]

_EXTRA: dict[str, ServerFactory] = {}


def register_algorithm(name: str, factory: ServerFactory) -> None:
    """Make ``name`` runnable; ``factory(options)`` builds the server half and raises
    ``ValueError`` or ``TypeError`` for options it refuses (reported at job submission)."""
    if not name or name in algorithms.NAMES or name in _EXTRA:
        raise ValueError(f"algorithm name {name!r} is empty or already taken")
    _EXTRA[name] = factory


def unregister_algorithm(name: str) -> None:
    _EXTRA.pop(name, None)


def algorithm_names() -> tuple[str, ...]:
    return (*algorithms.NAMES, *_EXTRA)


def make_server(name: str, options: Mapping[str, Any] | None) -> ServerAlgorithm:
    """The server half of ``name`` built with the job's options."""
    factory = _EXTRA.get(name)
    if factory is not None:
        return factory(options)
    server, _ = algorithms.make(name, options)
    return server

"""The coordinator's catalogue: which server halves it can run, and which models a job may start
from: the algorithms of ``tally.algorithms`` and the torch models of ``tally.models`` (built in,
from installed model packages or plugged in with ``--model-plugin``), plus any registered here
(which have no version, so no device is asked to declare them).

The hooks exist so an algorithm or a model can be plugged into the coordinator's rounds (and job-spec
validation) without editing ``tally/algorithms`` or the job-spec format: tests register tiny
algorithms that exercise paths FedAvg does not (several sums per round), research jobs start from
a dataset's own model (the toy regression's ``{"w": [5.0]}``), and a deployment can add its own.
Registration is per process: it must happen in the coordinator's process before jobs naming the
kind are submitted or resumed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tally import algorithms, models
from tally.algorithms.base import Arrays, ServerAlgorithm
from tally.models.layouts import layout


class ModelSpec(Protocol):
    """What a model factory reads of a job's ``model:`` section (``tally.coordinator.spec.jobspec.ModelSpec``).

    Declared here rather than imported: jobspec validates against this catalogue, so the catalogue
    must not depend on jobspec (tests/unit/test_layers.py refuses the cycle)."""

    kind: str
    inputs: int
    classes: int
    hidden: int
    domains: int
    seed: int


ServerFactory = Callable[[Mapping[str, Any] | None], ServerAlgorithm]
ModelFactory = Callable[[ModelSpec], Arrays]

_EXTRA: dict[str, ServerFactory] = {}
_MODELS: dict[str, ModelFactory] = {}


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


def register_model(kind: str, factory: ModelFactory) -> None:
    """Let jobs say ``model: {kind: <kind>}``; ``factory(model_spec)`` returns the initial
    parameters (name -> array, in the order the algorithm flattens them). Such a model has no
    torch module, hence no ONNX export: a torch model is a ``tally.models`` plug-in instead."""
    if not kind or kind in models.kinds() or kind in _MODELS:
        raise ValueError(f"model kind {kind!r} is empty or already taken")
    _MODELS[kind] = factory


def unregister_model(kind: str) -> None:
    _MODELS.pop(kind, None)


def _domain_mlp(spec: ModelSpec) -> Arrays:
    """FedDAR's model: a one-hidden-layer encoder and one linear head per domain."""
    from tally.models.domain import mlp_encoder  # torch: only when a model is built
    from tally.training.domain import initial_params

    encoder = mlp_encoder(spec.inputs, spec.hidden, seed=spec.seed)
    return initial_params(encoder, heads=spec.domains, outputs=spec.classes, seed=spec.seed)


_MODELS["domain_mlp"] = _domain_mlp


def model_kinds() -> tuple[str, ...]:
    return (*models.kinds(), *_MODELS)


def initial_model(spec: ModelSpec) -> Arrays:
    """The parameters a job's first round starts from."""
    if spec.kind in models.kinds():
        from tally.models.params import get_params  # torch: only when a model is built

        return get_params(models.build(spec.kind, spec.inputs, spec.classes, spec.hidden, spec.seed))
    factory = _MODELS.get(spec.kind)
    if factory is None:
        raise ValueError(f"model kind {spec.kind!r} is not registered in this coordinator")
    return dict(factory(spec))


def model_layout(spec: ModelSpec) -> Arrays:
    """A stand-in for ``initial_model(spec)`` with the same names, shapes and dtypes, all zero, for
    the checks that read no values (a job spec's): no torch for the built-in kinds; any other kind
    is built, as only its builder knows its layout. ValueError as ``initial_model`` for a kind or
    shape that does not exist."""
    if spec.kind not in _MODELS or spec.kind == "domain_mlp":
        found = layout(spec.kind, spec.inputs, spec.classes, spec.hidden, spec.domains)
        if found is not None:
            return found.zeros()
    return initial_model(spec)

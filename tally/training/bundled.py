"""The bundled devices' training (``tally client``, ``tally fleet``): one device's shard of a
bundled dataset, with the trainer each job needs built from the job itself.

A job names its algorithm and its model; a device started before any job cannot know either. So
the device holds only its data, and at its first task of a job builds that job's trainer: the
model is read off the job's downloaded parameters (a built-in kind, its hidden width and, for
FedDAR, its heads: ``tally.models.layouts``), and the trainer is the one the algorithm's client
half needs (``TorchDomainTrainer`` for AgnosticFedAvg's domain statistics, ``DomainTrainer`` for
FedDAR's heads, ``EnergyTrainer`` for FedEvg, ``MixingTrainer`` for SuPerFed, else
``TorchTrainer``). ``--model``/``--hidden`` given on the command line override what is read (a
plug-in model kind has no built-in layout to read it by).

Domains: the bundled datasets have none, so each device is one domain's, device ``index`` of
domain ``index mod D`` (D: the job's ``domains`` option, or its model's heads): a population
drawn from D sites, as AgnosticFedAvg's and FedDAR's client-partitioned toys are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from tally import algorithms, models
from tally.algorithms.base import LocalTrainer, ModelMismatch
from tally.algorithms.packages import DOMAIN_STATISTICS
from tally.models.layouts import layout
from tally.training import TorchTrainer, default_device


@dataclass(frozen=True)
class ModelShape:
    """What a job's model is: a ``model:`` section's kind, inputs, classes, hidden and domains."""

    kind: str
    inputs: int
    classes: int
    hidden: int
    domains: int = 1


def _matches(shape: ModelShape, params: Mapping[str, np.ndarray]) -> bool:
    found = layout(shape.kind, shape.inputs, shape.classes, shape.hidden, shape.domains)
    return found is not None and all(
        name in params and tuple(np.shape(params[name])) == tuple(size) for name, (size, _) in found.state.items())


def _candidates(given: Mapping[str, np.ndarray], inputs: int) -> list[ModelShape]:
    """The built-in kinds ``given`` could be, with the sizes read off its shapes; the larger
    layouts first (an energy_mlp holds an mlp's names too)."""
    def dims(name: str) -> tuple[int, ...]:
        return tuple(np.shape(given[name])) if name in given else ()

    found = []
    if len(dims("heads")) == 3 and len(dims("encoder.0.weight")) == 2:
        heads = dims("heads")
        found.append(ModelShape("domain_mlp", inputs, heads[1], dims("encoder.0.weight")[0], heads[0]))
    if len(dims("0.weight")) == 2 and dims("4.bias"):
        found.append(ModelShape("energy_mlp", inputs, dims("4.bias")[0], dims("0.weight")[0]))
    if len(dims("conv1.weight")) == 4 and dims("head.bias"):
        found.append(ModelShape("cnn", inputs, dims("head.bias")[0], dims("conv1.weight")[0]))
    if len(dims("0.weight")) == 2 and dims("2.bias"):
        found.append(ModelShape("mlp", inputs, dims("2.bias")[0], dims("0.weight")[0]))
    return found


def model_shape(params: Mapping[str, np.ndarray], inputs: int) -> ModelShape | None:
    """The built-in model kind whose layout ``params`` hold (a round's broadcast may hold more, and
    may name the model's parameters under a ``model/`` prefix, as AgnosticFedAvg's does), for data
    of ``inputs`` features; None when none fits (a plug-in's model, or a model for other data)."""
    prefixed = {name.removeprefix("model/"): value for name, value in params.items() if name.startswith("model/")}
    for given in (params, prefixed):
        found = next((shape for shape in _candidates(given, inputs) if _matches(shape, given)), None)
        if found is not None:
            return found
    return None


class BundledDevice:
    """Device ``index``'s examples; ``for_job`` builds (once per job) the trainer the job needs.

    ``kind``/``hidden``: the command line's ``--model``/``--hidden``, overriding what the job's
    parameters say (None: read them). ``seed``: the trainer's (batch order, personal model)."""

    # It builds the domain trainers AgnosticFedAvg and FedDAR need (one domain per device).
    capabilities = (DOMAIN_STATISTICS,)

    def __init__(self, features: np.ndarray, labels: np.ndarray, index: int, seed: int, *,
                 classes: int, kind: str | None = None, hidden: int | None = None) -> None:
        self.features, self.labels = features, labels
        self.index, self.seed, self.classes = index, seed, classes
        self.kind, self.hidden = kind, hidden
        self.device = default_device()  # what the device states at check-in: cuda or cpu
        self._jobs: dict[str, LocalTrainer] = {}
        self._lock = threading.Lock()  # tasks of two jobs may build at once, in the executor

    @property
    def num_examples(self) -> int:
        return len(self.labels)

    def for_job(self, job_id: str, algorithm: str | None, options: Mapping[str, Any],
                model: Mapping[str, np.ndarray]) -> LocalTrainer:
        """The trainer of ``job_id`` (``algorithm`` None: a plain one, as adaptation needs);
        ``ModelMismatch`` when the job's model cannot be trained here."""
        with self._lock:
            if job_id not in self._jobs:
                self._jobs[job_id] = self._build(algorithm, options, self._shape(model))
            return self._jobs[job_id]

    def _shape(self, model: Mapping[str, np.ndarray]) -> ModelShape:
        inputs = int(self.features.shape[1])
        read = model_shape(model, inputs)
        if read is None and self.kind is None:
            raise ModelMismatch(
                f"the job's model ({', '.join(f'{n} {tuple(np.shape(v))}' for n, v in list(model.items())[:4])} ...) "
                f"is no built-in kind for data of {inputs} features; give --model and --hidden")
        if read is None:
            return ModelShape(self.kind or "mlp", inputs, self.classes, self.hidden or 64)
        return ModelShape(self.kind or read.kind, inputs, read.classes, self.hidden or read.hidden, read.domains)

    def _build(self, algorithm: str | None, options: Mapping[str, Any], shape: ModelShape) -> LocalTrainer:
        x, y, seed = self.features, self.labels, self.seed
        if algorithm in ("feddar_wa", "feddar_sa"):
            from tally.models.domain import mlp_encoder
            from tally.training.domain import DomainTrainer

            if shape.kind != "domain_mlp":
                raise ModelMismatch(f"{algorithm} trains a domain_mlp (an encoder and one head per domain), "
                                    f"the job's model is a {shape.kind}")
            z = np.full(len(y), self.index % shape.domains)
            return DomainTrainer(lambda: mlp_encoder(shape.inputs, shape.hidden, seed=seed), x, y, z,
                                 shape.domains, loss="softmax", outputs=shape.classes, seed=seed)
        factory = self._factory(shape)
        if algorithm == "agnostic_fedavg":
            from tally.training.domain_weighted import TorchDomainTrainer

            domains = algorithms.options_type(algorithm).from_dict(options).domains
            return TorchDomainTrainer(factory, x, y, np.full(len(y), self.index % domains), seed)
        if algorithm == "fedevg":
            from tally.training.energy import EnergyTrainer

            return EnergyTrainer(factory, x, y, seed)
        if algorithm == "superfed":
            from tally.training.personal import MixingTrainer

            return MixingTrainer(factory, x, y, seed)
        return TorchTrainer(factory, x, y, seed)

    def _factory(self, shape: ModelShape) -> Callable[[], nn.Module]:
        if shape.kind not in models.kinds():
            raise ModelMismatch(f"model kind {shape.kind!r} is not one of {list(models.kinds())} on this device")
        return lambda: models.build(shape.kind, shape.inputs, shape.classes, shape.hidden, 0)

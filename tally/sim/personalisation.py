"""Personal models in simulation: each device's model judged on its own test split.

A personalised algorithm's client half is a ``PersonalisedClient`` (``tally.algorithms.base``):
its ``personal_model`` is the model a device would use, from the federated model and what it kept
on the device, tuned (where the algorithm tunes anything) on the device's *validation* split, never
its test split. An algorithm without it personalises nothing: every device uses the federated model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import nn

from tally.algorithms.base import Arrays, ClientAlgorithm, PersonalisedClient
from tally.datasets.personal import PersonalData
from tally.models.params import get_params
from tally.training import TorchTrainer
from tally.training.personal import MixingTrainer


@dataclass
class PersonalFleet:
    devices: list[MixingTrainer]  # each device's training split: what the algorithms train on
    validation: list[TorchTrainer]
    test: list[TorchTrainer]
    initial: Arrays
    factory: Callable[[], nn.Module]


def personal_fleet(data: PersonalData, factory: Callable[[], nn.Module], seed: int = 0) -> PersonalFleet:
    """Trainers for every device's three splits; the training ones can also train SuPerFed's pair."""

    def trainers(part: str, kind: type[TorchTrainer] = TorchTrainer) -> list:
        return [kind(factory, *getattr(d, part), seed=seed + i) for i, d in enumerate(data.devices)]

    return PersonalFleet(trainers("train", MixingTrainer), trainers("validation"), trainers("test"),
                         get_params(factory()), factory)


def personal_params(client: ClientAlgorithm, model: Mapping[str, np.ndarray], local_state: Any,
                    validation: TorchTrainer | None) -> Arrays:
    if isinstance(client, PersonalisedClient):
        return client.personal_model(model, local_state, validation)
    return dict(model)


def personal_accuracy(client: ClientAlgorithm, model: Mapping[str, np.ndarray], local_states: Mapping[int, Any],
                      fleet: PersonalFleet) -> np.ndarray:
    """Per device: test accuracy of its personal model (devices never sampled use what a new
    device would: the algorithm's personal model from no local state)."""
    return np.array([
        test.evaluate(personal_params(client, model, local_states.get(i), fleet.validation[i]))[1]
        for i, test in enumerate(fleet.test)
    ])


def local_only_accuracy(
    fleet: PersonalFleet, epochs: int, lr: float, batch_size: int
) -> tuple[np.ndarray, list[Arrays]]:
    """Per device: test accuracy of a model trained on its own training split alone, from the
    common initial model (the baseline a device could have without federated learning)."""
    models = [device.train(fleet.initial, epochs, lr, batch_size)[0] for device in fleet.devices]
    return np.array([test.evaluate(m)[1] for test, m in zip(fleet.test, models)]), models


def summary(per_device: np.ndarray) -> dict[str, Any]:
    return {"mean_accuracy": float(np.mean(per_device)), "min_accuracy": float(np.min(per_device)),
            "per_device_accuracy": [float(a) for a in per_device]}

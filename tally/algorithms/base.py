"""The algorithm contract (DESIGN.md section 5).

A round is an ordered list of steps; each step is: the server broadcasts, devices
compute, one secure sum, the server updates. The server half only ever receives the
*total* of a step's payload over the round's devices: that is the one rule made
structural. The client half keeps whatever must stay on the device in ``local_state``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tally.codec import PayloadSchema

Arrays = dict[str, np.ndarray]


@dataclass(frozen=True)
class StepSpec:
    """One secure sum of a round: its name and the schema of what each device contributes."""

    name: str
    schema: PayloadSchema


class ModelMismatch(ValueError):
    """The parameters a trainer was given do not fit its model (names or shapes).

    A device whose model is not the job's must refuse the task with this reason, which it
    reports to the coordinator, rather than fail inside training with a framework error."""


def check_fits(given: Mapping[str, np.ndarray], model: Mapping[str, tuple[int, ...]]) -> None:
    """Raise ``ModelMismatch`` naming every parameter of ``model`` that ``given`` lacks or
    shapes differently."""
    problems = []
    for name, shape in model.items():
        if name not in given:
            problems.append(f"{name} missing")
        elif tuple(np.shape(given[name])) != tuple(shape):
            problems.append(f"{name} is {tuple(np.shape(given[name]))}, the device's model {tuple(shape)}")
    if problems:
        raise ModelMismatch("the job's model does not fit this device's model: " + "; ".join(problems))


class LocalTrainer(Protocol):
    """What a device offers an algorithm: training and evaluation on its own data.

    The client SDK and the simulator implement it with torch (``cuda`` when present);
    algorithms never touch the data directly, so one algorithm file serves both.
    """

    @property
    def num_examples(self) -> int: ...

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        """Train from ``params``; return the new parameters and the mean training loss."""
        ...

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(mean loss, accuracy) of ``params`` on this device's data."""
        ...


class ServerAlgorithm(Protocol):
    name: str

    def init(self, params: Arrays) -> Any: ...

    def steps(self, state: Any) -> list[StepSpec]: ...

    def broadcast(self, state: Any, step: str) -> Arrays: ...

    def apply(self, state: Any, step: str, total: Mapping[str, np.ndarray]) -> Any: ...

    def model(self, state: Any) -> Arrays: ...


class ClientAlgorithm(Protocol):
    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
    ) -> tuple[Arrays, Any]: ...


def flatten(params: Mapping[str, np.ndarray]) -> np.ndarray:
    """Parameters as one float64 vector, in the mapping's order."""
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in params.values()])


def unflatten(vector: np.ndarray, like: Mapping[str, np.ndarray]) -> Arrays:
    out, offset = {}, 0
    for name, value in like.items():
        size = int(np.prod(value.shape, dtype=np.int64))
        out[name] = vector[offset : offset + size].reshape(value.shape).astype(value.dtype)
        offset += size
    if offset != vector.size:
        raise ValueError(f"vector has {vector.size} values, the model {offset}")
    return out

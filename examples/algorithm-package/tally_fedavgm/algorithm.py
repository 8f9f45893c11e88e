"""fedavgm: federated averaging with server momentum, over secure sums.

Written by `tally new algorithm fedavgm` as a starting point: edit the two halves, the options and
the privacy declaration, keep the tests passing (`pytest tests`), and install the package beside
the coordinator and on the devices (`pip install .`). The server half only ever receives the sum
of a step's payload over the round's devices; what a device must keep to itself stays in its
local state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, ClassVar

import numpy as np

from tally.algorithms.base import Arrays, LocalTrainer, Options, StepSpec, flatten, unflatten
from tally.algorithms.options import Option
from tally.algorithms.packages import Algorithm
from tally.codec import Field, PayloadSchema

NAME = "fedavgm"
STEP = "update"


@dataclass(frozen=True)
class FedavgmOptions(Options):
    """Options of a job's `options:` section. Each needs a meaning and a range: the shared ones
    (`local_lr`, `delta_clip`, ...) have theirs in Tally's table, the others in OPTIONS below."""

    options_of: ClassVar[str] = NAME

    local_epochs: int = 1
    local_lr: float = 0.1
    batch_size: int = 16
    server_lr: float = 1.0
    server_momentum: float = 0.9
    delta_clip: float = 4.0
    frac_bits: int = 20
    example_cap: int = 1000


OPTIONS = {
    "server_momentum": Option("momentum of the server's step along the averaged update (0: plain averaging)",
                              ge=0, lt=1),
}


@dataclass(frozen=True)
class FedavgmState:
    params: Arrays
    velocity: np.ndarray
    round: int = 0


class FedavgmServer:
    """Divides the sum of weighted updates by the sum of weights, then steps with momentum."""

    name = NAME

    def __init__(self, options: FedavgmOptions) -> None:
        self.options = options

    def init(self, params: Arrays) -> FedavgmState:
        return FedavgmState(dict(params), np.zeros(flatten(params).size))

    def steps(self, state: FedavgmState) -> list[StepSpec]:
        o = self.options
        return [StepSpec(STEP, PayloadSchema((
            Field("weighted_delta", (state.velocity.size,), clip=o.delta_clip, frac_bits=o.frac_bits),
            Field("weight", (), clip=1.0, frac_bits=o.frac_bits),
        )))]

    def broadcast(self, state: FedavgmState, step: str) -> Arrays:
        return dict(state.params)

    def apply(self, state: FedavgmState, step: str, total: Mapping[str, np.ndarray]) -> FedavgmState:
        weight = float(total["weight"])
        if weight <= 0:
            raise ValueError("the round's total weight is zero: no device contributed")
        mean_delta = np.asarray(total["weighted_delta"], dtype=np.float64) / weight
        velocity = self.options.server_momentum * state.velocity + mean_delta
        params = unflatten(flatten(state.params) + self.options.server_lr * velocity, state.params)
        return replace(state, params=params, velocity=velocity, round=state.round + 1)

    def model(self, state: FedavgmState) -> Arrays:
        return state.params


class FedavgmClient:
    """Trains from the broadcast model and sends its clipped update, weighted by its examples."""

    def __init__(self, options: FedavgmOptions) -> None:
        self.options = options

    def contribute(self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer,
                   local_state: Any) -> tuple[Arrays, Any]:
        o = self.options
        trained, _ = device.train(broadcast, o.local_epochs, o.local_lr, o.batch_size)
        delta = np.clip(flatten(trained) - flatten(broadcast), -o.delta_clip, o.delta_clip)
        weight = min(device.num_examples, o.example_cap) / o.example_cap
        return {"weighted_delta": weight * delta, "weight": np.float64(weight)}, local_state


# Every payload field and its role under differential privacy (a job with a `privacy:` section):
# "clipped" (in the model's units), "bounded" (by its codec clip), "withheld" (a report the server
# half never reads) or "counted" (1 per device). A field without a role is refused at load.
FIELDS = ("weighted_delta", "weight")
PRIVACY = {"weighted_delta": "clipped", "weight": "clipped"}

ALGORITHM = Algorithm(
    NAME, metadata.version("tally-fedavgm"), FedavgmOptions, FedavgmServer, FedavgmClient,
    FIELDS, PRIVACY, options_meanings=OPTIONS, summary="federated averaging with server momentum",
)

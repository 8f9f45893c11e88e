"""FedAvg (McMahan et al. 2017) over secure sums: one step, sums of w·Δ and w.

Each device weighs its update by w = min(n, n_cap) / n_cap, so every summed value is
bounded by the update clip and the fixed-point encoding never saturates on a device
with many examples; the server divides Σ w·Δ by Σ w, which is example-weighted
FedAvg for devices below the cap. Updates are clipped elementwise at ``delta_clip``
(clipped values are counted by the codec, never silent).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar

import numpy as np

from tally.algorithms.base import Arrays, LocalTrainer, Options, StepSpec, flatten, unflatten
from tally.codec import Field, Kind, PayloadSchema

STEP = "update"


@dataclass(frozen=True)
class FedAvgOptions(Options):
    options_of: ClassVar[str] = "fedavg"

    local_epochs: int = 5
    local_lr: float = 0.1
    batch_size: int = 16
    server_lr: float = 1.0
    delta_clip: float = 4.0
    frac_bits: int = 20
    example_cap: int = 1000

    @classmethod
    def part_of(cls, options: FedAvgOptions) -> FedAvgOptions:
        """The FedAvg part of options that extend FedAvg's (LG-FedAvg's, SuPerFed's)."""
        return cls(**{f.name: getattr(options, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class FedAvgState:
    params: Arrays
    round: int = 0


class FedAvgServer:
    name = "fedavg"

    def __init__(self, options: FedAvgOptions | None = None) -> None:
        self.options = options or FedAvgOptions()

    def init(self, params: Arrays) -> FedAvgState:
        return FedAvgState(dict(params))

    def steps(self, state: FedAvgState) -> list[StepSpec]:
        dim = sum(v.size for v in state.params.values())
        schema = PayloadSchema(
            (
                Field("weighted_delta", (dim,), clip=self.options.delta_clip, frac_bits=self.options.frac_bits),
                Field("weight", (), clip=1.0, frac_bits=self.options.frac_bits),
                Field("examples", (), kind=Kind.COUNT, clip=self.options.example_cap * 1000),
            )
        )
        return [StepSpec(STEP, schema)]

    def broadcast(self, state: FedAvgState, step: str) -> Arrays:
        return dict(state.params)

    def apply(self, state: FedAvgState, step: str, total: Mapping[str, np.ndarray]) -> FedAvgState:
        weight = float(total["weight"])
        if weight <= 0:
            raise ValueError("the round's total weight is zero: no device contributed")
        mean_delta = np.asarray(total["weighted_delta"], dtype=np.float64) / weight
        current = flatten(state.params)
        new = unflatten(current + self.options.server_lr * mean_delta, state.params)
        return replace(state, params=new, round=state.round + 1)

    def model(self, state: FedAvgState) -> Arrays:
        return state.params


class FedAvgClient:
    def __init__(self, options: FedAvgOptions | None = None) -> None:
        self.options = options or FedAvgOptions()

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
    ) -> tuple[Arrays, Any]:
        opts = self.options
        trained, _ = device.train(broadcast, opts.local_epochs, opts.local_lr, opts.batch_size)
        delta = flatten(trained) - flatten(broadcast)
        n = device.num_examples
        weight = min(n, opts.example_cap) / opts.example_cap
        return (
            {
                "weighted_delta": weight * np.clip(delta, -opts.delta_clip, opts.delta_clip),
                "weight": np.float64(weight),
                "examples": np.int64(min(n, opts.example_cap * 1000)),
            },
            local_state,
        )

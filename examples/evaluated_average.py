"""A complete algorithm in one file, the example of docs/adding-an-algorithm.md.

``evaluated_average``: each round, two secure sums.

1. ``update``: every device trains from the broadcast model and contributes its update Δ and a
   count of 1; the server moves the model by ``server_lr`` times the plain mean Σ Δ / Σ 1.
2. ``evaluate``: the server broadcasts the model it has just made (a later step depends on an
   earlier sum); every device contributes its loss on its own data and a count of 1, and the server
   keeps the round's mean loss Σ loss / Σ 1 in its state.

The codec clips each value at its field's bound (``delta_clip``, ``loss_clip``) and counts every
clipped value, so the algorithm need not. The server half sees the four totals and nothing else. A
device keeps the number of rounds it took part in as its local state, which never leaves it (and
advances only where its update was summed).

Run it in process with ``tally.sim.rounds.run_rounds`` (tests/test_algorithm_contract.py does, through
the real secure sum) or make the coordinator run it with ``tally.coordinator.spec.catalogue.register_algorithm``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from tally.algorithms.base import Arrays, LocalTrainer, Options, StepSpec, flatten, unflatten
from tally.codec import Field, Kind, PayloadSchema

UPDATE, EVALUATE = "update", "evaluate"
COUNT = Field("count", (), kind=Kind.COUNT, clip=1)


@dataclass(frozen=True)
class EvaluatedAverageOptions(Options):
    """The options a job's ``options:`` gives; ``from_dict`` (from ``Options``) parses them."""

    options_of: ClassVar[str] = "evaluated_average"

    local_epochs: int = 1
    local_lr: float = 0.1
    batch_size: int = 16
    server_lr: float = 1.0
    delta_clip: float = 4.0
    loss_clip: float = 100.0
    frac_bits: int = 20

    def __post_init__(self) -> None:
        if self.delta_clip <= 0 or self.loss_clip <= 0:
            raise ValueError("delta_clip and loss_clip must be > 0")


@dataclass(frozen=True)
class EvaluatedAverageState:
    params: Arrays
    round: int = 0
    mean_loss: float | None = None  # of the model after the last round's update, on its devices


def _mean(total: Mapping[str, np.ndarray], field: str, step: str) -> np.ndarray:
    count = int(total["count"])
    if count == 0:
        raise ValueError(f"no device contributed to the {step!r} sum")
    return np.asarray(total[field], dtype=np.float64) / count


class EvaluatedAverageServer:
    name = "evaluated_average"

    def __init__(self, options: EvaluatedAverageOptions) -> None:
        self.options = options

    def init(self, params: Arrays) -> EvaluatedAverageState:
        return EvaluatedAverageState(dict(params))

    def steps(self, state: EvaluatedAverageState) -> list[StepSpec]:
        opts = self.options
        dim = sum(np.size(v) for v in state.params.values())
        return [
            StepSpec(UPDATE, PayloadSchema((Field("delta", (dim,), clip=opts.delta_clip, frac_bits=opts.frac_bits),
                                            COUNT))),
            StepSpec(EVALUATE, PayloadSchema((Field("loss", (), clip=opts.loss_clip, frac_bits=opts.frac_bits),
                                              COUNT))),
        ]

    def broadcast(self, state: EvaluatedAverageState, step: str) -> Arrays:
        return dict(state.params)

    def apply(self, state: EvaluatedAverageState, step: str, total: Mapping[str, np.ndarray]
              ) -> EvaluatedAverageState:
        if step == UPDATE:
            moved = flatten(state.params) + self.options.server_lr * _mean(total, "delta", step)
            return replace(state, params=unflatten(moved, state.params))
        if step == EVALUATE:
            return replace(state, mean_loss=float(_mean(total, "loss", step)), round=state.round + 1)
        raise ValueError(f"unknown evaluated_average step {step!r}")

    def model(self, state: EvaluatedAverageState) -> Arrays:
        return state.params


class EvaluatedAverageClient:
    def __init__(self, options: EvaluatedAverageOptions) -> None:
        self.options = options

    def contribute(self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
                   ) -> tuple[Arrays, Any]:
        opts = self.options
        if step == UPDATE:
            trained, _ = device.train(broadcast, opts.local_epochs, opts.local_lr, opts.batch_size)
            delta = flatten(trained) - flatten(broadcast)
            return {"delta": delta, "count": np.int64(1)}, (local_state or 0) + 1
        if step == EVALUATE:
            loss, _ = device.evaluate(broadcast)
            return {"loss": np.float64(loss), "count": np.int64(1)}, local_state
        raise ValueError(f"unknown evaluated_average step {step!r}")


def make_server(options: Mapping[str, Any] | None) -> EvaluatedAverageServer:
    """The factory ``tally.coordinator.spec.catalogue.register_algorithm`` takes."""
    return EvaluatedAverageServer(EvaluatedAverageOptions.from_dict(options))

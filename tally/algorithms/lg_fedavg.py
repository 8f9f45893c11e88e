"""LG-FedAvg (Liang et al. 2019): local representations, a global part, only the global part summed
(specs/lg-fedavg.md).

Every parameter whose name matches one of ``global_patterns`` (``fnmatch``, e.g. ``"2.*"`` for the
built-in mlp's head) is global; every other parameter is local to each device. The split is by
name, not by position, because the paper's CIFAR model shares the *bottom* conv layers and keeps
the classifier local (spec 2.2).

The spec's two-phase schedule (3.4):

1. ``warmup_rounds`` rounds of FedAvg on the whole model (the paper runs them until a goal
   accuracy; a server that sees only sums has no test set, so here it is a round count).
2. LG rounds: each device trains its local layers and its copy of the global part together on
   one loss (one ``device.train`` on the whole model), keeps the local layers in ``local_state``
   and contributes FedAvg's sums over the *global* parameters only: Σ w·Δθ^g and Σ w. The local
   layers never enter a payload; the step's schema has exactly |θ^g| + 2 values.

The server keeps the whole model: the global part moves with the sums, the local part stays the
warm-start value at the switch ("copy the FedAvg model to every device"). It is broadcast with
the global part, so a device first sampled in phase 2 starts its local layers from it; a device
that has local layers ignores it. Downlink is therefore |θ| per device (the paper counts |θ^g|),
uplink |θ^g|; ``upload_accounting`` states both. The server's model, and so the coordinator's ONNX
export, is the warm-start local part with the current global part: the model a new device gets.

Aggregation is FedAvg's delta form with its weights w = min(n, cap)/cap, which for devices below
the cap is the spec's Σ N_m θ_m^g / Σ N_m (the broadcast θ^g is common, so averaging parameters
and averaging deltas coincide). With every parameter global an LG round *is* a FedAvg round, bit
for bit (spec 11.A.2); with none there is nothing to sum and the job is refused.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from tally.algorithms.base import Arrays, LocalTrainer, ModelMismatch, StepSpec
from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer, FedAvgState

WARMUP = "warmup"
GLOBAL = "global"


@dataclass(frozen=True)
class LGFedAvgOptions(FedAvgOptions):
    """FedAvg's options (its sums over the global part) with the paper's MNIST defaults, plus
    the split and the warm-up length."""

    options_of: ClassVar[str] = "lg_fedavg"

    local_epochs: int = 1
    local_lr: float = 0.05
    batch_size: int = 10
    global_patterns: tuple[str, ...] = ("2.*",)
    warmup_rounds: int = 0

    def __post_init__(self) -> None:
        if not self.global_patterns or not all(isinstance(p, str) and p for p in self.global_patterns):
            raise ValueError("global_patterns must list at least one parameter-name pattern (nothing else is summed)")
        if self.warmup_rounds < 0:
            raise ValueError(f"warmup_rounds must be >= 0, got {self.warmup_rounds}")


@dataclass(frozen=True)
class Split:
    """Which parameter names are global, by pattern; order follows the model's."""

    patterns: tuple[str, ...]

    def is_global(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def global_part(self, params: Mapping[str, np.ndarray]) -> Arrays:
        return {k: v for k, v in params.items() if self.is_global(k)}

    def local_part(self, params: Mapping[str, np.ndarray]) -> Arrays:
        return {k: v for k, v in params.items() if not self.is_global(k)}

    def check(self, params: Mapping[str, np.ndarray]) -> None:
        if not self.global_part(params):
            raise ValueError(f"global_patterns {list(self.patterns)} match none of the model's parameters "
                             f"{list(params)}: nothing would be summed")


@dataclass(frozen=True)
class LGFedAvgState:
    params: Arrays  # the global part current, the local part the warm-start value
    round: int = 0


class LGFedAvgServer:
    name = "lg_fedavg"

    def __init__(self, options: LGFedAvgOptions | None = None) -> None:
        self.options = options or LGFedAvgOptions()
        self.split = Split(self.options.global_patterns)
        self._fedavg = FedAvgServer(FedAvgOptions.part_of(self.options))

    def init(self, params: Arrays) -> LGFedAvgState:
        self.split.check(params)
        return LGFedAvgState(dict(params))

    def warming_up(self, state: LGFedAvgState) -> bool:
        return state.round < self.options.warmup_rounds

    def summed(self, state: LGFedAvgState) -> Arrays:
        """The parameters this round's sums carry: all of them in warm-up, else the global part."""
        return dict(state.params) if self.warming_up(state) else self.split.global_part(state.params)

    def steps(self, state: LGFedAvgState) -> list[StepSpec]:
        (update,) = self._fedavg.steps(FedAvgState(self.summed(state)))
        return [replace(update, name=WARMUP if self.warming_up(state) else GLOBAL)]

    def broadcast(self, state: LGFedAvgState, step: str) -> Arrays:
        return dict(state.params)

    def apply(self, state: LGFedAvgState, step: str, total: Mapping[str, np.ndarray]) -> LGFedAvgState:
        expected = WARMUP if self.warming_up(state) else GLOBAL
        if step != expected:
            raise ValueError(f"round {state.round} is a {expected!r} round, got a sum of step {step!r}")
        moved = self._fedavg.apply(FedAvgState(self.summed(state)), "update", total).params
        return replace(state, params={**state.params, **moved}, round=state.round + 1)

    def model(self, state: LGFedAvgState) -> Arrays:
        return state.params


class PersonalTrainer:
    """A device's trainer seen through its local layers: it trains the whole model (local and
    global parts on one loss) but takes and returns only the global part, keeping the trained
    local layers in ``local``. FedAvg's client half then computes its sums over the global part."""

    def __init__(self, device: LocalTrainer, local: Arrays, order: Sequence[str]) -> None:
        self.device = device
        self.local = local
        self.order = tuple(order)

    @property
    def num_examples(self) -> int:
        return self.device.num_examples

    def whole(self, global_params: Mapping[str, np.ndarray]) -> Arrays:
        return {k: self.local[k] if k in self.local else global_params[k] for k in self.order}

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        trained, loss = self.device.train(self.whole(params), epochs, lr, batch_size)
        self.local = {k: trained[k] for k in self.local}
        return {k: trained[k] for k in params}, loss

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        return self.device.evaluate(self.whole(params))


def personal_model(split: Split, broadcast: Mapping[str, np.ndarray], local_state: Mapping[str, np.ndarray] | None
                   ) -> Arrays:
    """The model a device uses: its own local layers (the broadcast's warm-start ones before it
    has any) with the global part."""
    local = local_layers(split, broadcast, local_state)
    return {k: local.get(k, v) for k, v in broadcast.items()}


def local_layers(split: Split, broadcast: Mapping[str, np.ndarray], local_state: Mapping[str, np.ndarray] | None
                 ) -> Arrays:
    expected = split.local_part(broadcast)
    if local_state is None:
        return {k: np.array(v, copy=True) for k, v in expected.items()}
    if set(local_state) != set(expected) or any(np.shape(local_state[k]) != np.shape(v) for k, v in expected.items()):
        raise ModelMismatch(f"this device's local layers {sorted(local_state)} do not fit the job's local part "
                            f"{sorted(expected)}")
    return dict(local_state)


class LGFedAvgClient:
    def __init__(self, options: LGFedAvgOptions | None = None) -> None:
        self.options = options or LGFedAvgOptions()
        self.split = Split(self.options.global_patterns)
        self._fedavg = FedAvgClient(FedAvgOptions.part_of(self.options))

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
    ) -> tuple[Arrays, Any]:
        if step == WARMUP:
            return self._fedavg.contribute(step, broadcast, device, local_state)
        if step != GLOBAL:
            raise ValueError(f"unknown lg_fedavg step {step!r}")
        personal = PersonalTrainer(device, local_layers(self.split, broadcast, local_state), list(broadcast))
        payload, _ = self._fedavg.contribute(step, self.split.global_part(broadcast), personal, None)
        return payload, personal.local

    def personal_model(self, model: Mapping[str, np.ndarray], local_state: Any, validation: Any = None) -> Arrays:
        """The device's own local layers with the global part (nothing is tuned)."""
        return personal_model(self.split, model, local_state)


# -- inference for a new device (spec 5) ----------------------------------------------------------


def ensemble_logits(logits: Callable[[Mapping[str, np.ndarray]], np.ndarray], model: Mapping[str, np.ndarray],
                    local_states: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
    """New Test: x through every device's local layers with the shared global part, the *logits*
    averaged (spec 11.A.7: averaging log-softmax instead can change the argmax; [C]'s MLP averages
    softmax). ``logits(params)`` evaluates one whole model on the new device's inputs.

    Its cost, which ``ensemble_cost`` states: every device's local layers must be on the
    evaluating machine, i.e. uploaded once *individually* (the one place LG-FedAvg is not
    sum-only), and each prediction takes M forward passes instead of one."""
    if not local_states:
        raise ValueError("the ensemble needs at least one device's local layers")
    return np.mean([logits({**model, **local}) for local in local_states], axis=0)


def ensemble_cost(model: Mapping[str, np.ndarray], split: Split, devices: int) -> dict[str, int]:
    local_values = sum(int(v.size) for v in split.local_part(model).values())
    return {"devices": devices, "local_values_per_device": local_values,
            "one_time_upload_values": devices * local_values, "forward_passes_per_prediction": devices}


# -- communication accounting (spec 8.7 / 11.B) ----------------------------------------------------


def paper_communication(rounds_full: int, rounds_lg: int, total_params: int, global_params: int,
                        devices: int, fraction: float) -> float:
    """The paper's count: a broadcast to all M devices and an upload from C·M of them per round,
    full model in the FedAvg rounds and the global part in the LG rounds."""
    return (devices + fraction * devices) * (rounds_full * total_params + rounds_lg * global_params)


def upload_accounting(server: LGFedAvgServer, state: LGFedAvgState, rounds: int, cohort: int) -> dict[str, Any]:
    """Values Tally moves for ``rounds`` rounds from ``state`` with ``cohort`` devices a round,
    against FedAvg on the same model for the same rounds (its upload is |θ| + 2 per device)."""
    total = sum(int(v.size) for v in state.params.values())
    uploads = downloads = 0
    for r in range(rounds):
        at = replace(state, round=state.round + r)
        (step,) = server.steps(at)
        uploads += cohort * step.schema.dim
        downloads += cohort * total
    fedavg = rounds * cohort * (total + 2)
    return {"rounds": rounds, "cohort": cohort, "model_values": total,
            "global_values": sum(int(v.size) for v in server.split.global_part(state.params).values()),
            "uploaded_values": uploads, "fedavg_uploaded_values": fedavg, "upload_ratio": uploads / fedavg,
            "downloaded_values": downloads}

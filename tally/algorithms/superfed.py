"""SuPerFed (Hahn et al., KDD 2022; dissertation chapter II): a personal model mixed with the
federated one, only the federated one summed (specs/superfed.md).

Each device keeps a personal model θ^l of the job's architecture in ``local_state`` (initialised
from the device's own seed, never sent) and trains it together with its copy θ^f of the global
model on the random interpolation θ(λ) = (1 − λ)θ^f + λθ^l, λ ~ U(0, 1) per mini-batch (``"model"``
mixing, MM) or per module (``"layer"`` mixing, LM), with the proximal term (μ/2)||θ^f − θ^g||² and
the orthogonality term ν·cos²(θ^f, θ^l). The upload is FedAvg's: Σ w·(θ^f − θ^g) and Σ w, so the
server is plain n-weighted FedAvg over sums and the schema never holds a personal value.

Rounds t < ``start_round`` (the thesis's L, here an absolute round) are the FedProx phase: λ = 0,
θ^l frozen, ν off (the authors' code, spec 2.2). The broadcast carries the phase and the round's
learning-rate factor ``lr_decay``^t under ``CONTROL``, the one-bit flag of Algorithm 2.3.

A device's personal model is θ(λ) with the λ it picks on its *own validation split* from
{0, 0.1, ..., 1} (``personal_model``); the paper's numbers are best-over-λ on test data, which this
never does. Choices the thesis leaves open follow the spec's section 9: the thesis prox form
(``prox_form="code"`` for the per-layer norm), every parameter mixed and summed
(``mix_biases=False`` gives weights alone a personal twin, as the code does), a fresh optimiser each
round. Momentum and weight decay default to 0, as Tally's FedAvg trains; the thesis uses 0.9
and 1e-4.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from tally.algorithms.base import Arrays, LocalTrainer, StepSpec
from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer, FedAvgState

STEP = "update"
CONTROL = "superfed.control"  # [mixing on (0/1), learning-rate factor]
LAMBDA_GRID = tuple(round(0.1 * i, 1) for i in range(11))


class MixingDevice(Protocol):
    """What SuPerFed needs from a device beyond ``LocalTrainer``
    (``tally.training.personal.MixingTrainer`` implements it with torch)."""

    @property
    def num_examples(self) -> int: ...

    def initial_local(self) -> Arrays: ...

    def train_mixed(self, federated: Mapping[str, np.ndarray], local: Mapping[str, np.ndarray], epochs: int,
                    lr: float, batch_size: int, *, mixing: str, mu: float, nu: float, prox_form: str,
                    momentum: float, weight_decay: float, twins: Collection[str]) -> tuple[Arrays, Arrays, float]: ...

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]: ...


@dataclass(frozen=True)
class SuPerFedOptions(FedAvgOptions):
    """FedAvg's options (the federated model's sums) with the spec's toy defaults, plus mixing."""

    options_of: ClassVar[str] = "superfed"

    local_epochs: int = 2
    local_lr: float = 0.05
    batch_size: int = 10
    mixing: str = "model"  # "model" (MM) or "layer" (LM)
    start_round: int = 0  # L: rounds before it are FedProx with the personal model frozen
    mu: float = 0.01
    nu: float = 1.0
    prox_form: str = "thesis"
    lr_decay: float = 0.99
    momentum: float = 0.0
    weight_decay: float = 0.0
    mix_biases: bool = True  # False: only weights have a personal twin (the authors' code)

    def __post_init__(self) -> None:
        if self.mixing not in ("model", "layer"):
            raise ValueError(f"mixing must be 'model' or 'layer', got {self.mixing!r}")
        if self.prox_form not in ("thesis", "code"):
            raise ValueError(f"prox_form must be 'thesis' or 'code', got {self.prox_form!r}")
        if self.start_round < 0 or self.mu < 0 or self.nu < 0 or not 0 < self.lr_decay <= 1:
            raise ValueError("start_round, mu and nu must be >= 0 and lr_decay in (0, 1]")


class SuPerFedServer:
    """Plain FedAvg over the federated model's sums, plus the round's control broadcast."""

    name = "superfed"

    def __init__(self, options: SuPerFedOptions | None = None) -> None:
        self.options = options or SuPerFedOptions()
        self._fedavg = FedAvgServer(FedAvgOptions.part_of(self.options))

    def init(self, params: Arrays) -> FedAvgState:
        if CONTROL in params:
            raise ValueError(f"a model parameter may not be named {CONTROL!r}")
        return FedAvgState(dict(params))

    def steps(self, state: FedAvgState) -> list[StepSpec]:
        return self._fedavg.steps(state)

    def broadcast(self, state: FedAvgState, step: str) -> Arrays:
        opts = self.options
        control = np.array([float(state.round >= opts.start_round), opts.lr_decay**state.round])
        return {**state.params, CONTROL: control}

    def apply(self, state: FedAvgState, step: str, total: Mapping[str, np.ndarray]) -> FedAvgState:
        return self._fedavg.apply(state, step, total)

    def model(self, state: FedAvgState) -> Arrays:
        return state.params


def twins(options: SuPerFedOptions, names: Collection[str]) -> list[str]:
    """The parameters with a personal twin: all (the thesis) or the weights only (the code)."""
    return [k for k in names if options.mix_biases or k.endswith("weight")]


def mix(federated: Mapping[str, np.ndarray], local: Mapping[str, np.ndarray], lam: float,
        paired: Collection[str] | None = None) -> Arrays:
    """θ(λ) = (1 − λ)θ^f + λθ^l (θ(0) the federated model, θ(1) the personal one); parameters
    outside ``paired`` (default: all are paired) are the federated ones."""
    return {k: ((1 - lam) * np.asarray(v, np.float64) + lam * np.asarray(local[k], np.float64)).astype(
        np.asarray(v).dtype) if paired is None or k in paired else v for k, v in federated.items()}


class _MixingAsTrainer:
    """The device seen as FedAvg's ``LocalTrainer``: train() runs the mixed training and keeps the
    personal model, returning only θ^f."""

    def __init__(self, device: MixingDevice, local: Arrays, options: SuPerFedOptions, mixing: bool, lr_factor: float):
        self.device, self.local, self.options = device, local, options
        self.mixing, self.lr_factor = mixing, lr_factor

    @property
    def num_examples(self) -> int:
        return self.device.num_examples

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        opts = self.options
        federated, self.local, loss = self.device.train_mixed(
            params, self.local, epochs, lr * self.lr_factor, batch_size,
            mixing=opts.mixing if self.mixing else "none", mu=opts.mu, nu=opts.nu, prox_form=opts.prox_form,
            momentum=opts.momentum, weight_decay=opts.weight_decay, twins=twins(opts, params),
        )
        return federated, loss


class SuPerFedClient:
    def __init__(self, options: SuPerFedOptions | None = None) -> None:
        self.options = options or SuPerFedOptions()
        self._fedavg = FedAvgClient(FedAvgOptions.part_of(self.options))

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: MixingDevice, local_state: Any
    ) -> tuple[Arrays, Any]:
        if step != STEP:
            raise ValueError(f"unknown superfed step {step!r}")
        if CONTROL not in broadcast:
            raise ValueError(f"the broadcast lacks {CONTROL!r}: not a superfed round")
        mixing, lr_factor = (float(x) for x in np.asarray(broadcast[CONTROL]).ravel())
        model = {k: v for k, v in broadcast.items() if k != CONTROL}
        local = dict(local_state) if local_state is not None else device.initial_local()
        trainer = _MixingAsTrainer(device, local, self.options, mixing > 0.5, lr_factor)
        payload, _ = self._fedavg.contribute(step, model, trainer, None)
        return payload, trainer.local

    def choose_lambda(self, model: Mapping[str, np.ndarray], local_state: Any, validation: LocalTrainer | None
                      ) -> tuple[float, list[float]]:
        """The λ of the grid with the best accuracy on ``validation`` (ties: the smaller λ) and the
        accuracy at every grid point. A device passes its validation split; only a report showing
        the paper's optimistic protocol passes a test split."""
        if local_state is None or validation is None or validation.num_examples == 0:
            return 0.0, []
        paired = twins(self.options, model)
        curve = [validation.evaluate(mix(model, local_state, lam, paired))[1] for lam in LAMBDA_GRID]
        return LAMBDA_GRID[int(np.argmax(curve))], curve

    def personal_model(self, model: Mapping[str, np.ndarray], local_state: Any,
                       validation: LocalTrainer | None = None) -> Arrays:
        lam, _ = self.choose_lambda(model, local_state, validation)
        return dict(model) if local_state is None else mix(model, local_state, lam, twins(self.options, model))


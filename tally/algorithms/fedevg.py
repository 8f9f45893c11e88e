"""FedEvg (dissertation chapter IV; ``docs/specs/fedevg.md``): a labelled synthetic set refined by
the energy signals of the devices' classifiers, read as energy-based models.

No model parameter ever leaves a device. The server holds the synthetic set; each round it
broadcasts it, each device trains its own energy model (kept in ``local_state`` across rounds,
never uploaded) and returns, for every synthetic sample j, its energy signals pre-multiplied by
its weight n_i: ``(n_i s_ij g_ij, n_i s_ij)``, where g_ij is the input gradient of the joint
energy and s_ij the sample's mixture weight. The secure sum adds them over the cohort; the
server divides the two sums (Eq. 4.13) and takes one Langevin step (Eq. 4.14). Only those two
sums are seen, which the server needs anyway.

``s_ij = exp(sgn(f_i(x_j)[y_j]))`` by default (the thesis' sign trick: bounded, so it fits a
fixed-point ring). ``weighting: exact`` uses ``exp(f)`` with the logit clamped to a public bound
(``logit_clamp``): the exact mixture of Eq. 4.13 is unbounded, and without a clamp one confident
device's weight overflows the sum (the instability the thesis describes; spec §6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from tally.algorithms.base import Arrays, Options, StepSpec
from tally.codec import Field, PayloadSchema

STEP = "energy"
SYNTHETIC_X, SYNTHETIC_Y = "synthetic_x", "synthetic_y"
WEIGHTINGS = ("sign", "exact")


@dataclass(frozen=True)
class FedEvgOptions(Options):
    options_of: ClassVar[str] = "fedevg"

    classes: int = 10  # L
    inputs: int = 64  # D
    per_class: int = 10  # spc: M = L * spc synthetic samples
    # Server SGLD (Eq. 4.14): beta from step_start to step_end over schedule_rounds, noise delta.
    step_start: float = 10.0
    step_end: float = 0.01
    schedule_rounds: int = 500
    noise: float = 0.01
    input_range: tuple[float, float] | None = None  # clip synthetic inputs (images in [0, 1])
    # Device: E iterations of batch B at learning rate eta; R = 1 SGLD step gamma, sigma.
    local_iterations: int = 20
    local_lr: float = 1e-3
    batch_size: int = 64
    sgld_step: float = 1.0
    sgld_noise: float = 0.01
    synthetic_weight: float = 0.1  # lambda
    persistent_model: bool = True  # keep the energy model across rounds (False: the code's re-init)
    gradient_clip: float = 3.0  # |g| bound on the uploaded energy gradients (the code's ±3)
    weighting: str = "sign"
    logit_clamp: float = 5.0  # exact weighting only: s = exp(clip(f, -c, c))
    example_cap: int = 1000  # n_i is counted up to this many examples
    frac_bits: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {list(WEIGHTINGS)}, got {self.weighting!r}")
        if min(self.classes, self.inputs, self.per_class, self.schedule_rounds, self.example_cap) < 1:
            raise ValueError("classes, inputs, per_class, schedule_rounds and example_cap must be >= 1")
        if self.gradient_clip <= 0 or self.logit_clamp <= 0:
            raise ValueError("gradient_clip and logit_clamp must be positive")
        if self.input_range is not None and not self.input_range[0] < self.input_range[1]:
            raise ValueError(f"input_range must be (low, high) with low < high, got {self.input_range}")

    @property
    def samples(self) -> int:
        return self.classes * self.per_class

    @property
    def max_weight(self) -> float:
        """The largest s_ij: e under the sign trick, exp(clamp) under exact weighting."""
        return math.e if self.weighting == "sign" else math.exp(self.logit_clamp)


def step_size(options: FedEvgOptions, round_: int) -> float:
    """beta^(t): cosine annealing from step_start (t = 0) to step_end (t = T - 1), then flat."""
    last = options.schedule_rounds - 1
    progress = min(round_, last) / last if last > 0 else 1.0
    return options.step_end + (options.step_start - options.step_end) * (1 + math.cos(math.pi * progress)) / 2


def initial_synthetic(options: FedEvgOptions) -> Arrays:
    """Eq. 4.12: inputs from N(0, I), exactly ``per_class`` samples of each class (labels fixed)."""
    rng = np.random.default_rng([options.seed, 412])
    return {
        SYNTHETIC_X: rng.standard_normal((options.samples, options.inputs)),
        SYNTHETIC_Y: np.repeat(np.arange(options.classes), options.per_class).astype(np.int64),
    }


def mixture_gradient(weighted_gradient: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """G_j = sum_i w_i s_ij g_ij / sum_i w_i s_ij (Eq. 4.13 from the two sums), shape (M, D)."""
    weight = np.asarray(weight, dtype=np.float64)
    if np.any(weight <= 0):
        raise ValueError("a synthetic sample's total weight is zero: no device contributed")
    return np.asarray(weighted_gradient, dtype=np.float64).reshape(weight.size, -1) / weight[:, None]


def sample_weights(logits_at_label: np.ndarray, options: FedEvgOptions) -> np.ndarray:
    """s_ij from f_i(x_j)[y_j]: exp(sgn f) (sign trick) or exp(clip(f, -c, c)) (exact, clamped)."""
    f = np.asarray(logits_at_label, dtype=np.float64)
    if options.weighting == "sign":
        return np.exp(np.sign(f))
    return np.exp(np.clip(f, -options.logit_clamp, options.logit_clamp))


@dataclass(frozen=True)
class FedEvgState:
    synthetic: Arrays
    classifier: Arrays  # the initial energy model every device starts from
    round: int = 0


class FedEvgServer:
    name = "fedevg"

    def __init__(self, options: FedEvgOptions | None = None) -> None:
        self.options = options or FedEvgOptions()

    def init(self, params: Arrays) -> FedEvgState:
        """``params``: the job's model, the energy model devices start from (never summed)."""
        return FedEvgState(initial_synthetic(self.options), dict(params))

    def steps(self, state: FedEvgState) -> list[StepSpec]:
        opts = self.options
        bound = opts.max_weight
        schema = PayloadSchema((
            Field("weighted_gradient", (opts.samples * opts.inputs,), clip=bound * opts.gradient_clip,
                  frac_bits=opts.frac_bits),
            Field("weight", (opts.samples,), clip=bound, frac_bits=opts.frac_bits),
        ))
        return [StepSpec(STEP, schema)]

    def broadcast(self, state: FedEvgState, step: str) -> Arrays:
        return {**state.classifier, **state.synthetic}

    def apply(self, state: FedEvgState, step: str, total: Mapping[str, np.ndarray]) -> FedEvgState:
        opts = self.options
        gradient = mixture_gradient(total["weighted_gradient"], total["weight"])
        noise = np.random.default_rng([opts.seed, 414, state.round]).standard_normal(gradient.shape)
        x = state.synthetic[SYNTHETIC_X] - step_size(opts, state.round) * gradient + opts.noise * noise
        if opts.input_range is not None:
            x = np.clip(x, *opts.input_range)
        synthetic = {**state.synthetic, SYNTHETIC_X: x}
        return replace(state, synthetic=synthetic, round=state.round + 1)

    def model(self, state: FedEvgState) -> Arrays:
        """What FedEvg produces: the synthetic set (its labels never change)."""
        return dict(state.synthetic)


class EnergyDevice(Protocol):
    """What FedEvg needs from a device: its data count, local training of its energy model, and
    the energy signals at given points. ``tally.training.energy.EnergyTrainer`` implements it."""

    @property
    def num_examples(self) -> int: ...

    def train_energy(self, params: Mapping[str, np.ndarray], synthetic_x: np.ndarray, synthetic_y: np.ndarray,
                     options: FedEvgOptions) -> Arrays:
        """The energy model after ``local_iterations`` steps of CE + lambda CE(synthetic) + PCD
        from ``params``, with persistent SGLD chains started at the synthetic set."""
        ...

    def energy_signals(self, params: Mapping[str, np.ndarray], x: np.ndarray,
                       y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(f(x_j)[y_j], grad_x E(x_j, y_j) = -grad_x f(x_j)[y_j]) for every row j."""
        ...


class FedEvgClient:
    def __init__(self, options: FedEvgOptions | None = None) -> None:
        self.options = options or FedEvgOptions()

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: EnergyDevice, local_state: Any
    ) -> tuple[Arrays, Any]:
        opts = self.options
        x = np.asarray(broadcast[SYNTHETIC_X], dtype=np.float64)
        y = np.asarray(broadcast[SYNTHETIC_Y]).astype(np.int64)
        if x.shape != (opts.samples, opts.inputs) or y.shape != (opts.samples,):
            raise ValueError(f"synthetic set of shape {x.shape}/{y.shape}, expected "
                             f"({opts.samples}, {opts.inputs})/({opts.samples},)")
        start = {k: v for k, v in broadcast.items() if k not in (SYNTHETIC_X, SYNTHETIC_Y)}
        if opts.persistent_model and local_state is not None:
            start = local_state
        params = device.train_energy(start, x.copy(), y, opts)  # the device's chains move a copy
        logits, gradient = device.energy_signals(params, x, y)  # at the set as downloaded
        s = sample_weights(logits, opts)
        n = min(device.num_examples, opts.example_cap) / opts.example_cap
        g = np.clip(np.asarray(gradient, dtype=np.float64), -opts.gradient_clip, opts.gradient_clip)
        values = {"weighted_gradient": (n * s[:, None] * g).ravel(), "weight": n * s}
        return values, (params if opts.persistent_model else None)

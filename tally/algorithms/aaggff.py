"""AAggFF (Hahn et al., ICML 2024; dissertation chapter III) over secure sums: AAggFF-D and AAggFF-S.

AAggFF replaces FedAvg's static weights n_i/n by mixing coefficients p on the simplex that the server
learns online, as a portfolio problem. Each device's *response* is a CDF of its loss relative to the
round's mean loss, r_i = C1 + (C2-C1)·CDF(F_i/F̄); the decision loss is -log(1 + <p, r>); devices
whose loss is high get more weight. Specification: ``specs/aaggff.md`` (sections cited as §n below).

**AAggFF-D** (cross-device, sampled cohorts; §3.3): FTRL with the entropic regulariser on the linearised
gradient of the doubly-robust response estimate. Its decision is separable (§3.3, "structural fact"):
p_i ∝ exp(-D_i/ζ) with D_i = Σ_{rounds i was sampled} -(r̂_i - r̄)/(1 + r̄), so every device keeps its
own accumulator D_i in ``local_state`` and the server sees only sums (§4). A round is three secure
sums (DESIGN.md section 4):

1. ``loss``: Σ F_i, Σ 1 and Σ exp(-D_i/ζ - c). Devices evaluate the received model on their training
   data *before* training (§3.1), then train; the update waits in ``local_state`` (training overlaps
   sums 1-2, as the spec allows). The third field sets the public log offset c (see "fixed point").
2. ``response``: with F̄ broadcast, each device computes r_i itself; Σ r_i, Σ 1 give r̄.
3. ``update``: with r̄ broadcast, each device updates D_i and its weight w_i = exp(-D_i/ζ - c);
   Σ w_i·Δ_i and Σ w_i give θ ← θ + Σ w_iΔ_i / Σ w_i = θ + Σ_{i∈S} p̃_i Δ_i (Algorithm 3.2).

The server learns per round what the spec lists (F̄, r̄, Σ_S w_i, the aggregate update) plus the
cohort's normaliser before the update, Σ_S exp(-D_i/ζ - c): an aggregate of the same kind.

**AAggFF-S** (cross-silo, every silo every round; §3.2) has two solvers (``solver`` option):

* ``"ons"``, the online Newton step as specified: a K-dimensional QP over the simplex whose matrix
  couples all silos' responses, so the server needs each silo's response r_i in the clear. This is the
  one documented exception to the sums-only rule (DESIGN.md section 1): :class:`AAggFFSServer` refuses
  to be constructed unless the options say ``reveal: ["response"]``. The ``response`` step is then a
  :class:`~tally.algorithms.base.StepSpec` with ``reveal=("response",)`` and the ``update`` step one
  with ``personal=True``: each silo gets only its own p_i (§4: sending everyone p would leak the
  others' histories), and Σ p_i·Δ_i, Σ p_i are secure sums. What a runner must do with those flags
  is in :class:`~tally.algorithms.base.StepSpec`; ``revealed_values(state)`` and ``on_reveal`` let
  it log and count reveals.
* ``"separable"``, the spec's secure-aggregation-compatible replacement (§4, option 3): entropic FTRL
  with the *true* gradient g_i = -r_i/(1 + <p, r>), where <p, r> = Σ p_i r_i is a secure sum and so
  is the softmax normaliser Z = Σ exp(-G_i/ζ - c). Same three sums as AAggFF-D; regret O(√(T log K))
  instead of O(K log T).

**Fixed point.** The weights exp(-D_i/ζ) span any range over a long run, so devices scale them by a
public offset c that the server derives from sums only: after sum 1, c ← c + log Σ exp(-D_i/ζ - c),
which makes the cohort's weights sum to about 1 (exactly 1 for the separable solver's p^(t)). Between
sum 1 and sum 3 a device's log-weight moves by at most |δ|/ζ^(t+1) ≤ √(log K)/(2√2) nats for
AAggFF-D (Lemma 3.5's bound on δ against ζ; 1.3 nats for K = 10^6) and by at most about
0.9·√(log K) for the separable solver (|g| ≤ L∞ plus the change of ζ; 1.9 nats for K = 100 silos),
so ``weight_clip`` = 8 (e^2.08) leaves room; a clipped weight is counted by the codec, never silent.
Scalars (losses, responses, scales, weights) use 24 fraction bits; the summed update w·Δ uses
``frac_bits`` (default 18: with ``delta_clip`` 4 and ``weight_clip`` 8 one value is ≤ 2^23, so a
32-bit ring holds cohorts up to 256). The scale field spans [2^-24, 2^16] around the offset, ample
for the drift from one cohort to the next; losses are clipped at ``loss_clip`` in the sum only.

**Where we deviate from the thesis or the spec, deliberately:**

* The spec (§4) says to use the final survivor set in every mean. The final set is unknown when the
  first sums are formed, so each mean is over its own step's contributors: F̄ over sum 1, r̄ over
  sum 2; a device whose earlier contribution did not count sends zeros with count 0 later, and one
  whose sum-3 contribution did not count keeps its old D_i ("a lost D_i behaves like never sampled").
* ONS with a silo missing from the reveal (a dropout): the thesis assumes full participation; we
  impute the mean of the revealed responses for it (the DR imputation of §3.3 with C = 1).
* The code's departures (§9) are off by default and enabled by name in ``code_deviations``:
  ``response_range`` (S: C2 = 1/K), ``ons_objective`` (S, ONS: the code's quadratic),
  ``dr_estimate`` (D: the DR estimate without "+ r̄"), ``normal_cdf`` (the code's decreasing
  "normal" CDF; requires ``cdf: normal``), ``lr_schedule`` (the server learning rate is divided by
  the client decay factor φ every ``lr_decay_every`` rounds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from tally.algorithms.base import Arrays, LocalTrainer, Options, StepSpec, flatten, unflatten
from tally.algorithms.online_portfolio import (
    CDFS,
    OnsHistory,
    decision_gradient,
    decision_loss,
    dr_estimate,
    dr_lipschitz,
    entropic_decision,
    lipschitz,
    ons_constants,
    simplex_qp,
    step_size,
    transform_responses,
)
from tally.codec import Field, Kind, PayloadSchema

LOSS, RESPONSE, UPDATE = "loss", "response", "update"
SOLVERS = ("ons", "separable")
DEVIATIONS_D = ("dr_estimate", "normal_cdf", "lr_schedule")
DEVIATIONS_S = ("response_range", "ons_objective", "normal_cdf", "lr_schedule")
REVEALABLE = ("response",)

# Broadcast scalars carry an '@' prefix, which no torch state-dict key contains.
ROUND, OFFSET, ZETA = "@round", "@offset", "@zeta"
MEAN_LOSS, MEAN_RESPONSE, COEFFICIENT, DIM = "@mean_loss", "@mean_response", "@coefficient", "@dim"

SCALAR_FRAC_BITS = 24
SCALE_CLIP = 2.0**16
CODE_NORMAL_MAX = 1.5  # sup of ½(1 + erfc(·)), the code's "normal" CDF (§9.4)


class RevealRefused(ValueError):
    """AAggFF-S's online Newton step needs per-silo responses and the job did not opt in."""


# ----------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class _Common(Options):
    """Options shared by both variants. ``num_clients`` is K, the whole population (required)."""

    num_clients: int = 0
    local_epochs: int = 1
    local_lr: float = 0.1
    batch_size: int = 20
    server_lr: float = 1.0
    lr_decay: float = 1.0
    lr_decay_every: int = 0
    cdf: str = "normal"
    c1: float = 0.0
    c2: float | None = None
    delta_clip: float = 4.0
    loss_clip: float = 100.0
    weight_clip: float = 8.0
    frac_bits: int = 18
    code_deviations: tuple[str, ...] = ()

    ALLOWED_DEVIATIONS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.num_clients < 2:
            raise ValueError("num_clients (K, the whole population) must be given and at least 2")
        if self.cdf not in CDFS:
            raise ValueError(f"cdf must be one of {CDFS}, got {self.cdf!r}")
        unknown = set(self.code_deviations) - set(self.ALLOWED_DEVIATIONS)
        if unknown:
            raise ValueError(f"unknown code_deviations {sorted(unknown)} for {type(self).__name__}; "
                             f"available: {list(self.ALLOWED_DEVIATIONS)}")
        if "normal_cdf" in self.code_deviations and self.cdf != "normal":
            raise ValueError("code deviation 'normal_cdf' only changes cdf 'normal'")
        if not 0 < self.lr_decay <= 1 or self.lr_decay_every < 0:
            raise ValueError("lr_decay must lie in (0, 1] and lr_decay_every be >= 0 (0: never)")

    @property
    def code_normal(self) -> bool:
        return "normal_cdf" in self.code_deviations

    def lr_factor(self, round_: int) -> float:
        """φ^⌊t/s⌋: the client learning rate's decay at 0-based round t (§6.1)."""
        if self.lr_decay_every == 0:
            return 1.0
        return self.lr_decay ** (round_ // self.lr_decay_every)

    def server_lr_at(self, round_: int) -> float:
        """The code divides the server rate by the client decay, keeping η_l·η_g fixed (§9.5)."""
        if "lr_schedule" in self.code_deviations:
            return self.server_lr / self.lr_factor(round_)
        return self.server_lr


def _check_range(c1: float, c2: float) -> None:
    if not 0 <= c1 < c2:
        raise ValueError(f"responses need 0 <= c1 < c2, got [{c1}, {c2}]")


@dataclass(frozen=True)
class AAggFFDOptions(_Common):
    """AAggFF-D. ``cohort_size`` is ⌊C·K⌋ (default K, full participation): C = cohort_size/K, the
    inclusion probability of sampling without replacement (§3.3). Responses default to [0, C] (§2)."""

    options_of: ClassVar[str] = "aaggff_d"

    cohort_size: int | None = None

    ALLOWED_DEVIATIONS: ClassVar[tuple[str, ...]] = DEVIATIONS_D
    mode: ClassVar[str] = "dr"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.cohort_size is not None and not 1 <= self.cohort_size <= self.num_clients:
            raise ValueError(f"cohort_size must lie in [1, num_clients={self.num_clients}]")
        _check_range(*self.response_range)

    @property
    def sampling_rate(self) -> float:
        return (self.cohort_size or self.num_clients) / self.num_clients

    @property
    def response_range(self) -> tuple[float, float]:
        return self.c1, self.sampling_rate if self.c2 is None else self.c2

    @property
    def lipschitz(self) -> float:
        """L̃∞, the bound on the DR gradient estimate that sets ζ (Remark 3.7)."""
        return dr_lipschitz(*self.response_range, self.sampling_rate)


@dataclass(frozen=True)
class AAggFFSOptions(_Common):
    """AAggFF-S. ``solver``: "ons" (as specified; needs ``reveal: ["response"]``) or "separable"
    (sums only). Responses default to the thesis's [0, 3] (§2; the code's [0, 1/K] by flag)."""

    options_of: ClassVar[str] = "aaggff_s"

    solver: str = "ons"
    reveal: tuple[str, ...] = ()

    ALLOWED_DEVIATIONS: ClassVar[tuple[str, ...]] = DEVIATIONS_S
    sampling_rate: ClassVar[float] = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {self.solver!r}")
        unknown = set(self.reveal) - set(REVEALABLE)
        if unknown:
            raise ValueError(f"aaggff_s can reveal only {list(REVEALABLE)}, not {sorted(unknown)}")
        if "response_range" in self.code_deviations and self.c2 is not None:
            raise ValueError("code deviation 'response_range' sets c2 = 1/K; do not also give c2")
        if "ons_objective" in self.code_deviations and self.solver != "ons":
            raise ValueError("code deviation 'ons_objective' needs solver 'ons'")
        _check_range(*self.response_range)

    @property
    def mode(self) -> str:
        return "ons" if self.solver == "ons" else "exact"

    @property
    def response_range(self) -> tuple[float, float]:
        if self.c2 is not None:
            return self.c1, self.c2
        return self.c1, 1.0 / self.num_clients if "response_range" in self.code_deviations else 3.0

    @property
    def lipschitz(self) -> float:
        return lipschitz(*self.response_range)


AAggFFOptions = AAggFFDOptions | AAggFFSOptions


def _response_bound(options: AAggFFOptions) -> float:
    c1, c2 = options.response_range
    top = c1 + (c2 - c1) * (CODE_NORMAL_MAX if options.code_normal else 1.0)
    return max(abs(c1), abs(top))


# ----------------------------------------------------------------------------------------------
# Steps and schemas


def _scalar(name: str, clip: float) -> Field:
    return Field(name, (), clip=clip, frac_bits=SCALAR_FRAC_BITS)


COUNT = Field("count", (), kind=Kind.COUNT, clip=1)


def _update_fields(options: AAggFFOptions, dim: int, weight_clip: float) -> tuple[Field, ...]:
    return (
        Field("weighted_update", (dim,), clip=options.delta_clip * weight_clip, frac_bits=options.frac_bits),
        _scalar("weight", weight_clip),
        COUNT,
    )


def _model_dim(params: Arrays) -> int:
    return int(sum(v.size for v in params.values()))


def _apply_update(options: AAggFFOptions, params: Arrays, round_: int, total: Mapping[str, np.ndarray]) -> Arrays:
    """θ ← θ + η_g·Σ w_iΔ_i / Σ w_i (the division also renormalises over the survivors)."""
    weight = float(total["weight"])
    if weight <= 0:
        raise ValueError("the round's total weight is zero: no device contributed an update")
    mean = np.asarray(total["weighted_update"], dtype=np.float64) / weight
    return unflatten(flatten(params) + options.server_lr_at(round_) * mean, params)


def _mean(total: Mapping[str, np.ndarray], name: str, step: str) -> float:
    count = int(total["count"])
    if count <= 0:
        raise ValueError(f"no device contributed to the {step!r} sum")
    return float(total[name]) / count


# ----------------------------------------------------------------------------------------------
# Server halves


@dataclass(frozen=True)
class AccumulatorState:
    """Everything the server of AAggFF-D / separable AAggFF-S holds: the model and public aggregates."""

    params: Arrays
    round: int = 0
    offset: float = 0.0  # public log scale c of the device weights
    mean_loss: float = 0.0  # F̄ of this round (sum 1)
    mean_response: float = 0.0  # r̄ (AAggFF-D) or <p, r> (separable AAggFF-S) of this round (sum 2)


class _AccumulatorServer:
    """The sums-only server of AAggFF-D and of AAggFF-S's separable solver."""

    def __init__(self, options: AAggFFOptions) -> None:
        self.options = options

    def init(self, params: Arrays) -> AccumulatorState:
        return AccumulatorState(dict(params))

    def zeta(self, t: int) -> float:
        """ζ^(t) for 1-based round t."""
        return step_size(t, self.options.lipschitz, self.options.num_clients)

    def steps(self, state: AccumulatorState) -> list[StepSpec]:
        opts = self.options
        if opts.mode == "exact":  # Σ p_i r_i and Σ p_i give <p, r>; p_i ≤ 1 up to the quantisation of Z
            response_fields = (_scalar("weighted_response", 2.0 * _response_bound(opts)), _scalar("weight", 2.0), COUNT)
        else:
            response_fields = (_scalar("response", _response_bound(opts)), COUNT)
        return [
            StepSpec(LOSS, PayloadSchema((_scalar("loss", opts.loss_clip), _scalar("scale", SCALE_CLIP), COUNT))),
            StepSpec(RESPONSE, PayloadSchema(response_fields)),
            StepSpec(UPDATE, PayloadSchema(_update_fields(opts, _model_dim(state.params), opts.weight_clip))),
        ]

    def broadcast(self, state: AccumulatorState, step: str) -> Arrays:
        t = state.round + 1  # the thesis's 1-based round
        public = {ROUND: np.int64(state.round), OFFSET: np.float64(state.offset)}
        if step == LOSS:
            # Sum 1's scale field: AAggFF-D weighs by the coming decision (ζ^(t+1)); the separable
            # solver needs the current decision p^(t) exactly (ζ^(t)) for <p, r>.
            scale_t = t + 1 if self.options.mode == "dr" else t
            return {**state.params, **public, ZETA: np.float64(self.zeta(scale_t))}
        if step == RESPONSE:
            return {**public, MEAN_LOSS: np.float64(state.mean_loss), ZETA: np.float64(self.zeta(t))}
        if step == UPDATE:
            return {**public, MEAN_RESPONSE: np.float64(state.mean_response),
                    ZETA: np.float64(self.zeta(t + 1)), DIM: np.int64(_model_dim(state.params))}
        raise ValueError(f"unknown step {step!r}")

    def apply(self, state: AccumulatorState, step: str, total: Mapping[str, np.ndarray]) -> AccumulatorState:
        if step == LOSS:
            scale = float(total["scale"])
            if scale <= 0:
                raise ValueError("every device weight underflowed the fixed-point range of 'scale'")
            return replace(state, mean_loss=_mean(total, "loss", step), offset=state.offset + math.log(scale))
        if step == RESPONSE:
            if self.options.mode == "exact":
                weight = float(total["weight"])
                if weight <= 0:
                    raise ValueError("no device contributed to the 'response' sum")
                return replace(state, mean_response=float(total["weighted_response"]) / weight)
            return replace(state, mean_response=_mean(total, "response", step))
        if step == UPDATE:
            params = _apply_update(self.options, state.params, state.round, total)
            return replace(state, params=params, round=state.round + 1)
        raise ValueError(f"unknown step {step!r}")

    def model(self, state: AccumulatorState) -> Arrays:
        return state.params


class AAggFFDServer(_AccumulatorServer):
    """AAggFF-D's server half: three secure sums per round, no per-device value anywhere."""

    name = "aaggff_d"

    def __init__(self, options: AAggFFDOptions) -> None:
        super().__init__(options)


@dataclass(frozen=True)
class OnsState:
    """The ONS server's state. ``decision`` and ``history`` derive from revealed responses (opt-in)."""

    params: Arrays
    decision: np.ndarray
    history: OnsHistory
    round: int = 0
    mean_loss: float = 0.0
    revealed: int = 0  # per-device values received in the clear so far
    decision_loss: float = 0.0  # ℓ^(t)(p^(t)) of the last round, for logging regret


class _OnsServer:
    """AAggFF-S with the online Newton step (Algorithm 3.1, Eq. 3.7), over revealed responses."""

    def __init__(self, options: AAggFFSOptions, on_reveal: Callable[[int, Sequence[int]], None]) -> None:
        self.options = options
        self.on_reveal = on_reveal
        self.alpha, self.beta = ons_constants(options.num_clients, options.lipschitz)

    def init(self, params: Arrays) -> OnsState:
        k = self.options.num_clients
        return OnsState(dict(params), np.full(k, 1.0 / k), OnsHistory.empty(k))

    def steps(self, state: OnsState) -> list[StepSpec]:
        opts = self.options
        return [
            StepSpec(LOSS, PayloadSchema((_scalar("loss", opts.loss_clip), COUNT))),
            StepSpec(RESPONSE, PayloadSchema((_scalar("response", _response_bound(opts)), COUNT)),
                     reveal=("response",)),
            StepSpec(UPDATE, PayloadSchema(_update_fields(opts, _model_dim(state.params), 1.0)), personal=True),
        ]

    def broadcast(self, state: OnsState, step: str) -> Arrays:
        public = {ROUND: np.int64(state.round)}
        if step == LOSS:
            return {**state.params, **public}
        if step == RESPONSE:
            return {**public, MEAN_LOSS: np.float64(state.mean_loss)}
        if step == UPDATE:
            return {**public, DIM: np.int64(_model_dim(state.params))}
        raise ValueError(f"unknown step {step!r}")

    def broadcast_to(self, state: OnsState, step: str, device_id: int) -> Arrays:
        if step != UPDATE:
            raise ValueError(f"step {step!r} has one broadcast for every silo")
        if not 0 <= device_id < self.options.num_clients:
            raise ValueError(f"silo id {device_id} outside [0, {self.options.num_clients})")
        return {**self.broadcast(state, step), COEFFICIENT: np.float64(state.decision[device_id])}

    def apply(self, state: OnsState, step: str, total: Mapping[str, np.ndarray]) -> OnsState:
        if step == LOSS:
            return replace(state, mean_loss=_mean(total, "loss", step))
        if step == RESPONSE:
            present = np.asarray(total["count"]).reshape(-1) > 0
            return self._decide(state, np.asarray(total["device_ids"], dtype=np.int64)[present],
                                np.asarray(total["response"], dtype=np.float64).reshape(-1)[present])
        if step == UPDATE:
            params = _apply_update(self.options, state.params, state.round, total)
            return replace(state, params=params, round=state.round + 1)
        raise ValueError(f"unknown step {step!r}")

    def _decide(self, state: OnsState, ids: np.ndarray, values: np.ndarray) -> OnsState:
        """One ONS step: g^(t) at p^(t), then p^(t+1) = the QP of Eq. 3.7 (used in this round)."""
        k = self.options.num_clients
        if ids.size == 0:
            raise ValueError("no silo revealed its response")
        if ids.min() < 0 or ids.max() >= k or len(set(ids.tolist())) != ids.size:
            raise ValueError(f"revealed silo ids must be distinct and lie in [0, {k})")
        self.on_reveal(state.round, ids.tolist())
        responses = np.full(k, values.mean())  # a silo that did not answer: the DR imputation, C = 1
        responses[ids] = values
        gradient = decision_gradient(state.decision, responses)
        history = state.history.add(gradient, state.decision)
        A, b = history.quadratic(self.alpha, self.beta, code="ons_objective" in self.options.code_deviations)
        return replace(state, decision=simplex_qp(A, b), history=history, revealed=state.revealed + ids.size,
                       decision_loss=decision_loss(state.decision, responses))

    def model(self, state: OnsState) -> Arrays:
        return state.params


class AAggFFSServer:
    """AAggFF-S's server half; ``solver`` picks ONS (reveal opt-in) or the separable sums-only FTRL.

    ``on_reveal(round, silo_ids)`` is called on every reveal (set it to log or count);
    ``revealed_values(state)`` is the cumulative number of per-silo values received in the clear.
    """

    name = "aaggff_s"

    def __init__(self, options: AAggFFSOptions) -> None:
        if options.solver == "ons" and "response" not in options.reveal:
            raise RevealRefused(
                "aaggff_s with solver 'ons' needs every silo's response in the clear (the online Newton "
                "step couples all of them), which the one-rule forbids by default: opt in with "
                "reveal: [\"response\"] in the job spec (reveals are logged and counted), or use "
                "solver: separable, which needs only secure sums"
            )
        self.options = options
        self.on_reveal: Callable[[int, Sequence[int]], None] | None = None
        self._impl: _OnsServer | _AccumulatorServer = (
            _OnsServer(options, self._reveal) if options.solver == "ons" else _AccumulatorServer(options)
        )

    def _reveal(self, round_: int, ids: Sequence[int]) -> None:
        if self.on_reveal is not None:
            self.on_reveal(round_, ids)

    def init(self, params: Arrays) -> OnsState | AccumulatorState:
        return self._impl.init(params)

    def steps(self, state: Any) -> list[StepSpec]:
        return self._impl.steps(state)

    def broadcast(self, state: Any, step: str) -> Arrays:
        return self._impl.broadcast(state, step)

    def broadcast_to(self, state: Any, step: str, device_id: int) -> Arrays:
        if not isinstance(self._impl, _OnsServer):
            raise ValueError("the separable solver has no per-silo broadcast")
        return self._impl.broadcast_to(state, step, device_id)

    def apply(self, state: Any, step: str, total: Mapping[str, np.ndarray]) -> Any:
        return self._impl.apply(state, step, total)

    def model(self, state: Any) -> Arrays:
        return self._impl.model(state)

    def revealed_values(self, state: Any) -> int:
        return state.revealed if isinstance(state, OnsState) else 0


# ----------------------------------------------------------------------------------------------
# Client half


@dataclass(frozen=True)
class DeviceState:
    """What a device keeps between sums. ``accumulator`` (D_i, or G_i for the separable solver)
    persists across rounds; the rest is this round's scratch, valid only while ``round`` matches."""

    accumulator: float = 0.0
    round: int = -1
    loss: float | None = None
    update: np.ndarray | None = None
    response: float | None = None


def _log_weight_exp(log_weight: float) -> float:
    """exp, capped far above every clip so an outlier is clipped (and counted) instead of inf."""
    return math.exp(min(log_weight, 60.0))


class AAggFFClient:
    """The device half of both variants (the variant is the options' type and solver)."""

    def __init__(self, options: AAggFFOptions) -> None:
        self.options = options

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, local_state: Any
    ) -> tuple[Arrays, Any]:
        state = local_state if isinstance(local_state, DeviceState) else DeviceState()
        round_ = int(broadcast[ROUND])
        if step == LOSS:
            return self._loss(broadcast, device, state, round_)
        if step == RESPONSE:
            return self._response(broadcast, state, round_)
        if step == UPDATE:
            return self._update(broadcast, state, round_)
        raise ValueError(f"unknown step {step!r}")

    def _weight(self, accumulator: float, broadcast: Mapping[str, np.ndarray]) -> float:
        return _log_weight_exp(-accumulator / float(broadcast[ZETA]) - float(broadcast[OFFSET]))

    def _loss(self, broadcast: Mapping[str, np.ndarray], device: LocalTrainer, state: DeviceState,
              round_: int) -> tuple[Arrays, DeviceState]:
        """Algorithm 3.3: the loss of the received model on the training data, then local SGD."""
        opts = self.options
        params = {k: v for k, v in broadcast.items() if not k.startswith("@")}
        loss = float(device.evaluate(params)[0])
        trained, _ = device.train(params, opts.local_epochs, opts.local_lr * opts.lr_factor(round_), opts.batch_size)
        update = np.clip(flatten(trained) - flatten(params), -opts.delta_clip, opts.delta_clip)
        payload: Arrays = {"loss": np.float64(loss), "count": np.int64(1)}
        if opts.mode != "ons":
            payload["scale"] = np.float64(self._weight(state.accumulator, broadcast))
        return payload, DeviceState(state.accumulator, round_, loss, update)

    def _response(self, broadcast: Mapping[str, np.ndarray], state: DeviceState,
                  round_: int) -> tuple[Arrays, DeviceState]:
        if state.round != round_ or state.loss is None:  # missed sum 1: contribute nothing
            return self._response_payload(0.0, 0.0, 0), state
        opts = self.options
        c1, c2 = opts.response_range
        response = float(transform_responses(np.array([state.loss]), float(broadcast[MEAN_LOSS]), opts.cdf,
                                             c1, c2, opts.code_normal)[0])
        # Separable solver: p_i^(t) exactly, since the offset was just set so that Σ_j exp(-G_j/ζ^(t) - c) = 1.
        p = self._weight(state.accumulator, broadcast) if opts.mode == "exact" else 0.0
        return self._response_payload(response, p, 1), replace(state, response=response)

    def _response_payload(self, response: float, p: float, count: int) -> Arrays:
        if self.options.mode == "exact":
            return {"weighted_response": np.float64(p * response), "weight": np.float64(p), "count": np.int64(count)}
        return {"response": np.float64(response), "count": np.int64(count)}

    def _update(self, broadcast: Mapping[str, np.ndarray], state: DeviceState,
                round_: int) -> tuple[Arrays, DeviceState]:
        opts = self.options
        ready = state.round == round_ and state.update is not None
        if opts.mode != "ons":
            ready = ready and state.response is not None
        if not ready:
            dim = int(broadcast[DIM])
            zero = {"weighted_update": np.zeros(dim), "weight": np.float64(0.0), "count": np.int64(0)}
            return zero, DeviceState(state.accumulator)
        accumulator = state.accumulator
        if opts.mode == "ons":
            if COEFFICIENT not in broadcast:
                raise ValueError("the ONS update step needs this silo's own coefficient (a personal broadcast)")
            weight = float(broadcast[COEFFICIENT])
        else:
            accumulator += self._gradient(float(state.response), float(broadcast[MEAN_RESPONSE]))
            weight = self._weight(accumulator, broadcast)
        payload = {"weighted_update": weight * state.update, "weight": np.float64(weight), "count": np.int64(1)}
        return payload, DeviceState(accumulator)

    def _gradient(self, response: float, aggregate: float) -> float:
        """This device's coordinate of the gradient, up to a shift common to all devices.

        AAggFF-D: ĝ_i - (common part) = -(r̂_i - r̄)/(1 + r̄) (Eq. 3.10-3.11 at r0 = r̄·1; the unsampled
        entries and the p-dependent term are the same for every device, and softmax ignores them).
        Separable AAggFF-S: the true gradient -r_i/(1 + <p, r>).
        """
        if self.options.mode == "exact":
            return -response / (1.0 + aggregate)
        code = "dr_estimate" in self.options.code_deviations
        r_hat = dr_estimate(np.array([response]), np.array([True]), aggregate, self.options.sampling_rate, code)[0]
        return -(r_hat - aggregate) / (1.0 + aggregate)


def decision(options: AAggFFOptions, completed_rounds: int, local_states: Sequence[Any]) -> np.ndarray:
    """The current decision p over all K devices, p^(t+1) after t completed rounds, from the devices'
    accumulators (simulation diagnostics for reports: only a simulator holds every device's local
    state; a device without one has accumulator 0). Not defined for ONS, whose p is server state."""
    if options.mode == "ons":
        raise ValueError("the ONS decision lives in the server state, not on the devices")
    accumulators = np.array([s.accumulator if isinstance(s, DeviceState) else 0.0 for s in local_states])
    return entropic_decision(accumulators, step_size(completed_rounds + 1, options.lipschitz, options.num_clients))

"""AgnosticFedAvg (Ro, Chen, Mathews, Mohri & Suresh, Interspeech 2021) over secure sums.

The model minimises the worst mixture of ``p`` domains, ``min_w max_{λ∈Δ_p} Σ_i λ_i L_i(w)``,
in the one-transmission form of the paper's Algorithm 1 as reconstructed in
``specs/agnostic-fedavg.md`` §3: the server broadcasts the model and α = λ ⊘ N̄ (domain weight
per recent example); each device measures, *at the received model and before training*, its
per-domain example counts ``N^k`` and per-domain loss sums ``L^k``, sets β^k = α·N^k, trains on
the α-weighted loss normalised by β^k, and uploads β^k·Δ^k, β^k, L^k and N^k. The server sees
only their sums: it moves the model along Σβ·Δ / Σβ with its optimizer and takes an
exponentiated-gradient step on λ with the per-domain mean losses ΣL / ΣN.

**One secure sum per round.** All four quantities depend only on the broadcast (w, α) and on the
device's own data, never on another sum of the same round, so they travel as one payload: a
second sum would cost a second key agreement and a second chance to drop out, and buy nothing.
This is the paper's "single round of transmission" property (§4 of the paper, spec §4).

**Domain types.** Data partition (a device holds examples of several domains) and client
partition (every example of a device has the same domain) need no separate code path: the
device tags each example with its domain and reports per-domain counts, so the server never
learns which domains a device holds, whichever type the data is.

Choices where the spec leaves room (each is also noted where it is made):

- Absent domains. N̄ is floored at one example per round before dividing (spec §3.6 item 1), so
  a domain that was absent for the whole window gets a finite α instead of FedJAX's ∞ → NaN;
  and a domain with no examples in the round gets mean loss 0 (the paper's rule, spec A4).
- λ is stored as log-weights and updated as softmax(log λ + γ_λ L̄) (spec §3.3, numerics): the
  same exponentiated-gradient step without overflow, and λ stays strictly positive.
- α is broadcast rescaled so that max_i α_i = 1 / ``example_cap``. The algorithm is invariant
  to the scale of α (spec §3.6 item 5, oracle 6); this one bounds β^k ≤ n_k / example_cap, so β
  and β·Δ fit the fixed-point fields without saturating for devices up to ``example_cap``
  examples. A larger device caps its weight at 1 (it sends min(β^k, 1)·Δ and min(β^k, 1), so
  the ratio stays exact) -- the same cap FedAvg puts on example weights. ``beta_total`` in the
  state is rescaled back to the paper's β_t.
- The server optimizer (SGD, momentum, Adam) acts on the β-weighted mean update, as in the
  paper's experiments and FedJAX; server SGD with learning rate 1 is Algorithm 1's plain
  weighted average.

What the server learns: the model, λ, and per round the totals Σβ, ΣL and ΣN (spec §3.5). If a
cohort holds a single device of some domain, that domain's totals are that device's loss sum and
count; jobs with rare domains should use cohorts large enough that this does not happen.

Spec versus paper: Algorithm 1 prints exp(γ λ L), an undefined β_t and λ_t in the derivation;
the spec reads them as exp(γ_λ L̄), β_t = Σ_k β^k and λ_{t-1}, and this file follows the spec.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from tally.algorithms.base import Arrays, Options, StepSpec, flatten, unflatten
from tally.codec import Field, Kind, PayloadSchema

STEP = "update"
ALPHA = "alpha"
MODEL_PREFIX = "model/"
OPTIMIZERS = ("sgd", "momentum", "adam")


class DomainDevice(Protocol):
    """What a device must offer AgnosticFedAvg: domain-tagged examples and weighted training.

    Every example carries a domain id in ``0..num_domains-1`` known on the device (spec §2). The
    per-example loss must be the one training minimises, measured on exactly the examples
    training uses (spec §3.6 item 3).
    """

    def domain_statistics(self, params: Mapping[str, np.ndarray], num_domains: int) -> tuple[np.ndarray, np.ndarray]:
        """(N^k, L^k) at ``params``: per-domain example counts (integers) and per-domain *sums*
        of per-example losses, each of length ``num_domains``."""
        ...

    def train_domain_weighted(
        self,
        params: Mapping[str, np.ndarray],
        domain_weights: np.ndarray,
        normaliser: float,
        epochs: int,
        lr: float,
        batch_size: int,
    ) -> Arrays:
        """SGD from ``params``: shuffled batches b of ``batch_size``, each step on
        Σ_i domain_weights[i] · Σ_{j∈b, domain i} loss_j / normaliser (Algorithm 1, line 10).
        Returns the trained parameters."""
        ...


@dataclass(frozen=True)
class AgnosticFedAvgOptions(Options):
    """Options of a job. Codec bounds are per device and per value; see ``steps``.

    ``domain_lr`` is γ_λ; the paper used 0.005 (Stack Overflow) and 0.01 (EMNIST) and reports
    none for the toy regression, where the spec's recipe uses 0.005 and shows the last iterate
    oscillating above γ_λ ≈ 1/(2a²). ``window`` is r, ``initial_counts`` N_0 (default ones, the
    window starting as r copies), ``initial_weights`` λ_0 (default uniform; strictly positive).
    """

    options_of: ClassVar[str] = "agnostic_fedavg"

    domains: int = 2
    domain_lr: float = 0.01
    window: int = 1
    initial_weights: tuple[float, ...] | None = None
    initial_counts: tuple[float, ...] | None = None
    local_epochs: int = 1
    local_lr: float = 0.1
    batch_size: int = 10
    server_optimizer: str = "sgd"
    server_lr: float = 1.0
    momentum: float = 0.9
    nesterov: bool = True
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    example_cap: int = 1000
    delta_clip: float = 4.0
    frac_bits: int = 20
    loss_clip: float = 1e4
    loss_frac_bits: int = 8
    count_clip: int = 1_000_000

    def __post_init__(self) -> None:
        if self.domains < 1:
            raise ValueError(f"domains must be >= 1, got {self.domains}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.domain_lr < 0:
            raise ValueError(f"domain_lr must be >= 0, got {self.domain_lr}")
        if self.server_optimizer not in OPTIMIZERS:
            raise ValueError(f"server_optimizer must be one of {OPTIMIZERS}, got {self.server_optimizer!r}")
        if self.example_cap < 1:
            raise ValueError(f"example_cap must be >= 1, got {self.example_cap}")
        for name in ("initial_weights", "initial_counts"):
            value = getattr(self, name)
            if value is None:
                continue
            value = tuple(float(v) for v in value)
            object.__setattr__(self, name, value)
            if len(value) != self.domains:
                raise ValueError(f"{name} needs {self.domains} values, got {len(value)}")
        if self.initial_weights is not None:
            weights = np.array(self.initial_weights)
            if not (np.all(weights > 0) and abs(weights.sum() - 1.0) < 1e-9):
                raise ValueError("initial_weights must be strictly positive and sum to 1 "
                                 "(exponentiated gradient never leaves a face of the simplex)")
        if self.initial_counts is not None and min(self.initial_counts) < 0:
            raise ValueError("initial_counts must be non-negative")


@dataclass(frozen=True)
class OptimizerState:
    """Server optimizer moments over the flat model: ``first`` is the momentum trace or Adam's
    first moment, ``second`` Adam's second moment (unused otherwise)."""

    step: int
    first: np.ndarray
    second: np.ndarray


@dataclass(frozen=True)
class AgnosticFedAvgState:
    """Everything the server keeps; every array is derived from sums only.

    ``domain_loss`` (L̄_t), ``counts`` (N_t) and ``beta_total`` (β_t at the paper's scale) are the
    last round's aggregates, kept for reports.
    """

    params: Arrays
    log_weights: np.ndarray
    window: np.ndarray
    optimizer: OptimizerState
    round: int = 0
    domain_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0))
    beta_total: float = float("nan")

    @property
    def weights(self) -> np.ndarray:
        """λ on the simplex."""
        return np.exp(self.log_weights)


def exponentiated_gradient(log_weights: np.ndarray, domain_loss: np.ndarray, lr: float) -> np.ndarray:
    """log of λ_t ∝ λ_{t-1}·exp(γ_λ L̄), computed as a log-softmax: mirror ascent on the simplex
    with its KL projection, no overflow, no Euclidean projection needed (spec §3.3)."""
    logits = log_weights + lr * domain_loss
    top = logits.max()
    return logits - (top + np.log(np.exp(logits - top).sum()))


def mean_domain_loss(loss_sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """ΣL / ΣN per domain, 0 where the round had no example of the domain (the paper's rule)."""
    loss_sums = np.asarray(loss_sums, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    return np.divide(loss_sums, counts, out=np.zeros_like(loss_sums), where=counts > 0)


class AgnosticFedAvgServer:
    name = "agnostic_fedavg"

    def __init__(self, options: AgnosticFedAvgOptions | None = None) -> None:
        self.options = options or AgnosticFedAvgOptions()

    def init(self, params: Arrays) -> AgnosticFedAvgState:
        opts = self.options
        p = opts.domains
        weights = np.full(p, 1.0 / p) if opts.initial_weights is None else np.array(opts.initial_weights)
        counts = np.ones(p) if opts.initial_counts is None else np.array(opts.initial_counts)
        dim = sum(np.asarray(v).size for v in params.values())
        return AgnosticFedAvgState(
            params=dict(params),
            log_weights=np.log(weights),
            window=np.tile(counts, (opts.window, 1)),
            optimizer=OptimizerState(0, np.zeros(dim), np.zeros(dim)),
            domain_loss=np.zeros(p),
            counts=np.zeros(p),
        )

    def steps(self, state: AgnosticFedAvgState) -> list[StepSpec]:
        """One sum per round. Bounds: |β·Δ| ≤ ``delta_clip`` (β ≤ 1, so this bounds the update
        itself; larger values are clipped and counted by the codec); β ≤ 1 by the α scaling and
        the device cap, never clipped; per-domain loss sums ≤ ``loss_clip`` at 2^-loss_frac_bits
        (a mean over ΣN examples is off by < cohort·2^-loss_frac_bits / ΣN); counts are exact
        integers ≤ ``count_clip``. The defaults keep every field's largest encoded value near
        2^22, so the loss and count fields do not widen the ring the model needs."""
        opts = self.options
        dim = sum(v.size for v in state.params.values())
        p = opts.domains
        schema = PayloadSchema(
            (
                Field("weighted_update", (dim,), clip=opts.delta_clip, frac_bits=opts.frac_bits),
                Field("beta", (), clip=1.0, frac_bits=opts.frac_bits),
                Field("domain_loss", (p,), clip=opts.loss_clip, frac_bits=opts.loss_frac_bits),
                Field("domain_count", (p,), kind=Kind.COUNT, clip=opts.count_clip),
            )
        )
        return [StepSpec(STEP, schema)]

    def alpha(self, state: AgnosticFedAvgState) -> tuple[np.ndarray, float]:
        """(broadcast α, its scale relative to the paper's λ ⊘ N̄).

        N̄ is floored at 1 example per round: a domain absent from the whole window would
        otherwise get α = λ/0 = ∞ and every β a NaN (spec §3.6 item 1)."""
        recent = np.maximum(state.window.mean(axis=0), 1.0)
        raw = state.weights / recent
        scale = 1.0 / (raw.max() * self.options.example_cap)
        return raw * scale, scale

    def broadcast(self, state: AgnosticFedAvgState, step: str) -> Arrays:
        alpha, _ = self.alpha(state)
        return {**{MODEL_PREFIX + k: v for k, v in state.params.items()}, ALPHA: alpha}

    def apply(self, state: AgnosticFedAvgState, step: str, total: Mapping[str, np.ndarray]) -> AgnosticFedAvgState:
        counts = np.asarray(total["domain_count"], dtype=np.float64)
        if counts.sum() <= 0:
            raise ValueError("the round's total example count is zero: no device contributed")
        beta = float(total["beta"])
        params, optimizer = state.params, state.optimizer
        # Σβ can be 0 when every contributor's domains have α ≈ 0: the round then still
        # informs λ and the window, but gives no direction for the model.
        if beta > 0:
            mean_update = np.asarray(total["weighted_update"], dtype=np.float64) / beta
            vector, optimizer = self._optimizer_step(flatten(params), -mean_update, optimizer)
            params = unflatten(vector, params)
        domain_loss = mean_domain_loss(total["domain_loss"], counts)
        _, scale = self.alpha(state)
        return replace(
            state,
            params=params,
            optimizer=optimizer,
            log_weights=exponentiated_gradient(state.log_weights, domain_loss, self.options.domain_lr),
            window=np.vstack([state.window[1:], counts]),
            round=state.round + 1,
            domain_loss=domain_loss,
            counts=counts,
            beta_total=beta / scale,
        )

    def _optimizer_step(
        self, vector: np.ndarray, grad: np.ndarray, opt: OptimizerState
    ) -> tuple[np.ndarray, OptimizerState]:
        """One server step on the pseudo-gradient -(Σβ·Δ/Σβ), in optax's conventions."""
        opts = self.options
        step = opt.step + 1
        if opts.server_optimizer == "sgd":
            return vector - opts.server_lr * grad, replace(opt, step=step)
        if opts.server_optimizer == "momentum":
            trace = grad + opts.momentum * opt.first
            direction = grad + opts.momentum * trace if opts.nesterov else trace
            return vector - opts.server_lr * direction, replace(opt, step=step, first=trace)
        first = opts.adam_beta1 * opt.first + (1 - opts.adam_beta1) * grad
        second = opts.adam_beta2 * opt.second + (1 - opts.adam_beta2) * grad**2
        first_hat = first / (1 - opts.adam_beta1**step)
        second_hat = second / (1 - opts.adam_beta2**step)
        new = vector - opts.server_lr * first_hat / (np.sqrt(second_hat) + opts.adam_eps)
        return new, OptimizerState(step, first, second)

    def model(self, state: AgnosticFedAvgState) -> Arrays:
        return state.params


class AgnosticFedAvgClient:
    def __init__(self, options: AgnosticFedAvgOptions | None = None) -> None:
        self.options = options or AgnosticFedAvgOptions()

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: DomainDevice, local_state: Any
    ) -> tuple[Arrays, Any]:
        """Statistics at the received model, then α-weighted training normalised by β^k.

        A device whose β^k is 0 (no examples, or only domains whose α underflowed) has no
        weight in the model average, so it skips training and sends a zero update."""
        opts = self.options
        params = {k[len(MODEL_PREFIX):]: v for k, v in broadcast.items() if k.startswith(MODEL_PREFIX)}
        alpha = np.asarray(broadcast[ALPHA], dtype=np.float64)
        if alpha.shape != (opts.domains,) or not (np.all(np.isfinite(alpha)) and np.all(alpha >= 0)):
            raise ValueError(f"alpha must be {opts.domains} finite non-negative values, got {alpha}")
        counts, loss_sums = device.domain_statistics(params, opts.domains)
        counts = np.asarray(counts, dtype=np.int64)
        if counts.shape != (opts.domains,) or np.shape(loss_sums) != (opts.domains,):
            raise ValueError(f"the device reports {counts.size} domains, the job has {opts.domains}")
        beta = float(alpha @ counts)
        if beta > 0:
            trained = device.train_domain_weighted(
                params, alpha, beta, opts.local_epochs, opts.local_lr, opts.batch_size)
            update = flatten(trained) - flatten(params)
        else:
            update = np.zeros(sum(np.asarray(v).size for v in params.values()))
        weight = min(beta, 1.0)
        return (
            {
                "weighted_update": weight * update,
                "beta": np.float64(weight),
                "domain_loss": np.asarray(loss_sums, dtype=np.float64),
                "domain_count": counts,
            },
            local_state,
        )

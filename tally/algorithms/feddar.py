"""FedDAR (Zhong et al., ICLR 2023) over secure sums: FedDAR-WA and FedDAR-SA (specs/feddar.md).

The model is a shared encoder φ and one head per domain, h_m(φ(x)); every device holds all M
heads and uses head z for an example of domain z. A round has two sums (Algorithm 1):

1. ``heads``: with the encoder frozen, each device fits the head of every domain it holds on that
   domain's examples only, and sends per domain the count L_{i,m}, the weight c_{i,m}, c·w and,
   for SA, c·H and c·H·w (H the head Hessian of the domain's mean loss). The server sets
   WA: h_m = Σ c·w / Σ c;  SA: h_m = (Σ c·H)^{-1} Σ c·H·w  (Eq. 8, per domain).
2. ``encoder``: the broadcast carries the new heads and the domain weights u_m = L / (M·L_m) built
   from the summed counts; each device trains the encoder on the re-weighted loss (per example
   u_z·loss), heads frozen, and sends c_i·Δθ and c_i; the server adds Σ c·Δθ / Σ c.

The server half sees only these sums; the paper uploads each device's heads and Hessians, but SA
needs only S_m = Σ L H and b_m = Σ L H w (spec 4.6), so secure aggregation applies unchanged.

Choices the paper leaves open, as the spec settles them (and where this code adds to it):

* SA's per-domain weights are L_{i,m}/L_m, i.e. sums of sum-loss Hessians (spec 4.3; the paper's
  Eq. 8 writes the generic client weight L_i/L, which would count client sizes twice).
* The device weight c = min(L, example_cap)/example_cap keeps every summed value inside its fixed
  point clip however many examples a device has; below the cap it is exact L-weighting (as in
  FedAvg here). Above it a device weighs as if it had example_cap examples of that domain.
* The Hessian is taken at the local head (Algorithm 1) unless ``hessian_at="global"`` (the Eq. 8
  derivation, where local Newton steps make SA exactly the pooled Newton step).
* Damping is not in the paper: the server solves (S + λI) h = b + λ h_prev with
  λ = damping·trace(S)/P, which pulls toward the previous head (its fixed point is still S h = b)
  and makes the always-singular softmax Hessian (null space 1_N ⊗ v) invertible. Where the damped
  system is still worse conditioned than ``max_condition`` (damping = 0 on softmax heads, for
  instance) that domain falls back to WA, with a warning, and the fallback is counted.
* u_m uses the counts summed in this round's head step and M = the number of domains present in
  the round, so Σ_i (L_i/L) R̂_i is the mean over the round's domains (the paper's global counts
  are the round's counts under full participation). Absent domains keep their heads.
* Heads have a bias through an appended constant feature (the paper has none).
* ``head_solver="newton"`` (not in the paper) runs pseudo-inverse Newton iterations instead of
  SGD epochs; from ``head_start="zero"`` one iteration is the min-norm least-squares head that the
  spec's synthetic reproduction ("scratch" heads, after FedRep's code) uses.
* The projection layer is part of the encoder that the device builds; ``projection`` records its
  width, and the server refuses heads of a different width, so k (and SA's k²N² Hessians) is
  what the job asked for. No FedAvg warm-up rounds (the issue does not ask for them).

Fixed point: reals carry ``frac_bits`` fraction bits. Clip bounds: c·w at ``head_clip`` (c <= 1,
so heads up to that size pass), c·H entries at ``hessian_clip``, c·H·w at P·hessian_clip·head_clip
(it cannot exceed that when H and w are inside their clips), c·Δθ at ``delta_clip``, c at 1.
Counts are exact and refuse more than ``max_examples``. Values beyond a clip are clipped and
counted by the codec, never silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import numpy as np

from tally.algorithms.base import Arrays, Options, StepSpec, flatten, unflatten
from tally.codec import Field, Kind, PayloadSchema, packed_size, wire_width

HEADS = "heads"
ENCODER = "encoder"
DOMAIN_WEIGHTS = "domain_weights"


class SingularHeadSystem(RuntimeWarning):
    """SA's damped system for a domain was too ill-conditioned to solve; WA was used instead."""


class DomainDevice(Protocol):
    """What FedDAR needs from a device, beyond ``LocalTrainer``.

    Parameters are the encoder's arrays (any names but ``heads``) plus ``heads`` of shape
    (M, N, k + 1): N outputs over k features and a bias. Head m's parameter vector is its
    (N, k + 1) matrix in row-major order; Hessians are over that vector (P = N (k + 1)).
    ``tally.training.domain.DomainTrainer`` implements it with torch.
    """

    @property
    def num_examples(self) -> int: ...

    def domain_counts(self) -> np.ndarray:
        """L_{i,m}: this device's examples per domain, shape (M,)."""
        ...

    def train_heads(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> np.ndarray:
        """Heads (M, N, k + 1) after SGD on each present domain's head, on that domain's examples
        only, encoder frozen; heads of absent domains unchanged."""
        ...

    def head_derivatives(self, params: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Gradient (M, P) and Hessian (M, P, P) of each domain's mean loss with respect to its
        head at ``params["heads"]``; zeros for absent domains."""
        ...

    def train_encoder(
        self, params: Mapping[str, np.ndarray], domain_weights: np.ndarray, epochs: int, lr: float, batch_size: int
    ) -> tuple[Arrays, float]:
        """Encoder arrays (same names and order as in ``params``) after SGD on the mean of
        u_z · loss with the heads frozen, and the mean training loss."""
        ...


def encoder_part(params: Mapping[str, np.ndarray]) -> Arrays:
    """Everything but the heads and the broadcast's domain weights."""
    return {k: v for k, v in params.items() if k not in (HEADS, DOMAIN_WEIGHTS)}


@dataclass(frozen=True)
class FedDAROptions(Options):
    """FedDAR-WA's options (and the options both variants share)."""

    options_of: ClassVar[str] = "feddar_wa"

    head_solver: str = "sgd"  # "sgd": head_epochs epochs (Algorithm 1); "newton": head_epochs iterations
    head_start: str = "global"  # "global": from h^{t-1} (Algorithm 1); "zero": from scratch
    head_epochs: int = 5
    head_lr: float = 0.1
    encoder_epochs: int = 1
    encoder_lr: float = 0.1
    batch_size: int = 32
    projection: int = 0  # encoder output width the heads must take; 0: not checked
    example_cap: int = 1000
    head_clip: float = 64.0
    delta_clip: float = 4.0
    frac_bits: int = 24
    max_examples: int = 1_000_000

    def __post_init__(self) -> None:
        if self.head_solver not in ("sgd", "newton"):
            raise ValueError(f"head_solver must be 'sgd' or 'newton', got {self.head_solver!r}")
        if self.head_start not in ("global", "zero"):
            raise ValueError(f"head_start must be 'global' or 'zero', got {self.head_start!r}")
        counts = ("head_epochs", "encoder_epochs", "batch_size", "example_cap", "max_examples")
        if any(getattr(self, n) < 1 for n in counts) or self.projection < 0:
            raise ValueError(f"{', '.join(counts)} must be >= 1 and projection >= 0")


@dataclass(frozen=True)
class FedDARSAOptions(FedDAROptions):
    """FedDAR-SA adds the Hessian options."""

    options_of: ClassVar[str] = "feddar_sa"

    hessian_at: str = "local"  # "local": at the device's fitted head (Algorithm 1); "global": at h^{t-1}
    damping: float = 1e-4  # λ = damping · trace(S_m) / P; 0 is undamped Eq. 8
    max_condition: float = 1e12  # beyond this the domain falls back to WA
    hessian_clip: float = 64.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hessian_at not in ("local", "global"):
            raise ValueError(f"hessian_at must be 'local' or 'global', got {self.hessian_at!r}")
        if self.damping < 0 or self.max_condition <= 1:
            raise ValueError("damping must be >= 0 and max_condition > 1")


@dataclass(frozen=True)
class FedDARState:
    params: Arrays
    round: int = 0
    domain_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    wa_fallbacks: int = 0  # SA domains solved by WA because the system was singular


def domain_weights(counts: np.ndarray) -> np.ndarray:
    """u_m = L / (M·L_m) over the domains present (M of them); 0 for absent domains."""
    counts = np.asarray(counts, dtype=np.float64)
    present = counts > 0
    weights = np.zeros_like(counts)
    weights[present] = counts.sum() / (present.sum() * counts[present])
    return weights


def _triangle(size: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(size)


def _symmetric(upper: np.ndarray, size: int) -> np.ndarray:
    rows, cols = _triangle(size)
    full = np.zeros((size, size))
    full[rows, cols] = upper
    full[cols, rows] = upper
    return full


class FedDARWAServer:
    """FedDAR-WA: heads aggregated by the count-weighted average."""

    name = "feddar_wa"

    def __init__(self, options: FedDAROptions | None = None) -> None:
        self.options = options or FedDAROptions()

    def init(self, params: Arrays) -> FedDARState:
        heads = np.asarray(params.get(HEADS))
        if heads.ndim != 3:
            raise ValueError(f"FedDAR needs '{HEADS}' of shape (domains, outputs, features + 1), got {heads.shape}")
        width = self.options.projection
        if width and heads.shape[2] != width + 1:
            raise ValueError(f"heads take {heads.shape[2] - 1} features but projection is {width}")
        state_params = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
        return FedDARState(state_params, domain_counts=np.zeros(heads.shape[0], dtype=np.int64))

    def steps(self, state: FedDARState) -> list[StepSpec]:
        domains, size = self._head_shape(state)
        opts = self.options
        head_fields = (
            Field("counts", (domains,), kind=Kind.COUNT, clip=opts.max_examples),
            Field("weights", (domains,), clip=1.0, frac_bits=opts.frac_bits),
            Field("weighted_heads", (domains, size), clip=opts.head_clip, frac_bits=opts.frac_bits),
            *self._extra_head_fields(domains, size),
        )
        dim = flatten(encoder_part(state.params)).size
        encoder_fields = (
            Field("weighted_delta", (dim,), clip=opts.delta_clip, frac_bits=opts.frac_bits),
            Field("weight", (), clip=1.0, frac_bits=opts.frac_bits),
        )
        return [StepSpec(HEADS, PayloadSchema(head_fields)), StepSpec(ENCODER, PayloadSchema(encoder_fields))]

    def broadcast(self, state: FedDARState, step: str) -> Arrays:
        if step == HEADS:
            return dict(state.params)
        if step == ENCODER:
            return {**state.params, DOMAIN_WEIGHTS: domain_weights(state.domain_counts)}
        raise ValueError(f"unknown FedDAR step {step!r}")

    def apply(self, state: FedDARState, step: str, total: Mapping[str, np.ndarray]) -> FedDARState:
        if not all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for v in total.values()):
            raise ValueError(f"step {step!r}: the sum is not finite (a device diverged)")
        if step == HEADS:
            counts = np.rint(np.asarray(total["counts"], dtype=np.float64)).astype(np.int64)
            previous = state.params[HEADS]
            present = counts > 0
            heads, fallbacks = self._aggregate(previous.reshape(len(previous), -1), present, total)
            params = {**state.params, HEADS: heads.reshape(previous.shape)}
            return replace(state, params=params, domain_counts=counts, wa_fallbacks=state.wa_fallbacks + fallbacks)
        if step == ENCODER:
            weight = float(total["weight"])
            if weight <= 0:
                raise ValueError("the round's total encoder weight is zero: no device contributed")
            encoder = encoder_part(state.params)
            moved = flatten(encoder) + np.asarray(total["weighted_delta"], dtype=np.float64) / weight
            return replace(state, params={**state.params, **unflatten(moved, encoder)}, round=state.round + 1)
        raise ValueError(f"unknown FedDAR step {step!r}")

    def model(self, state: FedDARState) -> Arrays:
        return state.params

    def payload_report(self, state: FedDARState, cohort_size: int) -> dict[str, Any]:
        """Sizes of what each device uploads per round, and of SA's Hessians within it.

        Bytes are the masked upload at the ring width a cohort of ``cohort_size`` needs
        (``PayloadSchema.required_bits``), at the wire width the secure sum packs it with.
        """
        domains, size = self._head_shape(state)
        steps = {}
        for spec in self.steps(state):
            bits = spec.schema.required_bits(cohort_size)
            wire = wire_width(bits)
            steps[spec.name] = {"values": spec.schema.dim, "ring_bits": bits, "wire_bits": wire,
                                "upload_bytes": packed_size(spec.schema.dim, wire)}
        hessian_values = domains * self._hessian_unique(size)
        return {
            "algorithm": self.name,
            "domains": domains,
            "features": int(state.params[HEADS].shape[2]) - 1,
            "outputs": int(state.params[HEADS].shape[1]),
            "head_params": size,
            "hessian_entries_per_domain": size * size if hessian_values else 0,
            "hessian_unique_per_domain": self._hessian_unique(size),
            "hessian_values_per_device": hessian_values,
            "hessian_bytes_per_device": packed_size(hessian_values, steps[HEADS]["wire_bits"]),
            "encoder_params": steps[ENCODER]["values"] - 1,
            "steps": steps,
        }

    # -- what SA changes ---------------------------------------------------------------------

    def _hessian_unique(self, size: int) -> int:
        return 0

    def _extra_head_fields(self, domains: int, size: int) -> tuple[Field, ...]:
        return ()

    def _aggregate(
        self, previous: np.ndarray, present: np.ndarray, total: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, int]:
        """New flat heads (M, P) and how many domains fell back to WA."""
        heads = previous.copy()
        weights = np.asarray(total["weights"], dtype=np.float64)
        usable = present & (weights > 0)
        heads[usable] = np.asarray(total["weighted_heads"])[usable] / weights[usable, None]
        return heads, 0

    @staticmethod
    def _head_shape(state: FedDARState) -> tuple[int, int]:
        domains, outputs, features = state.params[HEADS].shape
        return int(domains), int(outputs * features)


class FedDARSAServer(FedDARWAServer):
    """FedDAR-SA: heads from the summed Hessian system, h_m = (Σ c H)^{-1} Σ c H w, damped."""

    name = "feddar_sa"
    options: FedDARSAOptions

    def __init__(self, options: FedDARSAOptions | None = None) -> None:
        super().__init__(options or FedDARSAOptions())

    def _hessian_unique(self, size: int) -> int:
        return size * (size + 1) // 2

    def _extra_head_fields(self, domains: int, size: int) -> tuple[Field, ...]:
        opts = self.options
        return (
            Field("hessians", (domains, self._hessian_unique(size)), clip=opts.hessian_clip, frac_bits=opts.frac_bits),
            Field("hessian_heads", (domains, size), clip=size * opts.hessian_clip * opts.head_clip,
                  frac_bits=opts.frac_bits),
        )

    def _aggregate(
        self, previous: np.ndarray, present: np.ndarray, total: Mapping[str, np.ndarray]
    ) -> tuple[np.ndarray, int]:
        opts = self.options
        weighted, fallbacks = super()._aggregate(previous, present, total)
        heads = previous.copy()
        size = previous.shape[1]
        for m in np.flatnonzero(present):
            system = _symmetric(np.asarray(total["hessians"][m], dtype=np.float64), size)
            damping = opts.damping * np.trace(system) / size
            system += damping * np.eye(size)
            rhs = np.asarray(total["hessian_heads"][m], dtype=np.float64) + damping * previous[m]
            condition = np.linalg.cond(system)
            if not np.isfinite(condition) or condition > opts.max_condition:
                warnings.warn(
                    f"domain {m}: SA system condition {condition:.3g} exceeds {opts.max_condition:.3g} "
                    f"(damping {opts.damping}); using WA for this domain", SingularHeadSystem, stacklevel=2)
                heads[m] = weighted[m]
                fallbacks += 1
            else:
                heads[m] = np.linalg.solve(system, rhs)
        return heads, fallbacks


class FedDARClient:
    """The device half of both variants; SA's extra sums are sent when the options are SA's."""

    def __init__(self, options: FedDAROptions | None = None) -> None:
        self.options = options or FedDAROptions()

    def contribute(
        self, step: str, broadcast: Mapping[str, np.ndarray], device: DomainDevice, local_state: Any
    ) -> tuple[Arrays, Any]:
        if step == HEADS:
            return self._heads(broadcast, device), local_state
        if step == ENCODER:
            return self._encoder(broadcast, device), local_state
        raise ValueError(f"unknown FedDAR step {step!r}")

    def _heads(self, broadcast: Mapping[str, np.ndarray], device: DomainDevice) -> Arrays:
        opts = self.options
        encoder = encoder_part(broadcast)
        global_heads = np.asarray(broadcast[HEADS], dtype=np.float64)
        start = np.zeros_like(global_heads) if opts.head_start == "zero" else global_heads
        counts = np.asarray(device.domain_counts(), dtype=np.int64)
        if opts.head_solver == "sgd":
            local = device.train_heads({**encoder, HEADS: start}, opts.head_epochs, opts.head_lr, opts.batch_size)
        else:
            local = _newton_heads(device, encoder, start, counts > 0, opts.head_epochs)
        domains = len(counts)
        flat = np.asarray(local, dtype=np.float64).reshape(domains, -1)
        weight = np.minimum(counts, opts.example_cap) / opts.example_cap
        payload = {"counts": counts, "weights": weight, "weighted_heads": weight[:, None] * flat}
        if isinstance(opts, FedDARSAOptions):
            at = local if opts.hessian_at == "local" else global_heads
            _, hessians = device.head_derivatives({**encoder, HEADS: at})
            scaled = weight[:, None, None] * hessians
            payload["hessians"] = scaled[:, *_triangle(flat.shape[1])]
            payload["hessian_heads"] = np.einsum("mpq,mq->mp", scaled, flat)
        return payload

    def _encoder(self, broadcast: Mapping[str, np.ndarray], device: DomainDevice) -> Arrays:
        opts = self.options
        params = {k: v for k, v in broadcast.items() if k != DOMAIN_WEIGHTS}
        trained, _ = device.train_encoder(
            params, np.asarray(broadcast[DOMAIN_WEIGHTS]), opts.encoder_epochs, opts.encoder_lr, opts.batch_size
        )
        weight = min(device.num_examples, opts.example_cap) / opts.example_cap
        delta = flatten(trained) - flatten(encoder_part(params))
        return {"weighted_delta": weight * delta, "weight": np.float64(weight)}


def _newton_heads(
    device: DomainDevice, encoder: Arrays, heads: np.ndarray, present: np.ndarray, iterations: int
) -> np.ndarray:
    """Newton iterations w <- w - H⁺ g per present domain. The pseudo-inverse keeps them defined
    for singular Hessians (fewer examples than head parameters, softmax's 1 ⊗ v null space);
    the gradient lies in H's range for these losses, so the step is still a Newton step there."""
    heads = heads.copy()
    for _ in range(iterations):
        grads, hessians = device.head_derivatives({**encoder, HEADS: heads})
        for m in np.flatnonzero(present):
            step = np.linalg.pinv(hessians[m], rcond=1e-10, hermitian=True) @ grads[m]
            heads[m] -= step.reshape(heads[m].shape)
    return heads

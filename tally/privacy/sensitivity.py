"""Which payload fields differential privacy can bound, per algorithm.

DP needs every released value to have a bounded L2 contribution per device. The privacy layer
bounds a step's *clipped* fields jointly (the device scales their concatenation onto the L2
ball of radius C, so a device moves the sum by at most C). A *bounded* field (a statistic that
travels with the model update: a weight, a loss sum, a per-domain count, a Hessian) is not in
the model's units, so it enters that ball in units of its own L2 bound B = clip * sqrt(values),
the bound its codec field's per-value clip already enforces: the device divides it by B / C
before the joint clip and the server multiplies the noisy total back, so the field's L2
sensitivity is B and its noise std z * B. One joint clip scales every field of a device by one
factor, so the ratios the server forms (update over weight, loss sum over count) stay each
device's own. A count made bounded is released as a noisy real. The layer *withholds* fields that are only
reports (FedAvg's example count), which the server half must not read; and replaces *counted*
fields (1 per device, such as FedAvg's weight with ``example_cap: 1``) by the number of
contributors, which no secure sum hides from the server anyway. That is DP-FedAvg's fixed
per-device weight (McMahan et al. 2018): the noise budget goes to the update, not to a
denominator. A field that is none of these (an exact count the algorithm needs, say) cannot be
made private by clipping without changing the algorithm, so DP is refused for it, by name.

An algorithm declares its fields with a ``privacy_fields`` mapping on its server half; the
built-in ones are declared here so that their files need not know about DP.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from tally.algorithms.aaggff import AAggFFDOptions, AAggFFSOptions
from tally.algorithms.base import Options, StepSpec
from tally.algorithms.fedavg import FedAvgOptions
from tally.codec import Field, Kind, PayloadSchema
from tally.privacy.errors import PrivacyRefused

CLIPPED_COUNT_FRAC_BITS = 8  # a clipped count's resolution; its noise std is z * its bound, far above


class Role(enum.Enum):
    CLIPPED = "clipped"   # real values in the model's units, L2 sensitivity C (the job's clip)
    BOUNDED = "bounded"   # L2 sensitivity clip * sqrt(size) of its codec field, scaled into the joint clip
    WITHHELD = "withheld"  # reporting only: never released under DP
    COUNTED = "counted"  # exactly 1 per device: the total is the number of contributors


# A field's role, or the L2 bound of a BOUNDED field whose codec clip is not its bound.
Declared = Role | float

AlgorithmOptions = TypeVar("AlgorithmOptions", bound=Options)


def _options(server: object, *kinds: type[AlgorithmOptions]) -> AlgorithmOptions:
    """The server half's ``options``, of one of ``kinds``. A declaration reads its bounds from them, so
    a server half that keeps none (an attribute renamed, a half wrapped) is an error here: a default
    would quietly clip FedAvg's weight instead of counting it, or bound AAggFF's scale by 1."""
    options = getattr(server, "options", None)
    if not isinstance(options, kinds):
        raise TypeError(f"{type(server).__name__}.options is {type(options).__name__}, not "
                        + " or ".join(k.__name__ for k in kinds))
    return options


def _fedavg(server: object) -> Mapping[str, Role]:
    """FedAvg sums w*delta and w. With ``example_cap: 1`` every device's w is 1, so the weight is
    counted; otherwise (w*delta, w) are clipped jointly, which scales both by one factor and
    keeps each device's mean update (a clipped-weight FedAvg, its denominator noised too)."""
    counted = _options(server, FedAvgOptions).example_cap == 1
    return {"weighted_delta": Role.CLIPPED, "weight": Role.COUNTED if counted else Role.CLIPPED,
            "examples": Role.WITHHELD}


def _agnostic_fedavg(server: object) -> Mapping[str, Role]:
    """AgnosticFedAvg sums beta*update, beta, per-domain loss sums and example counts: the
    update is clipped at C, the rest are bounded by their codec clips (beta <= 1, loss sums <=
    ``loss_clip``, counts <= ``count_clip``: a DP job lowers the latter two to what its devices
    hold, since the noise on them is z times those bounds)."""
    return {"weighted_update": Role.CLIPPED, "beta": Role.BOUNDED, "domain_loss": Role.BOUNDED,
            "domain_count": Role.BOUNDED}


def _aaggff(server: object) -> Mapping[str, Declared]:
    """AAggFF-D and separable AAggFF-S: the losses, responses, weights and counts of their sums
    are bounded by their codec clips (a count is 0 or 1, bound 1); the weighted update is
    clipped at C. ``scale`` is the device weight the update step bounds by ``weight_clip``, but
    its codec clip is 2^16 (room for fixed point, not a bound on the weight): its bound is
    ``weight_clip``, and a larger weight is scaled down by the joint clip, never released. AAggFF-S's
    ONS solver reveals responses and personalises the update step, which ``layout`` refuses."""
    bounded = ("loss", "count", "response", "weighted_response", "weight")
    weight_clip = float(_options(server, AAggFFDOptions, AAggFFSOptions).weight_clip)
    return {"weighted_update": Role.CLIPPED, "scale": weight_clip, **{name: Role.BOUNDED for name in bounded}}


def _feddar(server: object) -> Mapping[str, Role]:
    """FedDAR-WA/-SA: the weighted heads and encoder update are model values, clipped at C;
    per-domain counts and weights, and SA's Hessians and Hessian-weighted heads, are bounded
    by their codec clips (``max_examples``, 1, ``hessian_clip``, size * hessian_clip * head_clip)."""
    return {"weighted_heads": Role.CLIPPED, "weighted_delta": Role.CLIPPED,
            **{name: Role.BOUNDED for name in ("counts", "weights", "weight", "hessians", "hessian_heads")}}


def _fedevg(server: object) -> Mapping[str, Role]:
    """FedEvg's energy signals: the weighted energy gradients at the synthetic samples are
    clipped at C, their weights (n * s <= the codec clip) bounded."""
    return {"weighted_gradient": Role.CLIPPED, "weight": Role.BOUNDED}


# LG-FedAvg and SuPerFed sum FedAvg's payload over the shared part of the model (their personal
# layers never leave the device), with FedAvg's options: FedAvg's declaration holds for them.
DECLARED: dict[str, Callable[[object], Mapping[str, Declared]]] = {
    "fedavg": _fedavg, "lg_fedavg": _fedavg, "superfed": _fedavg, "agnostic_fedavg": _agnostic_fedavg,
    "aaggff_d": _aaggff, "aaggff_s": _aaggff, "feddar_wa": _feddar, "feddar_sa": _feddar, "fedevg": _fedevg,
}


@dataclass(frozen=True)
class Layout:
    """A step's fields as DP sees them: the clipped ones in schema order, their total size."""

    step: str
    clipped: tuple[Field, ...]
    withheld: tuple[str, ...]
    counted: tuple[Field, ...] = ()
    bounds: tuple[float | None, ...] = ()  # per clipped field: its L2 bound if BOUNDED, else None

    @property
    def dim(self) -> int:
        return sum(f.size for f in self.clipped)

    def units(self, clip: float) -> tuple[float, ...]:
        """Per clipped field, what one unit of the joint L2 ball of radius ``clip`` is in the
        field's own values (1 for a CLIPPED field, bound / clip for a BOUNDED one)."""
        bounds = self.bounds or (None,) * len(self.clipped)
        return tuple(1.0 if b is None else b / clip for b in bounds)

    def schema(self) -> PayloadSchema:
        """The central-DP wire schema: a bounded count carries a clipped, so fractional, value."""
        return PayloadSchema(tuple(
            Field(f.name, f.shape, clip=f.clip, frac_bits=CLIPPED_COUNT_FRAC_BITS) if f.kind is Kind.COUNT else f
            for f in self.clipped))


def declared_roles(algorithm: str, server: object) -> Mapping[str, Declared] | None:
    """The algorithm's declaration (its own ``privacy_fields`` or the built-in table), with the
    metric fields of a server half that evaluates (``tally.evaluation``: ``privacy_roles``)."""
    own: Mapping[str, Declared] | None = getattr(server, "privacy_fields", None)
    if own is None:
        declared = DECLARED.get(algorithm)
        own = declared(server) if declared is not None else None
    metric_roles = getattr(server, "privacy_roles", None)
    if own is None or metric_roles is None:
        return own
    return {**own, **{name: Role(role) if isinstance(role, str) else float(role)
                      for name, role in metric_roles().items()}}


def layout(algorithm: str, server: object, step: StepSpec) -> Layout:
    """``PrivacyRefused`` names every field DP cannot bound, and steps it cannot privatise."""
    if step.reveal or step.personal:
        raise PrivacyRefused(
            f"{algorithm} step {step.name!r} reveals per-device values or is personalised; differential "
            "privacy here covers secure sums only")
    declared = declared_roles(algorithm, server) or {}
    roles = {name: Role.BOUNDED if isinstance(d, float) else d for name, d in declared.items()}
    problems = []
    for f in step.schema.fields:
        role = roles.get(f.name)
        if role is None:
            what = "an exact count" if f.kind is Kind.COUNT else "a field"
            problems.append(f"{f.name!r} ({what}) declares no L2 sensitivity")
        elif role in (Role.CLIPPED, Role.COUNTED) and f.kind is not Kind.REAL:
            problems.append(f"{f.name!r} is a count and cannot be clipped without changing it")
    if problems:
        raise PrivacyRefused(
            f"{algorithm} step {step.name!r} cannot be made differentially private: " + "; ".join(problems))
    clipped = tuple(f for f in step.schema.fields if roles[f.name] in (Role.CLIPPED, Role.BOUNDED))
    if not clipped:
        raise PrivacyRefused(f"{algorithm} step {step.name!r} has no field to release privately")
    withheld = tuple(f.name for f in step.schema.fields if roles[f.name] is Role.WITHHELD)
    counted = tuple(f for f in step.schema.fields if roles[f.name] is Role.COUNTED)
    bounds = tuple(None if roles[f.name] is Role.CLIPPED else _bound(f, declared[f.name]) for f in clipped)
    return Layout(step.name, clipped, withheld, counted, bounds)


def _bound(f: Field, declared: Declared) -> float:
    """A BOUNDED field's L2 bound: the one its algorithm declared, else its clip on every value."""
    return declared if isinstance(declared, float) else f.clip * math.sqrt(f.size)

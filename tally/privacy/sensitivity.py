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

An algorithm declares each field's role in its package entry (``tally.algorithms.packages.Algorithm``
``privacy``; the built-in ones in ``tally.algorithms.builtin``), or with a ``privacy_fields`` mapping
on a server half registered in one coordinator process only.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from tally.algorithms import packages
from tally.algorithms.base import StepSpec
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
    """The algorithm's declaration (a server half's own ``privacy_fields``, else its package entry's
    roles under the half's options), with the metric fields of a server half that evaluates
    (``tally.evaluation``: ``privacy_roles``)."""
    own: Mapping[str, Declared] | None = getattr(server, "privacy_fields", None)
    if own is None and algorithm in packages.names():
        entry = packages.get(algorithm)
        own = {name: _role(role) for name, role in entry.roles(_options(server, entry.options)).items()}
    metric_roles = getattr(server, "privacy_roles", None)
    if own is None or metric_roles is None:
        return own
    return {**own, **{name: _role(role) for name, role in metric_roles().items()}}


def _options(server: object, kind: type) -> object:
    """The server half's ``options``: a declaration that reads its bounds from them must fail on a
    half that keeps none (an attribute renamed, a half wrapped) rather than default, which would
    quietly clip FedAvg's weight instead of counting it, or bound AAggFF's scale by 1."""
    options = getattr(server, "options", None)
    if not isinstance(options, kind):
        raise TypeError(f"{type(server).__name__}.options is {type(options).__name__}, not {kind.__name__}")
    return options


def _role(role: str | float) -> Declared:
    return Role(role) if isinstance(role, str) else float(role)


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

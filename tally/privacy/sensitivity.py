"""Which payload fields differential privacy can bound, per algorithm.

DP needs every released value to have a bounded L2 contribution per device. The privacy layer
bounds a step's *clipped* fields jointly (the device scales their concatenation onto the L2
ball of radius C, so a device moves the sum by at most C); *withholds* fields that are only
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tally.algorithms.base import StepSpec
from tally.codec import Field, Kind, PayloadSchema
from tally.privacy.errors import PrivacyRefused


class Role(enum.Enum):
    CLIPPED = "clipped"   # real values, bounded by the joint L2 clip
    WITHHELD = "withheld"  # reporting only: never released under DP
    COUNTED = "counted"  # exactly 1 per device: the total is the number of contributors


def _fedavg(server: object) -> Mapping[str, Role]:
    """FedAvg sums w*delta and w. With ``example_cap: 1`` every device's w is 1, so the weight is
    counted; otherwise (w*delta, w) are clipped jointly, which scales both by one factor and
    keeps each device's mean update (a clipped-weight FedAvg, its denominator noised too)."""
    counted = getattr(getattr(server, "config", None), "example_cap", None) == 1
    return {"weighted_delta": Role.CLIPPED, "weight": Role.COUNTED if counted else Role.CLIPPED,
            "examples": Role.WITHHELD}


DECLARED: dict[str, Callable[[object], Mapping[str, Role]]] = {"fedavg": _fedavg}


@dataclass(frozen=True)
class Layout:
    """A step's fields as DP sees them: the clipped ones in schema order, their total size."""

    step: str
    clipped: tuple[Field, ...]
    withheld: tuple[str, ...]
    counted: tuple[Field, ...] = ()

    @property
    def dim(self) -> int:
        return sum(f.size for f in self.clipped)

    def schema(self) -> PayloadSchema:
        return PayloadSchema(self.clipped)


def declared_roles(algorithm: str, server: object) -> Mapping[str, Role] | None:
    own = getattr(server, "privacy_fields", None)
    if own is not None:
        return own
    declared = DECLARED.get(algorithm)
    return declared(server) if declared is not None else None


def layout(algorithm: str, server: object, step: StepSpec) -> Layout:
    """``PrivacyRefused`` names every field DP cannot bound, and steps it cannot privatise."""
    if getattr(step, "reveal", ()) or getattr(step, "personal", False):
        raise PrivacyRefused(
            f"{algorithm} step {step.name!r} reveals per-device values or is personalised; differential "
            "privacy here covers secure sums only")
    roles = declared_roles(algorithm, server) or {}
    problems = []
    for f in step.schema.fields:
        role = roles.get(f.name)
        if role is None:
            what = "an exact count" if f.kind is Kind.COUNT else "a field"
            problems.append(f"{f.name!r} ({what}) declares no L2 sensitivity")
        elif role is not Role.WITHHELD and f.kind is not Kind.REAL:
            problems.append(f"{f.name!r} is a count and cannot be clipped without changing it")
    if problems:
        raise PrivacyRefused(
            f"{algorithm} step {step.name!r} cannot be made differentially private: " + "; ".join(problems))
    clipped = tuple(f for f in step.schema.fields if roles[f.name] is Role.CLIPPED)
    if not clipped:
        raise PrivacyRefused(f"{algorithm} step {step.name!r} has no field to release privately")
    withheld = tuple(f.name for f in step.schema.fields if roles[f.name] is Role.WITHHELD)
    counted = tuple(f for f in step.schema.fields if roles[f.name] is Role.COUNTED)
    return Layout(step.name, clipped, withheld, counted)

"""What a round's federated evaluation measures, as fields of the secure sum, and what their
totals say.

Model quality reaches the server the way an update does: as a sum over the round's devices, so
no device's own loss or accuracy is ever released (DESIGN.md section 1). Each metric is a field
of the last step's payload, encoded like any other (clipped to its declared bounds, clipped
values counted, never silent), so it costs no extra round trip and, under DP, is noised and
accounted with the update. A device weighs its values by ``w = min(n, example_cap) / example_cap``
(n: its held-out examples; 1 under DP, ``device_weighted``), as FedAvg weighs updates: every summed
value stays within its clip whatever a device holds, and ``Σ w·m / Σ w`` is the example-weighted
mean over devices below the cap. A distribution is a histogram of one-hot counts, so the spread across devices (and an
estimate of the worst decile, the fairness algorithms' criterion) is known without any device's
own value.

A plan is data (``to_dict``/``from_dict``): the coordinator sends it with the round's first
broadcast (``PLAN``, a tensor of JSON bytes), so a device needs no configuration and the
simulator runs the same plan in process.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from tally.codec import Field, Kind, PayloadSchema

PLAN = "eval.plan"  # the broadcast tensor carrying the plan (JSON bytes)
PREFIX = "metric."  # every metric field of a payload
EVALUATION_STEP = "evaluation"  # the one step of a round that only evaluates
BUILT_IN = ("loss", "accuracy", "train_loss", "accuracy_histogram", "personal_accuracy", "domain")
DEFAULT_METRICS = ("loss", "accuracy", "train_loss", "accuracy_histogram")
MetricKind = Literal["mean", "count", "histogram"]


class EvaluationError(ValueError):
    """A device cannot compute what the plan asks (``metric_unavailable``): names the metric."""

    reason = "metric_unavailable"


@dataclass(frozen=True)
class CustomMetric:
    """A metric a trainer computes beyond the built-in ones (``LocalTrainer.metrics``).

    ``mean``: an example-weighted mean of values in [low, high]; ``count``: a whole number in
    [0, high] summed over devices; ``histogram``: how many devices fall in each of ``bins`` equal
    bins over [low, high]."""

    name: str
    kind: MetricKind = "mean"
    low: float = 0.0
    high: float = 1.0
    bins: int = 10

    def __post_init__(self) -> None:
        if not self.name.replace("_", "").isalnum():
            raise ValueError(f"metric name {self.name!r}: letters, digits and '_' only")
        if self.kind not in ("mean", "count", "histogram"):
            raise ValueError(f"metric {self.name!r}: kind must be mean, count or histogram, got {self.kind!r}")
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ValueError(f"metric {self.name!r}: bounds must be finite with low < high, got "
                             f"[{self.low}, {self.high}]")
        if self.kind == "count" and (self.low != 0 or not float(self.high).is_integer()):
            raise ValueError(f"metric {self.name!r}: a count lies in [0, high] with a whole high")
        if self.bins < 2:
            raise ValueError(f"metric {self.name!r}: a histogram needs at least 2 bins")


@dataclass(frozen=True)
class EvaluationPlan:
    """One job's federated evaluation. ``step``: the step whose sum carries the metrics (the
    round's last, when every training is done); ``model``: the names of the broadcast tensors that
    are the model a device evaluates; ``domains``: per-domain metrics over that many domains."""

    metrics: tuple[str, ...] = DEFAULT_METRICS
    custom: tuple[CustomMetric, ...] = ()
    holdout: float = 0.1
    bins: int = 10
    loss_bound: float = 10.0
    example_cap: int = 1000
    domains: int = 0
    seed: int = 0
    # Under DP: every device weighs 1, so the means' denominators are the contributor count (exact:
    # counted, not noised) and the noise falls on the numerators alone.
    device_weighted: bool = False
    step: str = ""
    # An evaluation-only round (``EVALUATION_STEP``): the device scores the model and trains nothing.
    only: bool = False
    # The model a device evaluates: the broadcast tensors ``model`` are the parameters ``model_names``
    # (an algorithm may broadcast its model under other names, AgnosticFedAvg's ``model.*``).
    model: tuple[str, ...] = field(default=())
    model_names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        unknown = sorted(set(self.metrics) - set(BUILT_IN))
        if unknown:
            raise ValueError(f"unknown metrics {unknown}; built in: {', '.join(BUILT_IN)}")
        if "domain" in self.metrics and self.domains < 1:
            raise ValueError("metric 'domain' needs the job's number of domains")
        if not 0.0 <= self.holdout < 1.0:
            raise ValueError(f"holdout must be in [0, 1), got {self.holdout}")
        names = [c.name for c in self.custom]
        if len(set(names)) != len(names):
            raise ValueError(f"custom metrics named twice: {sorted({n for n in names if names.count(n) > 1})}")

    # -- the payload --------------------------------------------------------------------------

    def fields(self) -> tuple[Field, ...]:
        """The metric fields appended to the step's schema, in a fixed order."""
        k = max(self.domains, 1)
        out = [Field(PREFIX + "devices", (), clip=1.0),  # 1 per device: under DP, counted
               Field(PREFIX + "examples", (), kind=Kind.COUNT, clip=self.example_cap),
               Field(PREFIX + "weight", (), clip=1.0),
               Field(PREFIX + "clipped", (), kind=Kind.COUNT, clip=self.clip_capacity)]
        if "loss" in self.metrics:
            out.append(Field(PREFIX + "loss", (), clip=self.loss_bound))
        if "accuracy" in self.metrics:
            # ``scored``: devices whose model has an accuracy (a regression has none: NaN).
            out += [Field(PREFIX + "accuracy", (), clip=1.0), Field(PREFIX + "scored", (), kind=Kind.COUNT, clip=1)]
        if "train_loss" in self.metrics:
            out += [Field(PREFIX + "train_loss", (), clip=self.loss_bound),
                    Field(PREFIX + "train_weight", (), clip=1.0)]
        if "accuracy_histogram" in self.metrics:
            out.append(Field(PREFIX + "accuracy_histogram", (self.bins,), kind=Kind.COUNT, clip=1))
        if "personal_accuracy" in self.metrics:
            out.append(Field(PREFIX + "personal_accuracy", (), clip=1.0))
        if "domain" in self.metrics:
            out += [Field(PREFIX + "domain_loss", (k,), clip=self.loss_bound),
                    Field(PREFIX + "domain_accuracy", (k,), clip=1.0),
                    Field(PREFIX + "domain_weight", (k,), clip=1.0)]
        for c in self.custom:
            name = PREFIX + "custom." + c.name
            if c.kind == "mean":
                out.append(Field(name, (), clip=max(abs(c.low), abs(c.high))))
            elif c.kind == "count":
                out.append(Field(name, (), kind=Kind.COUNT, clip=c.high))
            else:
                out.append(Field(name, (c.bins,), kind=Kind.COUNT, clip=1))
        return tuple(out)

    def weight(self, examples: int) -> float:
        """A device's weight in the means: its examples up to the cap, over the cap (or 1)."""
        return 1.0 if self.device_weighted else min(examples, self.example_cap) / self.example_cap

    @property
    def clip_capacity(self) -> int:
        """The most metric values one device can have clipped (one per scalar it reports)."""
        return 4 + 3 * max(self.domains, 1) + len(self.custom) + 4

    def evaluation_only(self) -> EvaluationPlan:
        """The plan of a round that only evaluates: no training, so no training loss."""
        return replace(self, only=True, step=EVALUATION_STEP,
                       metrics=tuple(m for m in self.metrics if m != "train_loss"))

    def schema(self) -> PayloadSchema:
        """The metric fields alone, as a round that only evaluates sums them."""
        return PayloadSchema(self.fields())

    def extend(self, schema: PayloadSchema) -> PayloadSchema:
        """``schema`` with the metric fields after its own, their fixed point no wider than the
        widest field already there: metrics never widen the ring (and so the upload) of a sum."""
        widest = max(schema.max_abs(f) for f in schema.fields)
        extra = []
        for f in self.fields():
            if f.kind is Kind.REAL:
                frac = min(16, max(0, int(math.floor(math.log2(max(widest, 1) / f.clip)))))
                f = replace(f, frac_bits=frac)
            extra.append(f)
        return PayloadSchema((*schema.fields, *extra))

    # -- the plan on the wire -----------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "custom": [asdict(c) for c in self.custom]}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> EvaluationPlan:
        raw = dict(raw)
        custom = tuple(CustomMetric(**c) for c in raw.pop("custom", ()))
        return cls(**{**raw, "custom": custom, "metrics": tuple(raw.get("metrics", DEFAULT_METRICS)),
                      "model": tuple(raw.get("model", ())), "model_names": tuple(raw.get("model_names", ()))})

    def tensor(self) -> np.ndarray:
        return np.frombuffer(json.dumps(self.to_dict(), sort_keys=True).encode(), dtype=np.uint8).copy()

    @classmethod
    def from_tensor(cls, tensor: np.ndarray) -> EvaluationPlan:
        try:
            return cls.from_dict(json.loads(np.asarray(tensor, dtype=np.uint8).tobytes().decode()))
        except (ValueError, TypeError, UnicodeDecodeError) as exc:
            raise EvaluationError(f"the round's evaluation plan does not parse: {exc}") from None


def split_total(total: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(the algorithm's fields, the metric fields) of a total or a payload."""
    own = {k: v for k, v in total.items() if not k.startswith(PREFIX)}
    return own, {k[len(PREFIX):]: v for k, v in total.items() if k.startswith(PREFIX)}

"""A round's model quality from the metric totals: the figures a person reads.

Keys are flat (``eval.loss``, ``eval.accuracy_hist.03``, ``eval.domain2.accuracy``,
``custom.f1``) because a round's figures are one ``{name: float}`` mapping everywhere they go:
the round record, ``tally job watch``/``status``/``metrics``, Prometheus, MLflow. ``KEY_PREFIXES``
says which keys of a round's figures are model quality.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from tally.evaluation.plan import EvaluationPlan

KEY_PREFIXES = ("eval.", "train.", "personal.", "custom.")
HISTOGRAM = "eval.accuracy_hist."
# In the figures of a round that only evaluates: the training round whose model it scored.
EVALUATION_ONLY = "evaluation_only.of_round"


def is_quality(key: str) -> bool:
    return key.startswith(KEY_PREFIXES)


def _ratio(num: np.ndarray | float, den: np.ndarray | float) -> np.ndarray:
    num, den = np.asarray(num, dtype=np.float64), np.asarray(den, dtype=np.float64)
    return np.divide(num, den, out=np.full(np.broadcast(num, den).shape, np.nan), where=den > 0)


def worst_decile(histogram: np.ndarray, low: float = 0.0, high: float = 1.0) -> float:
    """The mean of the lowest tenth of devices, estimated from a histogram of their values
    (each device at its bin's midpoint; the bin that straddles the tenth counts in part).
    An estimate with error at most one bin's width, the price of never seeing a device's value."""
    counts = np.maximum(np.asarray(histogram, dtype=np.float64), 0.0)
    total = counts.sum()
    if total <= 0:
        return float("nan")
    width = (high - low) / len(counts)
    mids = low + width * (np.arange(len(counts)) + 0.5)
    want, taken, acc = total / 10.0, 0.0, 0.0
    for count, mid in zip(counts, mids):
        take = min(count, want - taken)
        taken += take
        acc += take * mid
        if taken >= want:
            break
    return float(acc / taken)


def quality(plan: EvaluationPlan, totals: Mapping[str, np.ndarray]) -> dict[str, float]:
    """The round's figures from the metric fields' totals (names without ``metric.``)."""
    t = {k: np.asarray(v, dtype=np.float64) for k, v in totals.items()}
    weight = t["weight"]
    # Under DP the exact counts of examples and clipped values are withheld (never released).
    out = {"eval.devices": float(t["devices"]),
           **{f"eval.{name}": float(t[name]) for name in ("examples", "clipped") if name in t}}
    if "loss" in t:
        out["eval.loss"] = float(_ratio(t["loss"], weight))
    if "accuracy" in t and t.get("scored", 1) > 0:  # none scored: a regression, no accuracy
        out["eval.accuracy"] = float(_ratio(t["accuracy"], weight))
    if "train_loss" in t:
        out["train.loss"] = float(_ratio(t["train_loss"], t["train_weight"]))
    if "accuracy_histogram" in t and t.get("scored", 1) > 0:
        hist = t["accuracy_histogram"]
        out.update({f"{HISTOGRAM}{i:02d}": float(c) for i, c in enumerate(hist)})
        out["eval.accuracy_p10"] = worst_decile(hist)
    if "personal_accuracy" in t:
        out["personal.accuracy"] = float(_ratio(t["personal_accuracy"], weight))
    if "domain_loss" in t:
        for k, (loss, acc) in enumerate(zip(_ratio(t["domain_loss"], t["domain_weight"]),
                                            _ratio(t["domain_accuracy"], t["domain_weight"]))):
            out[f"eval.domain{k}.loss"] = float(loss)
            if t.get("scored", 1) > 0:
                out[f"eval.domain{k}.accuracy"] = float(acc)
    for c in plan.custom:
        value = t["custom." + c.name]
        if c.kind == "mean":
            out["custom." + c.name] = float(_ratio(value, weight))
        elif c.kind == "count":
            out["custom." + c.name] = float(value)
        else:
            out.update({f"custom.{c.name}.hist.{i:02d}": float(v) for i, v in enumerate(value)})
    return {k: v for k, v in out.items() if not np.isnan(v)}


def histogram(figures: Mapping[str, float], prefix: str = HISTOGRAM) -> list[float]:
    """A histogram's counts from a round's figures, in bin order (empty when it has none)."""
    return [figures[k] for k in sorted(k for k in figures if k.startswith(prefix))]

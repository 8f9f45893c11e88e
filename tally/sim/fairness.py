"""Fairness summaries of per-device metrics, as the AAggFF and AgnosticFedAvg papers report them."""

from __future__ import annotations

import numpy as np


def worst_fraction_mean(values: np.ndarray, fraction: float = 0.1) -> float:
    """Mean of the worst ``fraction`` of devices (at least one)."""
    values = np.sort(np.asarray(values, dtype=np.float64))
    return float(values[: max(1, int(np.ceil(fraction * values.size)))].mean())


def gini(values: np.ndarray) -> float:
    """Gini coefficient: 0 when every device does equally well."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    if v.size == 0 or v.sum() == 0:
        return 0.0
    ranks = np.arange(1, v.size + 1)
    return float((2 * ranks - v.size - 1) @ v / (v.size * v.sum()))


def summary(per_device_accuracy: np.ndarray) -> dict[str, float]:
    acc = np.asarray(per_device_accuracy, dtype=np.float64)
    return {
        "mean_accuracy": float(acc.mean()),
        "worst10_accuracy": worst_fraction_mean(acc, 0.1),
        "gini": gini(acc),
        "parity_gap": float(acc.max() - acc.min()),
    }

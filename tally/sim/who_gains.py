"""Who gains from federated learning (specs/local-adaptation.md section 5): per device, the accuracy
on its own test split of a model trained on its data alone, of the federated model, and of the
federated model adapted on the device (``tally.client.adaptation``); the share of devices worse off
than with their local model (strictly: a tie is not a loss), before and after adaptation.

The adapted model a device keeps is the technique with the best accuracy on its *validation*
split (the paper picks the best per participant on test data, spec 11 #5); each technique's own
result is reported too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays
from tally.client.adaptation import AdaptationOptions, adapt
from tally.sim.personalisation import PersonalFleet


def share_worse(local: np.ndarray, other: np.ndarray) -> float:
    """The share of devices whose local-only model is strictly more accurate than ``other``."""
    return float(np.mean(np.asarray(local) > np.asarray(other)))


def who_gains(fleet: PersonalFleet, federated: Sequence[Mapping[str, np.ndarray]], local_only: np.ndarray,
              methods: Sequence[AdaptationOptions]) -> dict[str, Any]:
    """``federated[i]`` is the model device i starts from (the global model, or its personal one)."""
    if not methods:
        raise ValueError("name at least one adaptation method")
    fed = np.array([t.evaluate(m)[1] for t, m in zip(fleet.test, federated)])
    per_method: dict[str, dict[str, list[float]]] = {}
    for options in methods:
        val, test = [], []
        for i, device in enumerate(fleet.devices):
            adapted: Arrays = adapt(fleet.factory(), federated[i], device.features.cpu().numpy(),
                                    device.labels.cpu().numpy(), options)
            val.append(fleet.validation[i].evaluate(adapted)[1] if fleet.validation[i].num_examples else 0.0)
            test.append(fleet.test[i].evaluate(adapted)[1])
        per_method[options.method] = {"validation": val, "test": test}
    names = list(per_method)
    val = np.array([per_method[m]["validation"] for m in names])
    test = np.array([per_method[m]["test"] for m in names])
    pick = np.argmax(val, axis=0)
    adapted = test[pick, np.arange(len(fed))]
    return {
        "devices": len(fed),
        "local_only_accuracy": [float(a) for a in local_only],
        "federated_accuracy": [float(a) for a in fed],
        "adapted_accuracy": [float(a) for a in adapted],
        "adapted_method": [names[k] for k in pick],
        "per_method_test_accuracy": {m: per_method[m]["test"] for m in names},
        "mean": {"local_only": float(np.mean(local_only)), "federated": float(np.mean(fed)),
                 "adapted": float(np.mean(adapted)), **{m: float(np.mean(per_method[m]["test"])) for m in names}},
        "share_worse_than_local": {"federated": share_worse(local_only, fed),
                                   "adapted": share_worse(local_only, adapted),
                                   **{m: share_worse(local_only, per_method[m]["test"]) for m in names}},
    }


def plot(report: Mapping[str, Any], path: Path, title: str = "") -> Path:
    """Each device's local-only accuracy against its federated and adapted accuracy: a device
    below the diagonal would have been better off alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    local = report["local_only_accuracy"]
    shares = report["share_worse_than_local"]
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
    ax.scatter(local, report["federated_accuracy"], s=18, label=f"federated ({shares['federated']:.0%} worse off)")
    ax.scatter(local, report["adapted_accuracy"], s=18, marker="^",
               label=f"adapted ({shares['adapted']:.0%} worse off)")
    ax.set_xlabel("local-only accuracy (own test split)")
    ax.set_ylabel("accuracy of the model the device uses")
    ax.set_xlim(0, 1.02)
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "who gains from federated learning")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

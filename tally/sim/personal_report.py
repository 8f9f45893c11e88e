"""What ``tally simulate`` adds on a dataset whose devices have their own splits: every device's
personal model on its own test split, the values uploaded (to set personalisation's accuracy
against its communication), and with ``--adapt`` the "who gains from federated learning" report
(JSON in the metrics file, and a plot)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tally.algorithms.base import Arrays, ClientAlgorithm, StepSpec
from tally.algorithms.superfed import SuPerFedClient
from tally.client.adaptation import AdaptationOptions
from tally.sim.personalisation import PersonalFleet, local_only_accuracy, personal_accuracy, personal_params, summary
from tally.sim.rounds import SumFn
from tally.sim.who_gains import plot, who_gains


@dataclass
class UploadCounter:
    """A sum function that counts the values devices upload (each contribution's schema size)."""

    inner: SumFn
    values: int = 0
    per_step: dict[str, int] = field(default_factory=dict)

    def __call__(self, round_: int, step: StepSpec, contributions: Mapping[int, Arrays]):
        sent = len(contributions) * step.schema.dim
        self.values += sent
        self.per_step[step.name] = self.per_step.get(step.name, 0) + sent
        return self.inner(round_, step, contributions)


def personal_results(client: ClientAlgorithm, model: Arrays, local: Mapping[int, Any], fleet: PersonalFleet,
                     uploads: UploadCounter, adapt: list[str], adapt_epochs: int, plot_path: Path | None
                     ) -> dict[str, Any]:
    out: dict[str, Any] = {
        "personal": summary(personal_accuracy(client, model, local, fleet)),
        "uploaded_values_per_step": dict(uploads.per_step),
    }
    if isinstance(client, SuPerFedClient):
        out["lambda_protocols"] = lambda_protocols(client, model, local, fleet)
    if adapt:
        # Local-only uses the same local training settings as the adaptation (lr 0.05, batch 10),
        # for as many epochs as the adaptation has, three times over.
        local_only, _ = local_only_accuracy(fleet, 3 * adapt_epochs, 0.05, 10)
        start = [personal_params(client, model, local.get(i), fleet.validation[i]) for i in range(len(fleet.test))]
        methods = [AdaptationOptions(m, epochs=adapt_epochs, lr=0.05, batch_size=10) for m in adapt]
        report = who_gains(fleet, start, local_only, methods)
        if plot_path is not None:
            plot_path.parent.mkdir(parents=True, exist_ok=True)
            report["plot"] = str(plot(report, plot_path))
        out["who_gains"] = report
    return out


def lambda_protocols(client: SuPerFedClient, model: Arrays, local: Mapping[int, Any], fleet: PersonalFleet
                     ) -> dict[str, float]:
    """SuPerFed's mixing weight three ways (spec 9): chosen on each device's validation split (what
    a device can do), fixed at 0.5, and the paper's protocol, the best λ on each device's *test*
    split (optimistic: it selects on the data it reports)."""
    fixed, best = [], []
    for i, test in enumerate(fleet.test):
        _, curve = client.choose_lambda(model, local.get(i), test)
        federated = test.evaluate(model)[1]
        fixed.append(curve[len(curve) // 2] if curve else federated)
        best.append(max(curve) if curve else federated)
    chosen = personal_accuracy(client, model, local, fleet)
    return {"validation_chosen": float(np.mean(chosen)), "fixed_0.5": float(np.mean(fixed)),
            "best_on_test": float(np.mean(best))}


def summary_line(results: Mapping[str, Any]) -> str:
    line = (f"personal accuracy {results['personal']['mean_accuracy']:.4g} "
            f"(min {results['personal']['min_accuracy']:.4g}), uploaded {results['uploaded_values']:,} values")
    if "who_gains" in results:
        shares = results["who_gains"]["share_worse_than_local"]
        line += (f"; worse off than local-only: {shares['federated']:.0%} federated, "
                 f"{shares['adapted']:.0%} adapted")
    return line


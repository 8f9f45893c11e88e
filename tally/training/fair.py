"""LG-FedAvg's fair-representation variant (LG-FedAvg+Adv, specs/lg-fedavg.md section 4): each
device trains its local encoder against a local adversary that tries to recover the protected
attribute p from the representation h = ℓ(x); only the classifier head on h is global.

The model is one module with three parts, ``encoder``, ``head`` and ``adversary``; with
``global_patterns=("head.*",)`` LG-FedAvg keeps the encoder *and* the adversary in the device's
local state and sums the head alone, so fairness adds no communication (spec 4.4). Each batch:

1. encoder and head take one step on L^g − λ·L^a (the adversary fixed, h not detached), the
   encoder so maximising the adversary's loss;
2. the adversary takes ``adversary_steps`` steps on L^a with h *detached*.

These are separate passes: the authors' code backpropagates L^g − L^a and then L^a through one
graph, which cancels the adversarial term (spec 4.8); ``encoder_objective`` is what the gradient
test checks. Labels and p are binary; head and adversary are logistic.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from torch import nn

from tally.algorithms.base import Arrays
from tally.models.fair import FairModel
from tally.models.params import get_params, set_params
from tally.training.sgd import mean_loss, minibatches

GLOBAL_PATTERNS = ("head.*",)


def encoder_objective(model: FairModel, x: torch.Tensor, y: torch.Tensor, p: torch.Tensor, lam: float
                      ) -> torch.Tensor:
    """L^g − λ·L^a with h = ℓ(x) not detached (what encoder and head descend)."""
    h = model.represent(x)
    bce = nn.functional.binary_cross_entropy_with_logits
    return bce(model.head(h).squeeze(-1), y) - lam * bce(model.adversary(h).squeeze(-1), p)


def adversary_objective(model: FairModel, x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """L^a on a detached h: the adversary's steps never move the encoder."""
    h = model.represent(x).detach()
    return nn.functional.binary_cross_entropy_with_logits(model.adversary(h).squeeze(-1), p)


class FairTrainer:
    """A device's (x, y, p) and its fair local training, as a ``LocalTrainer``."""

    def __init__(self, model: FairModel, features: np.ndarray, labels: np.ndarray, protected: np.ndarray,
                 lam: float, adversary_steps: int = 3, adversary_lr: float = 0.5, seed: int = 0) -> None:
        self.model = model
        self.x = torch.as_tensor(features, dtype=torch.float32)
        self.y = torch.as_tensor(labels, dtype=torch.float32)
        self.p = torch.as_tensor(protected, dtype=torch.float32)
        self.lam, self.adversary_steps, self.adversary_lr = lam, adversary_steps, adversary_lr
        self.generator = torch.Generator().manual_seed(seed)

    @property
    def num_examples(self) -> int:
        return int(self.y.shape[0])

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        m = self.model
        set_params(m, params)
        main = torch.optim.SGD([*m.encoder.parameters(), *m.head.parameters()], lr=lr)
        adversary = torch.optim.SGD(m.adversary.parameters(), lr=self.adversary_lr)
        losses = []
        for idx in minibatches(self.num_examples, epochs, batch_size, self.generator):
            x, y, p = self.x[idx], self.y[idx], self.p[idx]
            main.zero_grad()
            loss = encoder_objective(m, x, y, p, self.lam)
            loss.backward()
            main.step()
            for _ in range(self.adversary_steps):
                adversary.zero_grad()
                adversary_objective(m, x, p).backward()
                adversary.step()
            losses.append(loss.item())
        return get_params(m), mean_loss(losses)

    @torch.no_grad()
    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        set_params(self.model, params)
        logits = self.model(self.x)
        loss = float(nn.functional.binary_cross_entropy_with_logits(logits, self.y))
        return loss, float(((logits > 0).float() == self.y).float().mean())

    @torch.no_grad()
    def scores(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The classifier's and the co-trained adversary's scores, and the representations."""
        set_params(self.model, params)
        h = self.model.represent(self.x)
        return {"class": self.model.head(h).squeeze(-1).numpy(),
                "adversary": self.model.adversary(h).squeeze(-1).numpy(), "h": h.numpy()}


def fairness_metrics(params: Mapping[str, np.ndarray], train: FairTrainer, test: FairTrainer) -> dict[str, float]:
    """Class accuracy and AUC, the co-trained adversary's AUC for p, and the post-hoc probe's: a
    fresh logistic regression fitted on the frozen training representations (spec 4.7), all on
    the device's test split (0.5 is chance for the two AUCs on p)."""
    fitted, held = train.scores(params), test.scores(params)
    y, p = test.y.numpy(), test.p.numpy()
    probe = LogisticRegression(max_iter=1000).fit(fitted["h"], train.p.numpy())
    return {"class_accuracy": float(np.mean((held["class"] > 0) == y)),
            "class_auc": float(roc_auc_score(y, held["class"])),
            "adversary_auc": float(roc_auc_score(p, held["adversary"])),
            "probe_auc": float(roc_auc_score(p, probe.decision_function(held["h"])))}

"""Local adaptation after federated training (Yu, Bagdasaryan & Shmatikov, "Salvaging Federated
Learning by Local Adaptation"; specs/local-adaptation.md): a device turns the final federated model
G^T into its own on its own data, and nothing of it ever leaves the device (zero communication).

Four techniques (spec 6), each starting from A = G^T:

* ``finetune``: SGD on every parameter (FT).
* ``freeze_base``: SGD on the parameters matching ``trainable`` only, by default the model's last
  module (FB: "only the final classifier trainable").
* ``ewc``: FT plus Σ_j (λ/2)·F_j·(A_j − G^T_j)², F the diagonal Fisher information of G^T computed
  from the device's *own* data (per-example squared gradients of the log-likelihood of its labels;
  spec 11 #6 leaves the source open, and this is the one that needs nothing from anyone else).
* ``distill``: G^T as teacher, A as student. The default (``kd_form="hinton"``, the authors' code)
  weighs α·K²·KL(softmax(G/K) ‖ softmax(A/K)) + (1 − α)·CE; ``"paper"`` is Eq. 6's swap,
  α·K²·CE + (1 − α)·KL. The KL is averaged over the batch ("batchmean"), not over batch × classes.

``adapt`` is the API an application calls; ``tally.models.onnx.export_onnx`` turns the adapted
model into ONNX bytes that ``client_sdk.OnnxModel`` serves with ONNX Runtime alone (no torch at serving time).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from tally.training import get_params, set_params

Arrays = dict[str, np.ndarray]
METHODS = ("finetune", "freeze_base", "ewc", "distill")


@dataclass(frozen=True)
class AdaptationConfig:
    method: str = "finetune"
    epochs: int = 20
    lr: float = 0.1
    batch_size: int = 20
    trainable: tuple[str, ...] = ()  # freeze_base: patterns of the trained parameters; () = last module
    ewc_lambda: float = 5.0
    alpha: float = 0.5
    temperature: float = 6.0
    kd_form: str = "hinton"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"adaptation method must be one of {METHODS}, got {self.method!r}")
        if self.kd_form not in ("hinton", "paper"):
            raise ValueError(f"kd_form must be 'hinton' or 'paper', got {self.kd_form!r}")
        if self.epochs < 0 or self.batch_size < 1 or self.lr <= 0 or self.temperature <= 0:
            raise ValueError("epochs must be >= 0, batch_size >= 1, lr and temperature > 0")
        if not 0 <= self.alpha <= 1 or self.ewc_lambda < 0:
            raise ValueError("alpha must lie in [0, 1] and ewc_lambda be >= 0")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> AdaptationConfig:
        raw = dict(raw or {})
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown adaptation options {sorted(unknown)}")
        if isinstance(raw.get("trainable"), str):
            raw["trainable"] = (raw["trainable"],)
        elif "trainable" in raw:
            raw["trainable"] = tuple(raw["trainable"])
        return cls(**raw)


def _tensors(params: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.as_tensor(np.asarray(v), dtype=torch.float32) for k, v in params.items()}


def fisher_diagonal(module: nn.Module, params: Mapping[str, np.ndarray], features: np.ndarray, labels: np.ndarray
                    ) -> Arrays:
    """F_j = mean over the device's examples of (∂ log p(y|x) / ∂θ_j)² at ``params`` (per example,
    not the squared minibatch mean of the authors' code; spec 6.3's scale caveat)."""
    weights = _tensors(params)
    X = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.long)

    def loss(p, x, target):
        logits = functional_call(module, p, (x[None],))
        return nn.functional.cross_entropy(logits, target[None])

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(weights, X, y)
    return {k: (g**2).mean(dim=0).numpy().astype(np.asarray(params[k]).dtype) for k, g in per_example.items()}


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, alpha: float,
                      temperature: float, form: str = "hinton") -> torch.Tensor:
    soft = nn.functional.kl_div(nn.functional.log_softmax(student / temperature, dim=1),
                                nn.functional.softmax(teacher / temperature, dim=1), reduction="batchmean")
    hard = nn.functional.cross_entropy(student, labels)
    k2 = temperature**2
    if form == "hinton":
        return alpha * k2 * soft + (1 - alpha) * hard
    return alpha * k2 * hard + (1 - alpha) * soft


def trainable_names(names: list[str], config: AdaptationConfig) -> list[str]:
    if config.method != "freeze_base":
        return list(names)
    patterns = config.trainable or (names[-1].rpartition(".")[0] + ".*",)
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not chosen:
        raise ValueError(f"freeze_base: trainable {list(patterns)} matches none of {names}")
    return chosen


def adapt(module: nn.Module, params: Mapping[str, np.ndarray], features: np.ndarray, labels: np.ndarray,
          config: AdaptationConfig | None = None) -> Arrays:
    """The adapted model's parameters: ``config.epochs`` epochs of ``config.method`` from ``params``
    (the federated model G^T) on this device's (features, labels)."""
    cfg = config or AdaptationConfig()
    set_params(module, params)
    module.train()
    X = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.long)
    named = dict(module.named_parameters())
    train = trainable_names(list(named), cfg)
    for name, p in named.items():
        p.requires_grad_(name in train)
    anchor = _tensors({k: params[k] for k in named})
    fisher = _tensors(fisher_diagonal(module, params, features, labels)) if cfg.method == "ewc" else {}
    teacher = None
    if cfg.method == "distill":
        with torch.no_grad():
            teacher = module(X)
    optimiser = torch.optim.SGD([named[n] for n in train], lr=cfg.lr)
    generator = torch.Generator().manual_seed(cfg.seed)
    n = len(y)
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            optimiser.zero_grad()
            logits = module(X[idx])
            if teacher is not None:
                loss = distillation_loss(logits, teacher[idx], y[idx], cfg.alpha, cfg.temperature, cfg.kd_form)
            else:
                loss = nn.functional.cross_entropy(logits, y[idx])
            if fisher and cfg.ewc_lambda:
                loss = loss + cfg.ewc_lambda / 2 * sum(
                    (fisher[k] * (named[k] - anchor[k]) ** 2).sum() for k in train)
            loss.backward()
            optimiser.step()
    for p in named.values():
        p.requires_grad_(True)
    return get_params(module)



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
model into ONNX bytes that ``tally.client.OnnxModel`` serves with ONNX Runtime alone (no torch at serving time).
``adapt_for_job`` is what a device does by itself when a job whose spec has an ``adaptation:``
option succeeds (``tally.client.device``): adapt, judge on held-out examples, export.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from tally.algorithms.adaptation_options import METHODS as METHODS  # re-exported: the SDK's API
from tally.algorithms.adaptation_options import AdaptationOptions, JobAdaptation, trainable_names
from tally.models.onnx import export_onnx
from tally.models.params import get_params, set_params
from tally.training import held_out_indices
from tally.training.sgd import sgd_epochs

Arrays = dict[str, np.ndarray]


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


def adapt(module: nn.Module, params: Mapping[str, np.ndarray], features: np.ndarray, labels: np.ndarray,
          options: AdaptationOptions | None = None) -> Arrays:
    """The adapted model's parameters: ``options.epochs`` epochs of ``options.method`` from ``params``
    (the federated model G^T) on this device's (features, labels)."""
    opts = options or AdaptationOptions()
    set_params(module, params)
    module.train()
    X = torch.as_tensor(features, dtype=torch.float32)
    y = torch.as_tensor(labels, dtype=torch.long)
    named = dict(module.named_parameters())
    train = trainable_names(list(named), opts)
    for name, p in named.items():
        p.requires_grad_(name in train)
    anchor = _tensors({k: params[k] for k in named})
    fisher = _tensors(fisher_diagonal(module, params, features, labels)) if opts.method == "ewc" else {}
    teacher = None
    if opts.method == "distill":
        with torch.no_grad():
            teacher = module(X)
    optimiser = torch.optim.SGD([named[n] for n in train], lr=opts.lr)

    def loss_of_batch(idx: torch.Tensor) -> torch.Tensor:
        logits = module(X[idx])
        if teacher is not None:
            loss = distillation_loss(logits, teacher[idx], y[idx], opts.alpha, opts.temperature, opts.kd_form)
        else:
            loss = nn.functional.cross_entropy(logits, y[idx])
        if fisher and opts.ewc_lambda:
            loss = loss + opts.ewc_lambda / 2 * sum((fisher[k] * (named[k] - anchor[k]) ** 2).sum() for k in train)
        return loss

    sgd_epochs(optimiser, loss_of_batch, len(y), opts.epochs, opts.batch_size, torch.Generator().manual_seed(opts.seed))
    for p in named.values():
        p.requires_grad_(True)
    return get_params(module)




# -- the job option: what a device does when a job with ``adaptation:`` has succeeded -------------


@dataclass(frozen=True)
class JobAdaptationResult:
    """``onnx``: the model the device keeps (adapted, or federated when adaptation made it worse
    on the held-out examples); ``record``: the device's who-gains record, kept beside it."""

    onnx: bytes
    record: dict[str, Any]


def trainer_data(trainer: Any) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """A CPU copy of the trainer's model and its data (a ``TorchTrainer``'s ``model``, ``features``
    and ``labels``); the copy leaves the trainer free for another job's rounds meanwhile."""
    try:
        module, features, labels = trainer.model, trainer.features, trainer.labels
    except AttributeError:
        raise TypeError(f"{type(trainer).__name__} offers no model, features and labels to adapt on") from None
    return copy.deepcopy(module).cpu(), _numpy(features), _numpy(labels)


def _numpy(values: Any) -> np.ndarray:
    return values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)


@torch.no_grad()
def accuracy(module: nn.Module, params: Mapping[str, np.ndarray], features: np.ndarray, labels: np.ndarray) -> float:
    set_params(module, params)
    module.eval()
    predicted = module(torch.as_tensor(features, dtype=torch.float32)).argmax(dim=1).numpy()
    return float(np.mean(predicted == labels))


def fresh_params(module: nn.Module, seed: int) -> Arrays:
    """The module's parameters re-initialised as its layers initialise themselves (from scratch:
    the local-only baseline of spec 4.3), seeded without touching the process's global generator."""
    fresh = copy.deepcopy(module)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for layer in fresh.modules():
            if hasattr(layer, "reset_parameters"):
                layer.reset_parameters()
    return get_params(fresh)


def adapt_for_job(module: nn.Module, federated: Mapping[str, np.ndarray], features: np.ndarray,
                  labels: np.ndarray, option: JobAdaptation) -> JobAdaptationResult:
    """Adapt the job's final model G^T on this device's data as ``option`` says, judge it on the
    held-out examples and return the model to keep as ONNX with the who-gains record (spec 5:
    the accuracies of the local-only, federated and adapted models on the same examples; a device
    is worse off when its local-only model is strictly more accurate)."""
    opts = option.options
    flat = np.asarray(features, dtype=np.float32).reshape(len(labels), -1)
    train, held = held_out_indices(len(labels), option.validation, opts.seed)
    adapted = adapt(module, federated, flat[train], labels[train], opts)
    record: dict[str, Any] = {"method": opts.method, "trained_on": int(len(train)), "held_out": int(len(held)),
                              "kept": "adapted", "accuracy": {}, "worse_off_than_local": {}}
    kept = adapted
    if len(held):
        scores = {"federated": accuracy(module, federated, flat[held], labels[held]),
                  "adapted": accuracy(module, adapted, flat[held], labels[held])}
        if scores["adapted"] < scores["federated"]:
            record["kept"], kept = "federated", dict(federated)
        if option.local_only_epochs:
            baseline = AdaptationOptions("finetune", epochs=option.local_only_epochs, lr=opts.lr,
                                        batch_size=opts.batch_size, seed=opts.seed)
            local = adapt(module, fresh_params(module, opts.seed), flat[train], labels[train], baseline)
            scores["local_only"] = accuracy(module, local, flat[held], labels[held])
            record["worse_off_than_local"] = {
                "federated": scores["local_only"] > scores["federated"],
                "after_adaptation": scores["local_only"] > scores[record["kept"]],
            }
        record["accuracy"] = scores
    return JobAdaptationResult(export_onnx(module, kept, flat.shape[1]), record)

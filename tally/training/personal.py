"""SuPerFed's local training with torch (specs/superfed.md 2.2): a federated and a personal copy
of one architecture, trained together through their random interpolation.

Every mini-batch draws λ ~ U(0, 1) (one for the model, "model mixing", or one per module, "layer
mixing"), runs the model at θ(λ) = (1 − λ)θ^f + λθ^l and takes one SGD step on both copies; autograd
applies the chain rule of Eq. 2.3 (θ^f gets (1 − λ)∇ℒ, θ^l gets λ∇ℒ, plus each regulariser's
gradient). Before the start round ("none"), λ = 0, θ^l is frozen and ν is off: plain FedProx, and
with μ = 0 exactly the ``TorchTrainer`` step.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from tally.algorithms.base import Arrays, check_fits
from tally.training import TorchTrainer
from tally.training.sgd import sgd_epochs

Tensors = dict[str, torch.Tensor]
MIXINGS = ("none", "model", "layer")
PROX_FORMS = ("thesis", "code")


def cos_squared(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """cos²(a, b) of the two models flattened into single vectors (Eq. 2.5)."""
    dot = sum((a[k] * b[k]).sum() for k in a)
    return dot**2 / (sum((v**2).sum() for v in a.values()) * sum((v**2).sum() for v in b.values()))


def proximal(federated: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], mu: float,
             form: str = "thesis") -> torch.Tensor:
    """(μ/2)·||θ^f − θ^g||² (thesis, Eq. 2.4) or μ·Σ_layers ||θ^f − θ^g||₂ (the authors' code)."""
    if form == "thesis":
        return mu / 2 * sum(((federated[k] - anchor[k]) ** 2).sum() for k in federated)
    return mu * sum(torch.linalg.vector_norm(federated[k] - anchor[k]) for k in federated)


def module_of(name: str) -> str:
    """The module a parameter belongs to (``0.weight`` -> ``0``): layer mixing draws one λ each."""
    return name.rpartition(".")[0]


def mixed_objective(data_loss: Callable[[Tensors], torch.Tensor], federated: Tensors, local: Tensors,
                    anchor: Tensors, lambdas: Mapping[str, float], mu: float, nu: float,
                    prox_form: str = "thesis", twins: Collection[str] | None = None) -> torch.Tensor:
    """ℒ(θ(λ)) + prox(θ^f, θ^g) + ν·cos²(θ^f, θ^l); ``lambdas`` gives each parameter's λ. The
    cosine is over the parameters with a personal twin (``twins``, default all)."""
    mixed = {k: (1 - lambdas[k]) * federated[k] + lambdas[k] * local[k] for k in federated}
    objective = data_loss(mixed)
    if mu:
        objective = objective + proximal(federated, anchor, mu, prox_form)
    if nu:
        paired = federated if twins is None else twins
        objective = objective + nu * cos_squared({k: federated[k] for k in paired}, {k: local[k] for k in paired})
    return objective


class MixingTrainer(TorchTrainer):
    """A ``TorchTrainer`` that can also train SuPerFed's two models, and initialise its own
    personal model (Xavier-normal weights from the device's own seed, spec 2.2/2.3, so every
    device's starts differently and nearly orthogonal to the federated one)."""

    def __init__(self, model_factory: Callable[[], nn.Module], features: np.ndarray, labels: np.ndarray,
                 seed: int = 0, device: torch.device | None = None) -> None:
        super().__init__(model_factory, features, labels, seed, device)
        self.seed = seed

    def initial_local(self) -> Arrays:
        generator = torch.Generator().manual_seed(10_000 + self.seed)
        out = {}
        for name, value in self.model.state_dict().items():
            fresh = torch.zeros(value.shape)
            if name.endswith("weight") and value.dim() >= 2:
                fan_in = value[0].numel()
                fan_out = value.shape[0] * value[0][0].numel() if value.dim() > 2 else value.shape[0]
                std = (2.0 / (fan_in + fan_out)) ** 0.5
                fresh = torch.randn(value.shape, generator=generator) * std
            out[name] = fresh.numpy().astype(value.cpu().numpy().dtype)
        return out

    def train_mixed(self, federated: Mapping[str, np.ndarray], local: Mapping[str, np.ndarray],
                    epochs: int, lr: float, batch_size: int, *, mixing: str, mu: float = 0.0, nu: float = 0.0,
                    prox_form: str = "thesis", momentum: float = 0.0, weight_decay: float = 0.0,
                    twins: Collection[str] | None = None) -> tuple[Arrays, Arrays, float]:
        """(θ^f, θ^l, mean loss) after ``epochs`` epochs from ``federated`` (also the prox anchor θ^g).
        Only the parameters in ``twins`` (default all) are mixed; the others have λ = 0 and their
        personal copies stay as they are (the authors' code mixes weights only)."""
        if mixing not in MIXINGS:
            raise ValueError(f"mixing must be one of {MIXINGS}, got {mixing!r}")
        shapes = {k: tuple(v.shape) for k, v in self.model.state_dict().items()}
        check_fits(federated, shapes)
        check_fits(local, shapes)
        as_tensor = lambda p, grad: {  # noqa: E731
            k: torch.tensor(np.asarray(p[k]), dtype=torch.float32, device=self.device, requires_grad=grad)
            for k in shapes}
        # Ordered as the model's parameters, not as a set of names would be: the cosine sums over
        # them in this order, and a set's order moves with PYTHONHASHSEED (one seed gave results
        # that differed in the last bit from run to run). A dict's keys keep the order and look-ups.
        paired = dict.fromkeys(k for k in shapes if twins is None or k in twins)
        fed, own, anchor = as_tensor(federated, True), as_tensor(local, False), as_tensor(federated, False)
        if mixing != "none":
            for k in paired:
                own[k].requires_grad_(True)
        trained = list(fed.values()) + ([own[k] for k in shapes if k in paired] if mixing != "none" else [])
        optimiser = torch.optim.SGD(trained, lr=lr, momentum=momentum, weight_decay=weight_decay)
        modules = sorted({module_of(k) for k in shapes})
        self.model.train()

        def loss_of_batch(idx: torch.Tensor) -> torch.Tensor:
            lambdas = {k: lam if k in paired else 0.0 for k, lam in self._draw(mixing, shapes, modules).items()}
            features, labels = self.features[idx], self.labels[idx]

            def data_loss(params: Tensors) -> torch.Tensor:
                return nn.functional.cross_entropy(functional_call(self.model, params, (features,)), labels)

            return mixed_objective(data_loss, fed, own, anchor, lambdas, mu, nu if mixing != "none" else 0.0,
                                   prox_form, paired)

        mean = sgd_epochs(optimiser, loss_of_batch, self.num_examples, epochs, batch_size, self.generator, self.device)
        out = lambda p: {k: v.detach().cpu().numpy().copy() for k, v in p.items()}  # noqa: E731
        return out(fed), out(own), mean

    def _draw(self, mixing: str, shapes: Mapping[str, tuple[int, ...]], modules: list[str]) -> dict[str, float]:
        if mixing == "none":
            return dict.fromkeys(shapes, 0.0)
        if mixing == "model":
            return dict.fromkeys(shapes, float(torch.rand((), generator=self.generator)))
        per_module = dict(zip(modules, torch.rand(len(modules), generator=self.generator).tolist()))
        return {k: per_module[module_of(k)] for k in shapes}

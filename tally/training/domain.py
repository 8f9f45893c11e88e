"""A device with domain-labelled data and a shared encoder plus one head per domain (torch).

It is the device side FedDAR needs (``tally.algorithms.feddar.DomainDevice``) and also a plain
``LocalTrainer``, so FedAvg runs on exactly the same data and model for comparison: with a single
head every example uses it (FedAvg), with M heads example j uses head z_j.

Parameters cross the algorithm boundary as numpy arrays: the encoder's state dict with every name
prefixed ``encoder.``, and ``heads`` of shape (H, N, k + 1): H heads (1 or M), N outputs, k encoder
features plus a bias column (the paper never mentions a bias; specs/feddar.md section 9 adds one
through an augmented constant feature). A head's vector is its (N, k + 1) matrix in row-major
order, ``[w_1; ...; w_N]``, which is the layout of the spec's Hessians (section 4.4).

Head derivatives are closed-form and in float64 from the frozen encoder's features, because the
second-order aggregation is only as exact as its Hessians; head training also runs on those
features, so a head phase costs one forward pass of the encoder.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from tally.algorithms.base import check_fits
from tally.algorithms.feddar import HEADS, encoder_part
from tally.algorithms.packages import DOMAIN_STATISTICS
from tally.training import default_device, held_out_indices
from tally.training.sgd import mean_loss, minibatches

Arrays = dict[str, np.ndarray]
HeadLoss = Literal["squared", "logistic", "softmax"]
PREFIX = "encoder."


@dataclass(frozen=True)
class DomainEval:
    """Per-domain sums on one device: loss sum, example count, and correct predictions
    (classification only; None for regression)."""

    loss_sum: np.ndarray
    count: np.ndarray
    correct: np.ndarray | None


class DomainTrainer:
    """One device's (x, y, z) data with an encoder from ``encoder_factory`` and linear heads.

    ``loss``: ``squared`` (per example ½||h(φ(x)) - y||², N = outputs regression targets),
    ``logistic`` (binary, N = 1, targets in {0, 1}) or ``softmax`` (N = outputs classes).
    """

    capabilities = (DOMAIN_STATISTICS,)  # declared at check-in: FedDAR may seat it

    def __init__(
        self,
        encoder_factory: Callable[[], nn.Module],
        x: np.ndarray,
        y: np.ndarray,
        z: np.ndarray,
        num_domains: int,
        loss: HeadLoss = "squared",
        outputs: int = 1,
        seed: int = 0,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float64,
    ) -> None:
        if loss not in ("squared", "logistic", "softmax"):
            raise ValueError(f"unknown head loss {loss!r}")
        if loss == "logistic" and outputs != 1:
            raise ValueError("a logistic head has one output")
        z = np.asarray(z, dtype=np.int64)
        if z.ndim != 1 or len(z) != len(x) or len(y) != len(x):
            raise ValueError("x, y and z must have one row per example")
        if z.size and (z.min() < 0 or z.max() >= num_domains):
            raise ValueError(f"domain labels must lie in 0..{num_domains - 1}")
        self.loss, self.outputs, self.num_domains = loss, outputs, num_domains
        self.device = device or default_device()
        self.dtype = dtype
        self.encoder = encoder_factory().to(device=self.device, dtype=dtype)
        self.x = torch.as_tensor(np.asarray(x), dtype=dtype, device=self.device)
        self.z = torch.as_tensor(z, device=self.device)
        self.z_np = z
        y = np.asarray(y)
        if loss == "softmax":
            self.y_np = y.astype(np.int64)
            self.y = torch.as_tensor(self.y_np, device=self.device)
        else:
            self.y_np = y.astype(np.float64).reshape(len(y), outputs)
            self.y = torch.as_tensor(self.y_np, dtype=dtype, device=self.device)
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)

    # -- what every device offers (LocalTrainer) ---------------------------------------------

    @property
    def num_examples(self) -> int:
        return int(self.x.shape[0])

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        """Joint SGD on encoder and heads, unweighted mean loss: FedAvg's local step."""
        heads = self._tensor(params[HEADS]).requires_grad_(True)
        self._load(params)
        out, mean_loss = self._sgd([*self.encoder.parameters(), heads], heads, None, epochs, lr, batch_size)
        return self._export(params, out | {HEADS: heads.detach().cpu().numpy().copy()}), mean_loss

    @torch.no_grad()
    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(mean loss, accuracy); accuracy is NaN for regression, which has none."""
        ev = self.evaluate_domains(params)
        n = max(int(ev.count.sum()), 1)
        accuracy = float(ev.correct.sum() / n) if ev.correct is not None else float("nan")
        return float(ev.loss_sum.sum() / n), accuracy

    def held_out(self, share: float, seed: int) -> tuple[DomainTrainer, DomainTrainer]:
        """(training view, held-out view), as ``tally.training.DeviceTensors.held_out``."""
        train, held = held_out_indices(self.num_examples, share, seed)
        return self._rows(train), self._rows(held)

    def _rows(self, rows: np.ndarray) -> DomainTrainer:
        view = copy.copy(self)
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        view.x, view.y, view.z = self.x[index], self.y[index], self.z[index]
        view.y_np, view.z_np = self.y_np[rows], self.z_np[rows]
        return view

    # -- what FedDAR needs (tally.algorithms.feddar.DomainDevice) -----------------------------

    def domain_counts(self) -> np.ndarray:
        return np.bincount(self.z_np, minlength=self.num_domains).astype(np.int64)

    @torch.no_grad()
    def evaluate_domains(self, params: Mapping[str, np.ndarray]) -> DomainEval:
        self._load(params)
        logits = self._logits(self._features(), self._tensor(params[HEADS]))
        losses = self._losses(logits, torch.arange(self.num_examples, device=self.device)).cpu().numpy()
        count = self.domain_counts()
        loss_sum = np.bincount(self.z_np, weights=losses, minlength=self.num_domains)
        if self.loss == "squared":
            return DomainEval(loss_sum, count, None)
        if self.loss == "logistic":
            hits = ((logits[:, 0] > 0).to(self.dtype) == self.y[:, 0]).cpu().numpy()
        else:
            hits = (logits.argmax(dim=1) == self.y).cpu().numpy()
        return DomainEval(loss_sum, count, np.bincount(self.z_np, weights=hits, minlength=self.num_domains))

    def train_heads(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> np.ndarray:
        """Minibatch SGD on each present domain's head over that domain's examples only, with the
        encoder frozen (Algorithm 1's head phase); absent domains' heads come back unchanged."""
        features = self._numpy_features(params)
        heads = self._domain_heads(params).copy()
        for m in np.flatnonzero(self.domain_counts()):
            rows = np.flatnonzero(self.z_np == m)
            for _ in range(epochs):
                order = self.rng.permutation(rows)
                for start in range(0, len(order), batch_size):
                    batch = order[start : start + batch_size]
                    residual = self._residuals(features[batch] @ heads[m].T, batch)
                    heads[m] -= lr * residual.T @ features[batch] / len(batch)
        return heads

    def head_derivatives(self, params: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Gradient (M, P) and Hessian (M, P, P) of each domain's mean loss R̂_{i,m} with respect
        to head m at ``params["heads"]``, P = N (k + 1); zeros for domains this device lacks.

        With e_j the loss's residual and C_j its curvature in the logits (I for squared loss,
        μ(1 - μ) for logistic, diag(p) - pp^T for softmax): g = (1/L) Σ e_j ⊗ z_j and
        H = (1/L) Σ C_j ⊗ z_j z_j^T (specs/feddar.md section 4.4).
        """
        features = self._numpy_features(params)
        heads = self._domain_heads(params)
        m_heads, n_out, n_feat = heads.shape
        size = n_out * n_feat
        grads = np.zeros((m_heads, size))
        hessians = np.zeros((m_heads, size, size))
        for m in np.flatnonzero(self.domain_counts()):
            rows = np.flatnonzero(self.z_np == m)
            f = features[rows]
            logits = f @ heads[m].T
            grads[m] = (self._residuals(logits, rows).T @ f).ravel() / len(rows)
            curvature = self._curvature(logits)
            hessians[m] = np.einsum("jab,jf,jg->afbg", curvature, f, f).reshape(size, size) / len(rows)
        return grads, hessians

    def train_encoder(
        self,
        params: Mapping[str, np.ndarray],
        domain_weights: np.ndarray,
        epochs: int,
        lr: float,
        batch_size: int,
    ) -> tuple[Arrays, float]:
        """SGD on the encoder with the heads frozen, minimising the batch mean of u_z · loss
        (section 3: an unbiased estimate of the re-weighted client loss, not normalised by Σu)."""
        self._load(params)
        heads = self._tensor(params[HEADS])
        weights = self._tensor(domain_weights)
        out, mean_loss = self._sgd(list(self.encoder.parameters()), heads, weights, epochs, lr, batch_size)
        return self._export(encoder_part(params), out), mean_loss

    # -- internals -----------------------------------------------------------------------------

    def _domain_heads(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        heads = np.asarray(params[HEADS], dtype=np.float64)
        if heads.ndim != 3 or heads.shape[:2] != (self.num_domains, self.outputs):
            raise ValueError(f"heads must have shape ({self.num_domains}, {self.outputs}, k + 1), got {heads.shape}")
        return heads

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(array), dtype=self.dtype, device=self.device).clone()

    def _load(self, params: Mapping[str, np.ndarray]) -> None:
        state = self.encoder.state_dict()
        check_fits(params, {PREFIX + k: tuple(v.shape) for k, v in state.items()})
        self.encoder.load_state_dict({k: self._tensor(params[PREFIX + k]) for k in state})

    def _export(self, like: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray]) -> Arrays:
        """Same names and order as ``like`` (flatten/unflatten rely on the order), same dtypes."""
        return {k: np.asarray(values[k]).astype(np.asarray(like[k]).dtype) for k in like}

    def _features(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.x if rows is None else self.x[rows]
        f = self.encoder(x)
        return torch.cat([f, torch.ones_like(f[:, :1])], dim=1)

    @torch.no_grad()
    def _numpy_features(self, params: Mapping[str, np.ndarray]) -> np.ndarray:
        self._load(params)
        return self._features().cpu().numpy().astype(np.float64)

    def _logits(self, features: torch.Tensor, heads: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        if heads.shape[0] == 1:
            chosen = heads.expand(features.shape[0], -1, -1)
        elif heads.shape[0] == self.num_domains:
            chosen = heads[self.z if rows is None else self.z[rows]]
        else:
            raise ValueError(f"{heads.shape[0]} heads for {self.num_domains} domains: need 1 or M")
        return torch.einsum("nof,nf->no", chosen, features)

    def _losses(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.loss == "squared":
            return 0.5 * ((logits - self.y[rows]) ** 2).sum(dim=1)
        if self.loss == "logistic":
            return nn.functional.binary_cross_entropy_with_logits(logits[:, 0], self.y[rows, 0], reduction="none")
        return nn.functional.cross_entropy(logits, self.y[rows], reduction="none")

    def _sgd(
        self,
        trainable: list[torch.Tensor],
        heads: torch.Tensor,
        domain_weights: torch.Tensor | None,
        epochs: int,
        lr: float,
        batch_size: int,
    ) -> tuple[Arrays, float]:
        losses = []
        for rows in minibatches(self.num_examples, epochs, batch_size, self.generator, self.device):
            per_example = self._losses(self._logits(self._features(rows), heads, rows), rows)
            if domain_weights is not None:
                per_example = per_example * domain_weights[self.z[rows]]
            loss = per_example.mean()
            # Plain SGD by hand: constructing a torch optimiser per call costs more than
            # the few steps a small device takes.
            grads = torch.autograd.grad(loss, trainable)
            with torch.no_grad():
                for param, grad in zip(trainable, grads):
                    param.sub_(lr * grad)
            losses.append(loss.item())
        state = {PREFIX + k: v.detach().cpu().numpy().copy() for k, v in self.encoder.state_dict().items()}
        return state, mean_loss(losses)

    def _residuals(self, logits: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """d loss / d logits per example: prediction minus target, in the loss's own link."""
        if self.loss == "squared":
            return logits - self.y_np[rows]
        if self.loss == "logistic":
            return _sigmoid(logits) - self.y_np[rows]
        return _softmax(logits) - np.eye(self.outputs)[self.y_np[rows]]

    def _curvature(self, logits: np.ndarray) -> np.ndarray:
        """d² loss / d logits² per example, (n, N, N)."""
        if self.loss == "squared":
            return np.broadcast_to(np.eye(self.outputs), (len(logits), self.outputs, self.outputs))
        if self.loss == "logistic":
            mu = _sigmoid(logits)
            return (mu * (1 - mu))[:, :, None]
        p = _softmax(logits)
        return np.einsum("na,ab->nab", p, np.eye(self.outputs)) - np.einsum("na,nb->nab", p, p)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def initial_params(encoder: nn.Module, heads: int, outputs: int, scale: float = 1.0, seed: int = 0) -> Arrays:
    """Encoder state under ``encoder.`` names plus ``heads`` ~ N(0, scale²) of shape
    (heads, outputs, features + 1), all float64 (second-order head aggregation needs the
    precision); the feature count is read off a forward pass."""
    first = next(encoder.parameters())
    with torch.no_grad():
        features = encoder(torch.zeros(1, _input_width(encoder), dtype=first.dtype)).shape[1]
    rng = np.random.default_rng(seed)
    params = {PREFIX + k: v.detach().cpu().numpy().astype(np.float64) for k, v in encoder.state_dict().items()}
    params[HEADS] = scale * rng.standard_normal((heads, outputs, features + 1))
    return params


def _input_width(encoder: nn.Module) -> int:
    first_linear = next(m for m in encoder.modules() if isinstance(m, nn.Linear))
    return first_linear.in_features

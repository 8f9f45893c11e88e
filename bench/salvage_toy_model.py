"""The numpy toy of specs/local-adaptation.md section 12.D: does local adaptation salvage the
participants that federated learning (plain, DP or median-aggregated) leaves worse off than
their own local model?

Softmax regression over 100 synthetic participants: a majority group around one weight matrix,
a minority group (the first 10 % or 30 %) around a shifted one. Each participant trains a local
model from zero; FL runs with three aggregation rules (spec sections 1-3); the final federated
model is then adapted on every participant by fine-tuning, EWC or distillation (section 6).

Every participant's SGD runs in lockstep in one batched numpy array (participants x classes x
features), so a whole seed takes seconds rather than the spec's 1.5 minutes.

ROBUST-FED (the coordinate-wise median) exists here only as the paper's comparison baseline.
Tally's servers only ever see sums, and a median needs every individual update (spec section 10),
so it can never be a Tally service algorithm. BASIC-FED and DP-FED are sums and are the mean and
clip rules of Tally's FedAvg and central DP; DP-FED clips with Tally's own ``clip_l2``. Its noise
comes from the toy's seeded generator instead of ``tally.privacy.randomness`` (the OS CSPRNG), so
that a seed reproduces a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from tally.privacy.mechanisms import clip_l2

Aggregation = Literal["basic", "dp", "robust"]
Method = Literal["ft", "ewc", "kd"]
AGGREGATIONS: tuple[Aggregation, ...] = ("basic", "dp", "robust")
METHODS: tuple[Method, ...] = ("ft", "ewc", "kd")

# the loss's gradient in the logits (P, b, C), from the logits, one-hot labels and batch features
LogitGrad = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
ParamGrad = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ToyConfig:
    """The recipe of 12.D; configs A and B differ only in the minority share and shift."""

    minority_share: float = 0.1
    shift: float = 1.2
    participants: int = 100
    classes: int = 5
    features: int = 10
    within_group_std: float = 0.1
    label_temperature: float = 2.0
    min_train: int = 10
    max_train: int = 100
    test_size: int = 400
    batch: int = 20
    lr: float = 0.1
    local_epochs: int = 100
    rounds: int = 200
    per_round: int = 10
    fl_epochs: int = 2
    eta: float = 1.0
    dp_clip: float = 1.0
    dp_sigma: float = 0.15
    adapt_epochs: int = 20
    ewc_lambda: float = 5.0
    kd_weight: float = 0.5
    kd_temperature: float = 6.0


CONFIG_A = ToyConfig(minority_share=0.1, shift=1.2)
CONFIG_B = ToyConfig(minority_share=0.3, shift=1.5)


@dataclass
class ToyData:
    """Padded per-participant arrays; features carry a trailing 1 so the bias is a weight column."""

    train_x: np.ndarray  # (P, max_train, D)
    train_y: np.ndarray  # (P, max_train) int, padding rows are never read
    counts: np.ndarray  # (P,)
    test_x: np.ndarray  # (P, test_size, D)
    test_y: np.ndarray  # (P, test_size)
    minority: np.ndarray  # (P,) bool
    classes: int

    @property
    def participants(self) -> int:
        return len(self.counts)

    def subset(self, index: np.ndarray) -> ToyData:
        return ToyData(self.train_x[index], self.train_y[index], self.counts[index],
                       self.test_x[index], self.test_y[index], self.minority[index], self.classes)


def make_data(config: ToyConfig, seed: int) -> ToyData:
    rng = np.random.default_rng([seed, 0])
    p, c, d = config.participants, config.classes, config.features
    w0 = rng.normal(size=(c, d))
    w1 = w0 + rng.normal(scale=config.shift, size=(c, d))
    minority = np.arange(p) < round(config.minority_share * p)
    centres = np.where(minority[:, None, None], w1, w0)
    truth = centres + rng.normal(scale=config.within_group_std, size=(p, c, d))
    counts = np.round(np.exp(rng.uniform(np.log(config.min_train), np.log(config.max_train), p))).astype(int)

    def sample(n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(p, n, d))
        logits = config.label_temperature * np.einsum("pnd,pcd->pnc", x, truth)
        probs = _softmax(logits)
        y = (probs.cumsum(axis=2) < rng.random((p, n, 1))).sum(axis=2)
        return np.concatenate([x, np.ones((p, n, 1))], axis=2), np.minimum(y, c - 1)

    train_x, train_y = sample(config.max_train)
    test_x, test_y = sample(config.test_size)
    return ToyData(train_x, train_y, counts, test_x, test_y, minority, c)


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _cross_entropy_grad(z: np.ndarray, onehot: np.ndarray, _x: np.ndarray) -> np.ndarray:
    return _softmax(z) - onehot


def sgd(weights: np.ndarray, data: ToyData, epochs: int, lr: float, batch: int, rng: np.random.Generator,
        logit_grad: LogitGrad = _cross_entropy_grad, param_grad: ParamGrad | None = None) -> np.ndarray:
    """Minibatch SGD for every participant at once, each over its own shuffled examples.

    A participant whose epoch has fewer batches than the largest skips the extra steps, so each
    one takes exactly ceil(n_i / batch) steps per epoch, as if it trained alone.
    """
    w = np.array(weights, dtype=np.float64, order="C", copy=True)
    p, n_max = data.train_y.shape
    eye = np.eye(data.classes)
    for _ in range(epochs):
        keys = rng.random((p, n_max))
        keys[np.arange(n_max)[None, :] >= data.counts[:, None]] = np.inf
        order = np.argsort(keys, axis=1)
        for start in range(0, int(data.counts.max()), batch):
            ranks = np.arange(start, min(start + batch, n_max))
            valid = ranks[None, :] < data.counts[:, None]  # (P, b)
            taken = valid.sum(axis=1)
            active = taken > 0
            idx = order[:, ranks]
            xb = np.take_along_axis(data.train_x, idx[:, :, None], axis=1)
            yb = eye[np.take_along_axis(data.train_y, idx, axis=1)]
            z = np.einsum("pbd,pcd->pbc", xb, w)
            g = logit_grad(z, yb, xb) * (valid / np.maximum(taken, 1)[:, None])[:, :, None]
            grad = np.einsum("pbc,pbd->pcd", g, xb)
            if param_grad is not None:
                grad += param_grad(w) * active[:, None, None]
            w -= lr * grad
    return w


def accuracy(weights: np.ndarray, data: ToyData) -> np.ndarray:
    """Each participant's accuracy on its own test points; ``weights`` is one model (C, D) or one
    per participant (P, C, D)."""
    w = np.broadcast_to(weights, (data.participants, *np.shape(weights)[-2:]))
    predicted = np.einsum("pnd,pcd->pnc", data.test_x, w).argmax(axis=2)
    return (predicted == data.test_y).mean(axis=1)


# --- aggregation rules (spec sections 1-3, oracles 12.A) -----------------------------------------

def mean_aggregate(global_: np.ndarray, models: np.ndarray, eta: float = 1.0) -> np.ndarray:
    """Eq. 1: G + (eta/m) * sum(P_i - G), the unweighted mean of updates."""
    return _apply_mean(global_, models - global_, eta)


def _apply_mean(global_: np.ndarray, updates: np.ndarray, eta: float) -> np.ndarray:
    return global_ + (eta / len(updates)) * updates.sum(axis=0)


def median_aggregate(global_: np.ndarray, models: np.ndarray, eta: float = 1.0,
                     convention: Literal["mean", "lower"] = "mean") -> np.ndarray:
    """Eq. 4 (comparison baseline only: a median is not a sum, so no Tally server can compute it).

    For an even count, ``mean`` averages the two middle values (numpy, used by the toy) and
    ``lower`` takes the lower one (torch.median, the authors' code)."""
    updates = models - global_
    if convention == "mean":
        middle = np.median(updates, axis=0)
    elif convention == "lower":
        middle = np.sort(updates, axis=0)[(len(models) - 1) // 2]
    else:
        raise ValueError(f"median convention must be 'mean' or 'lower', got {convention!r}")
    return global_ + eta * middle


def clip_update(update: np.ndarray, clip: float) -> np.ndarray:
    """Clip(Delta, S) over the whole model update, with Tally's device-side L2 clip."""
    return clip_l2(update.reshape(-1), clip).reshape(update.shape)


def dp_aggregate(global_: np.ndarray, models: np.ndarray, eta: float, clip: float, sigma: float,
                 noise_rng: np.random.Generator) -> np.ndarray:
    """Eq. 3: the mean of clipped updates plus per-coordinate N(0, sigma) added by the server.

    The same rule as Tally's central DP on a secure sum, whose noise std on the sum is z * clip:
    here z = sigma * m / (eta * clip)."""
    clipped = np.stack([clip_update(update, clip) for update in models - global_])
    return _apply_mean(global_, clipped, eta) + sigma * noise_rng.standard_normal(global_.shape)


def aggregate(kind: Aggregation, global_: np.ndarray, models: np.ndarray, config: ToyConfig,
              noise_rng: np.random.Generator) -> np.ndarray:
    if kind == "basic":
        return mean_aggregate(global_, models, config.eta)
    if kind == "dp":
        return dp_aggregate(global_, models, config.eta, config.dp_clip, config.dp_sigma, noise_rng)
    if kind == "robust":
        return median_aggregate(global_, models, config.eta)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {kind!r}")


# --- training ------------------------------------------------------------------------------------

def zero_model(data: ToyData) -> np.ndarray:
    return np.zeros((data.classes, data.train_x.shape[2]))


def train_local(data: ToyData, config: ToyConfig, rng: np.random.Generator) -> np.ndarray:
    """Every participant's model trained from zero on its own data alone (P, C, D)."""
    start = np.broadcast_to(zero_model(data), (data.participants, *zero_model(data).shape))
    return sgd(start, data, config.local_epochs, config.lr, config.batch, rng)


def federated_round(global_: np.ndarray, data: ToyData, chosen: np.ndarray, kind: Aggregation,
                    config: ToyConfig, rng: np.random.Generator, noise_rng: np.random.Generator,
                    epochs: int | None = None, lr: float | None = None) -> np.ndarray:
    """Algorithm 1 on the chosen participants, then the aggregation rule."""
    subset = data.subset(chosen)
    start = np.broadcast_to(global_, (len(chosen), *global_.shape))
    models = sgd(start, subset, config.fl_epochs if epochs is None else epochs,
                 config.lr if lr is None else lr, config.batch, rng)
    return aggregate(kind, global_, models, config, noise_rng)


def train_federated(data: ToyData, kind: Aggregation, config: ToyConfig, seed: int) -> np.ndarray:
    """G^T after ``config.rounds`` rounds. Participant sampling and shuffling draw from one stream
    and the DP noise from another, so DP with S = inf and sigma = 0 replays BASIC bit for bit."""
    rng = np.random.default_rng([seed, 1])
    noise_rng = np.random.default_rng([seed, 2])
    g = zero_model(data)
    for _ in range(config.rounds):
        chosen = rng.choice(data.participants, size=config.per_round, replace=False)
        g = federated_round(g, data, chosen, kind, config, rng, noise_rng)
    return g


# --- local adaptation (spec section 6) -----------------------------------------------------------

def pooled_fisher(global_: np.ndarray, data: ToyData) -> np.ndarray:
    """Diagonal empirical Fisher of G^T: the mean squared per-example gradient over every
    participant's training examples (the experimenter's pooled data, as in the authors' code)."""
    valid = np.arange(data.train_y.shape[1])[None, :] < data.counts[:, None]
    x = data.train_x[valid]
    g = _softmax(x @ global_.T) - np.eye(data.classes)[data.train_y[valid]]
    return np.einsum("nc,nd->cd", g**2, x**2) / len(x)


def adapt(global_: np.ndarray, data: ToyData, method: Method, config: ToyConfig, rng: np.random.Generator,
          fisher: np.ndarray | None = None, epochs: int | None = None, lr: float | None = None) -> np.ndarray:
    """Every participant's copy of G^T adapted on its own data (P, C, D).

    ``ewc`` adds (lambda/2) F (A - G)^2; ``kd`` is the authors' code form: weight w on
    K^2 KL(softmax(G/K) || softmax(A/K)) (batch mean) and 1 - w on the hard cross-entropy."""
    start = np.broadcast_to(global_, (data.participants, *global_.shape))
    epochs = config.adapt_epochs if epochs is None else epochs
    lr = config.lr if lr is None else lr
    if method == "ft":
        return sgd(start, data, epochs, lr, config.batch, rng)
    if method == "ewc":
        f = pooled_fisher(global_, data) if fisher is None else fisher
        return sgd(start, data, epochs, lr, config.batch, rng,
                   param_grad=lambda w: config.ewc_lambda * f * (w - global_))
    if method == "kd":
        k, w_soft = config.kd_temperature, config.kd_weight

        def kd_grad(z: np.ndarray, onehot: np.ndarray, x: np.ndarray) -> np.ndarray:
            teacher = _softmax(x @ global_.T / k)
            return w_soft * k * (_softmax(z / k) - teacher) + (1 - w_soft) * (_softmax(z) - onehot)

        return sgd(start, data, epochs, lr, config.batch, rng, logit_grad=kd_grad)
    raise ValueError(f"adaptation method must be one of {METHODS}, got {method!r}")


# --- one seed of the experiment and its summary (the tables of 12.D) ------------------------------

@dataclass
class SeedResult:
    """Per-participant test accuracies of one seed: local-only, federated and adapted models."""

    local: np.ndarray
    minority: np.ndarray
    federated: dict[Aggregation, np.ndarray]
    adapted: dict[Aggregation, dict[Method, np.ndarray]]

    def best(self, kind: Aggregation) -> np.ndarray:
        """The per-participant best of the three techniques, chosen on test data as the paper
        does (optimistic; spec 11 #5)."""
        return np.max(np.stack(list(self.adapted[kind].values())), axis=0)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"local": float(self.local.mean())}
        for kind in self.federated:
            fed = self.federated[kind]
            out[kind] = {
                "fed": float(fed.mean()),
                "fed_majority": float(fed[~self.minority].mean()),
                "fed_minority": float(fed[self.minority].mean()),
                "share_losing": share_losing(self.local, fed),
                "share_losing_minority": share_losing(self.local[self.minority], fed[self.minority]),
                **{m: float(acc.mean()) for m, acc in self.adapted[kind].items()},
                "best": float(self.best(kind).mean()),
                "share_losing_adapted": share_losing(self.local, self.best(kind)),
            }
        return out


def share_losing(local: np.ndarray, other: np.ndarray) -> float:
    """The share of participants whose local model is strictly more accurate (a tie is no loss)."""
    return float(np.mean(local > other))


def run_seed(config: ToyConfig, seed: int, aggregations: tuple[Aggregation, ...] = AGGREGATIONS) -> SeedResult:
    data = make_data(config, seed)
    local = accuracy(train_local(data, config, np.random.default_rng([seed, 4])), data)
    federated, adapted = {}, {}
    for kind in aggregations:
        g = train_federated(data, kind, config, seed)
        federated[kind] = accuracy(g, data)
        fisher = pooled_fisher(g, data)
        # every technique sees the same shuffles, so they differ only in their losses
        adapted[kind] = {m: accuracy(adapt(g, data, m, config, np.random.default_rng([seed, 3]), fisher), data)
                         for m in METHODS}
    return SeedResult(local, data.minority, federated, adapted)


# --- per-participant accuracy without own test data (spec 4.2, the paper's CIFAR metric) ---------

def class_shares(labels: np.ndarray, classes: int) -> np.ndarray:
    """pi_i: a participant's share of each class in its training labels."""
    counts = np.bincount(np.asarray(labels), minlength=classes).astype(np.float64)
    return counts / counts.sum()


def class_weighted_accuracy(shares: np.ndarray, predicted: np.ndarray, labels: np.ndarray) -> float:
    """acc_i = sum_c pi_ic acc_c, with acc_c the model's class-c accuracy on a shared test set:
    the paper's CIFAR participants have no test data of their own."""
    classes = len(shares)
    per_class = np.array([np.mean(predicted[labels == c] == c) if np.any(labels == c) else 0.0
                          for c in range(classes)])
    return float(shares @ per_class)

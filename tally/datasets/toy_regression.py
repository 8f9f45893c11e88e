"""AgnosticFedAvg's toy regression (paper Appendix B, recipe of specs/agnostic-fedavg.md §5.3.2).

Each domain is a set of points in R; the model is one scalar ``w`` with per-example loss
(y - w)². Points of domain d are 10·U[0,1) + d² (so the domains sit at increasing distances),
shifted so that the extreme empirical centres are ±a: the centres-only minimax solution is then
exactly 0, and with the per-example loss it moves to (var_max - var_min) / (2(c_max - c_min)),
which ``ToyRegression.minimax`` computes exactly. FedAvg converges to the pooled mean instead.

The random draws follow the spec's order (``RandomState(seed)`` for the clients' domains,
``RandomState(seed + 1)`` for the points), so seed 0 reproduces its numbers: counts
[988, 961, 1048, 1010, 993] and centres [-8.027, -6.798, -3.901, 1.038, 8.027].
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from tally.algorithms.packages import DOMAIN_STATISTICS

Arrays = dict[str, np.ndarray]
PARTITIONS = ("client", "data")


class ScalarRegressionDevice:
    """One device's targets and domain ids; model ``{"w": array of shape (1,)}``, loss (y - w)².

    Offers both ``LocalTrainer`` (batch-mean SGD, so plain FedAvg runs on it) and AgnosticFedAvg's
    ``DomainDevice``. The gradient is analytic, so a thousand devices train in milliseconds.
    """

    capabilities = (DOMAIN_STATISTICS,)  # declared at check-in: AgnosticFedAvg may seat it

    def __init__(self, targets: np.ndarray, domains: np.ndarray, seed: int = 0) -> None:
        self.targets = np.asarray(targets, dtype=np.float64)
        self.domains = np.asarray(domains, dtype=np.int64)
        if self.targets.shape != self.domains.shape or self.targets.ndim != 1:
            raise ValueError("targets and domains must be 1-D arrays of the same length")
        self.rng = np.random.default_rng(seed)

    @property
    def num_examples(self) -> int:
        return int(self.targets.size)

    def _sgd(self, w: float, coefficients: np.ndarray | None, epochs: int, lr: float, batch_size: int) -> float:
        """SGD on Σ_{j∈b} c_j (y_j - w)² per shuffled batch b; ``None`` means c_j = 1/|b|.

        Each step is affine in w, w <- a_b·w + d_b with a_b = 1 - 2·lr·Σc_j and d_b = 2·lr·Σc_j·y_j,
        so an epoch is computed in closed form, w·Πa_b + Σ_b d_b·Π_{b'>b} a_b' -- the same
        sequential SGD, vectorised over batches."""
        n = self.num_examples
        starts = np.arange(0, n, batch_size)
        sizes = np.diff(np.append(starts, n))
        for _ in range(epochs):
            if n == 0:
                break
            order = self.rng.permutation(n)
            c = np.repeat(1.0 / sizes, sizes) if coefficients is None else coefficients[order]
            a = 1.0 - 2.0 * lr * np.add.reduceat(c, starts)
            d = 2.0 * lr * np.add.reduceat(c * self.targets[order], starts)
            later = np.append(np.cumprod(a[:0:-1])[::-1], 1.0)  # Π_{b'>b} a_b'
            w = w * float(np.prod(a)) + float(d @ later)
        return w

    def train(self, params: Mapping[str, np.ndarray], epochs: int, lr: float, batch_size: int) -> tuple[Arrays, float]:
        w = self._sgd(float(params["w"][0]), None, epochs, lr, batch_size)
        return {"w": np.array([w])}, self.evaluate({"w": np.array([w])})[0]

    def evaluate(self, params: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(mean squared error, NaN): regression has no accuracy."""
        return float(np.mean((self.targets - params["w"][0]) ** 2)), float("nan")

    def domain_statistics(self, params: Mapping[str, np.ndarray], num_domains: int) -> tuple[np.ndarray, np.ndarray]:
        losses = (self.targets - float(params["w"][0])) ** 2
        return (np.bincount(self.domains, minlength=num_domains),
                np.bincount(self.domains, weights=losses, minlength=num_domains))

    def train_domain_weighted(
        self, params: Mapping[str, np.ndarray], domain_weights: np.ndarray, normaliser: float,
        epochs: int, lr: float, batch_size: int,
    ) -> Arrays:
        coefficients = np.asarray(domain_weights, dtype=np.float64)[self.domains] / normaliser
        return {"w": np.array([self._sgd(float(params["w"][0]), coefficients, epochs, lr, batch_size)])}


@dataclass
class ToyRegression:
    """The pooled data (for exact per-domain losses) and its split across devices."""

    points: np.ndarray
    domains: np.ndarray
    client_points: list[np.ndarray]
    client_domains: list[np.ndarray]
    num_domains: int

    def devices(self, seed: int = 0) -> list[ScalarRegressionDevice]:
        return [ScalarRegressionDevice(y, d, seed + k)
                for k, (y, d) in enumerate(zip(self.client_points, self.client_domains))]

    @property
    def centres(self) -> np.ndarray:
        return np.array([self.points[self.domains == i].mean() for i in range(self.num_domains)])

    @property
    def variances(self) -> np.ndarray:
        return np.array([self.points[self.domains == i].var() for i in range(self.num_domains)])

    @property
    def pooled_mean(self) -> float:
        """FedAvg's fixed point: the example-weighted mean."""
        return float(self.points.mean())

    def domain_losses(self, w: float) -> np.ndarray:
        """Per-domain mean squared error of ``w``: (c_i - w)² + var_i."""
        return (self.centres - w) ** 2 + self.variances

    def centre_losses(self, w: float) -> np.ndarray:
        """(c_i - w)², the objective of the paper's appendix."""
        return (self.centres - w) ** 2

    def domain_metrics(self, params: Mapping[str, np.ndarray]) -> dict[str, float | list[float]]:
        """What a report shows for model ``params``: w, the exact optimum, the per-domain mean
        squared errors over all points of each domain and the worst of them."""
        w = float(params["w"][0])
        losses = self.domain_losses(w)
        return {"w": w, "w_star": self.minimax(), "per_domain_loss": losses.tolist(),
                "worst_domain_loss": float(losses.max()), "mean_loss": float(np.mean((self.points - w) ** 2))}

    def minimax(self) -> float:
        """argmin_w max_i domain_losses(w), exactly.

        The losses are parabolas of equal curvature, so the convex max is minimised either at one
        parabola's vertex or where two cross; the best of those candidates is the answer."""
        c, v = self.centres, self.variances
        candidates = list(c)
        for i, j in combinations(range(c.size), 2):
            if c[i] != c[j]:
                candidates.append((c[i] ** 2 - c[j] ** 2 + v[i] - v[j]) / (2 * (c[i] - c[j])))
        return float(min(candidates, key=lambda w: self.domain_losses(w).max()))


def toy_regression(
    clients: int = 50,
    domains: int = 5,
    samples_per_client: int = 100,
    noise: float = 10.0,
    partition: str = "client",
    alpha: float | None = None,
    seed: int = 0,
) -> ToyRegression:
    """``clients·samples_per_client`` points in ``domains`` domains, centred as in the spec.

    ``noise`` is the width of each domain's uniform spread (the spec's 10). ``partition``:
    "client" (each device draws one domain uniformly and receives random points of it; the
    paper's toy) or "data" (points go to any device: uniformly when ``alpha`` is None, the spec's
    variant, else with per-device domain mixtures drawn from Dir(alpha)).
    """
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if clients < 1 or domains < 1 or samples_per_client < 1:
        raise ValueError("clients, domains and samples_per_client must be >= 1")
    if partition == "client" and clients < domains:
        raise ValueError(f"a client partition needs at least one device per domain: {clients} < {domains}")
    client_rng = np.random.RandomState(seed)
    client_domain = client_rng.randint(0, domains, size=clients)
    # Redraw (rarely, and never for the spec's 50 devices and seeds) until no domain is orphaned.
    while partition == "client" and np.unique(client_domain).size < domains:
        client_domain = client_rng.randint(0, domains, size=clients)
    rng = np.random.RandomState(seed + 1)
    total = clients * samples_per_client
    point_domain = rng.randint(0, domains, size=total)
    points = noise * rng.uniform(size=total) + point_domain.astype(np.float64) ** 2
    centres = np.array([points[point_domain == i].mean() for i in range(domains)])
    points -= (centres.max() + centres.min()) / 2
    if partition == "client":
        owner = np.empty(total, dtype=np.int64)
        for i in range(domains):
            mine = np.flatnonzero(point_domain == i)
            owner[mine] = rng.choice(np.flatnonzero(client_domain == i), size=mine.size)
    elif alpha is None:
        owner = rng.randint(0, clients, size=total)
    else:
        mixtures = rng.dirichlet(np.full(domains, alpha), size=clients)
        owner = np.array([rng.choice(clients, p=mixtures[:, d] / mixtures[:, d].sum()) for d in point_domain])
    return ToyRegression(
        points=points,
        domains=point_domain,
        client_points=[points[owner == k] for k in range(clients)],
        client_domains=[point_domain[owner == k] for k in range(clients)],
        num_domains=domains,
    )

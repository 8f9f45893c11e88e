"""The online layer of AAggFF (Hahn et al., ICML 2024; ``specs/aaggff.md`` §2-§5): the portfolio math.

Pure functions of the spec, apart from any secure sum: the response CDFs, the decision loss and its
gradients, the doubly-robust estimate, entropic FTRL and the online Newton step with its exact
simplex QP, and the theorems' constants. ``tally.algorithms.aaggff`` runs them over sums; the tests
check them against the spec's oracles on their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

CDFS = ("weibull", "frechet", "gumbel", "exponential", "logistic", "normal")



def cdf(name: str, x: np.ndarray, code_normal: bool = False) -> np.ndarray:
    """The six unit-scale CDFs of §2, evaluated at loss ratios x = F_i/F̄ ≥ 0.

    ``code_normal`` selects the authors' code's Normal branch ½(1 + erfc((x-1)/√2)), which *decreases*
    in x and ranges over [0.5, 1.5] (§9.4: a bug, kept only behind the ``normal_cdf`` flag).
    """
    x = np.maximum(np.asarray(x, dtype=np.float64), 0.0)
    if name == "weibull":
        return -np.expm1(-(x**2))
    if name == "frechet":
        with np.errstate(divide="ignore", over="ignore"):
            return np.exp(-1.0 / x)
    if name == "gumbel":
        return np.exp(-np.exp(-(x - 1.0)))
    if name == "exponential":
        return -np.expm1(-x)
    from scipy import special  # here, not at import: naming the algorithms (a job spec's check) needs no scipy

    if name == "logistic":
        return special.expit(x - 1.0)
    if name == "normal":
        z = (x - 1.0) / math.sqrt(2.0)
        return 0.5 * (1.0 + (special.erfc(z) if code_normal else special.erf(z)))
    raise ValueError(f"unknown CDF {name!r}; one of {CDFS}")


def transform_responses(
    losses: np.ndarray, mean_loss: float, cdf_name: str, c1: float, c2: float, code_normal: bool = False
) -> np.ndarray:
    """Eq. 3.8: r = C1 + (C2 - C1)·CDF(F/F̄). A zero mean loss means every device did equally well."""
    losses = np.asarray(losses, dtype=np.float64)
    ratio = losses / mean_loss if mean_loss > 0 else np.ones_like(losses)
    return c1 + (c2 - c1) * cdf(cdf_name, ratio, code_normal)


def decision_loss(p: np.ndarray, r: np.ndarray) -> float:
    """ℓ(p) = -log(1 + <p, r>) (Definition 3.3)."""
    return -math.log1p(float(np.dot(p, r)))


def decision_gradient(p: np.ndarray, r: np.ndarray) -> np.ndarray:
    """∇ℓ(p) = -r / (1 + <p, r>); its sup norm is at most C2/(1+C1) (Lemma 3.1, oracle 7)."""
    r = np.asarray(r, dtype=np.float64)
    return -r / (1.0 + float(np.dot(p, r)))


def dr_estimate(
    responses: np.ndarray, observed: np.ndarray, imputation: float, sampling_rate: float, code: bool = False
) -> np.ndarray:
    """The doubly-robust response estimate (Eq. 3.10 as reconstructed from Eq. 3.31/3.40).

    r̂_i = r̄ + 1[i∈S]·(r_i - r̄)/C; ``code`` drops the "+ r̄" for observed entries (§9.3).
    Entries of ``responses`` that are not observed are ignored.
    """
    responses = np.asarray(responses, dtype=np.float64)
    observed = np.asarray(observed, dtype=bool)
    excess = (responses - imputation) / sampling_rate
    return np.where(observed, excess + (0.0 if code else imputation), imputation)


def linearised_gradient(p: np.ndarray, r_hat: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Eq. 3.11: first-order expansion of h(r) = -r/(1+<p,r>) around r0 = ``reference``, at r̂."""
    p, r_hat, r0 = (np.asarray(a, dtype=np.float64) for a in (p, r_hat, reference))
    growth = 1.0 + float(p @ r0)
    return -r_hat / growth + r0 * float(p @ (r_hat - r0)) / growth**2


def entropic_decision(gradient_sum: np.ndarray, zeta: float, prior: np.ndarray | None = None) -> np.ndarray:
    """Closed form of entropic FTRL (Eq. 3.12): p ∝ prior·exp(-G/ζ); uniform prior by default.

    With a non-uniform prior and G = -r this is the one-step EG of the unification (Table 3.2).
    """
    logits = -np.asarray(gradient_sum, dtype=np.float64) / zeta
    if prior is not None:
        logits = logits + np.log(np.asarray(prior, dtype=np.float64))
    from scipy import special

    return special.softmax(logits)


def step_size(t: int, lipschitz: float, num_clients: int) -> float:
    """ζ^(t) = L·√t/√(log K) (Theorem 3.2; Remark 3.7 puts L̃∞ for L under sampling)."""
    return lipschitz * math.sqrt(t) / math.sqrt(math.log(num_clients))


def lipschitz(c1: float, c2: float) -> float:
    """L∞ = C2/(1+C1) (Lemma 3.1)."""
    return c2 / (1.0 + c1)


def dr_lipschitz(c1: float, c2: float, sampling_rate: float) -> float:
    """L̃∞ = C2/(1+C1) + 2(C2-C1)/(C(1+C1)) (Lemma 3.5, Eq. 3.46); 2 + C when C2 = C, C1 = 0."""
    return lipschitz(c1, c2) + 2.0 * (c2 - c1) / (sampling_rate * (1.0 + c1))


def ons_constants(num_clients: int, lipschitz_bound: float) -> tuple[float, float]:
    """(α, β) = (4·K·L∞, 1/(4·L∞)) (Theorem 3.1)."""
    return 4.0 * num_clients * lipschitz_bound, 1.0 / (4.0 * lipschitz_bound)


def ons_regret_bound(rounds: int, num_clients: int, lipschitz_bound: float) -> float:
    """Theorem 3.1: Regret_T ≤ 2·L∞·K·(1 + log(1 + T/(16K)))."""
    return 2.0 * lipschitz_bound * num_clients * (1.0 + math.log1p(rounds / (16.0 * num_clients)))


def ftrl_regret_bound(rounds: int, num_clients: int, lipschitz_bound: float) -> float:
    """Theorem 3.2: Regret_T ≤ 2·L∞·√(T·log K)."""
    return 2.0 * lipschitz_bound * math.sqrt(rounds * math.log(num_clients))


@dataclass(frozen=True)
class OnsHistory:
    """The sufficient statistics of Eq. 3.7: Σ g gᵀ, Σ g and Σ (g·p^(τ)) g over past rounds."""

    gram: np.ndarray
    gradient_sum: np.ndarray
    correction: np.ndarray

    @classmethod
    def empty(cls, num_clients: int) -> OnsHistory:
        zeros = np.zeros(num_clients)
        return cls(np.zeros((num_clients, num_clients)), zeros, zeros)

    def add(self, gradient: np.ndarray, decision: np.ndarray) -> OnsHistory:
        g = np.asarray(gradient, dtype=np.float64)
        return OnsHistory(
            self.gram + np.outer(g, g), self.gradient_sum + g, self.correction + float(g @ decision) * g
        )

    def quadratic(self, alpha: float, beta: float, code: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(A, b) of min_p b·p + ½pᵀAp: the thesis's A = αI + βΣggᵀ, b = Σg - βΣ(g·p_τ)g; with
        ``code`` the authors' objective A = α(1+β)I + βΣggᵀ, b = Σg (§9.2)."""
        eye = np.eye(len(self.gradient_sum))
        if code:
            return alpha * (1.0 + beta) * eye + beta * self.gram, self.gradient_sum.copy()
        return alpha * eye + beta * self.gram, self.gradient_sum - beta * self.correction


def simplex_qp(A: np.ndarray, b: np.ndarray, tol: float = 1e-13) -> np.ndarray:
    """argmin over the simplex of b·p + ½pᵀAp for a symmetric positive definite A (exact).

    A primal active-set method: each iterate solves the equality-constrained problem on the free
    coordinates through its KKT system, steps until a coordinate hits zero (which is then fixed),
    and frees the fixed coordinate with the most negative multiplier once the step vanishes. With A
    positive definite it terminates in finitely many steps at the unique optimum (K ≤ ~100 silos).
    """
    A, b = np.asarray(A, dtype=np.float64), np.asarray(b, dtype=np.float64)
    k = len(b)
    p = np.full(k, 1.0 / k)
    free = np.ones(k, dtype=bool)
    for _ in range(50 * k + 50):
        idx = np.flatnonzero(free)
        grad = A @ p + b
        n = len(idx)
        kkt = np.zeros((n + 1, n + 1))
        kkt[:n, :n] = A[np.ix_(idx, idx)]
        kkt[:n, n] = kkt[n, :n] = 1.0
        solution = np.linalg.solve(kkt, np.concatenate([-grad[idx], [0.0]]))
        step, mu = solution[:n], solution[n]
        if np.max(np.abs(step)) <= tol:
            multipliers = grad + mu  # λ_j = ∂f/∂p_j - ν for the fixed coordinates, ν = -μ
            fixed = np.flatnonzero(~free)
            if fixed.size == 0 or multipliers[fixed].min() >= -tol:
                p = np.maximum(p, 0.0)
                return p / p.sum()
            free[fixed[np.argmin(multipliers[fixed])]] = True
            continue
        shrinking = step < 0
        ratios = np.full(n, np.inf)
        ratios[shrinking] = -p[idx][shrinking] / step[shrinking]
        blocking = int(np.argmin(ratios))
        length = min(1.0, float(ratios[blocking]))
        p[idx] += length * step
        if length < 1.0:
            p[idx[blocking]] = 0.0
            free[idx[blocking]] = False
    raise RuntimeError("simplex QP did not converge; is A positive definite?")

"""Choice and validation of the SecAgg+ neighbour graph degree ``k`` and Shamir threshold ``t``.

The method is the parameter finder of Bell et al. 2020 (SecAgg+): a random Harary graph of even
degree ``k`` is accepted when it stays connected after the bad (corrupt or dropped) nodes are
removed except with probability 2^-(SECURITY_BITS+1), and when a threshold ``t`` exists that no
coalition of corrupt neighbours reaches (security, 2^-(SECURITY_BITS+1) over all nodes) while every
node keeps at least ``t`` surviving neighbours (correctness, failure 2^-CORRECTNESS_BITS over all
nodes). Cost grows with ``k``, so the smallest feasible ``k`` is taken, with the smallest secure
``t`` (the cheapest interpolation, and the most dropout headroom).

The analysis treats the rates as exact counts floor(rate * n). Below ``MIN_HARARY_N`` devices those
counts are too coarse to lean on (5% of 19 devices rounds to no corrupt device at all; at n = 10 the
realised dropout exceeds floor(0.1 * n) a quarter of the time), so small cohorts use the full graph
with worst-case rules that round the bad counts up. The Harary graph saves little there anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SECURITY_BITS = 40
CORRECTNESS_BITS = 20
MIN_HARARY_N = 100

_LOG2 = math.log(2.0)


def _floor(x: float) -> int:
    """floor that ignores float noise: 0.9 * 100 is 90.00000000000001, which must count as 90."""
    return math.floor(round(x, 9))


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))


class UnsafeParameters(ValueError):
    """Raised instead of running a sum whose privacy or correctness guarantee would not hold."""


@dataclass(frozen=True)
class ThreatModel:
    """Fractions of the cohort that may drop out and that may collude with the server.

    A malicious server can tell different devices different survivor sets, which costs a second
    dropout budget (Bell et al. 2020), hence the stricter budget in that case.
    """

    dropout_rate: float = 0.1
    corrupt_rate: float = 0.05
    malicious_server: bool = True

    def __post_init__(self) -> None:
        for name in ("dropout_rate", "corrupt_rate"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise UnsafeParameters(f"{name}={value} must lie in [0, 1)")
        if self.malicious_server:
            budget = self.corrupt_rate + 2 * self.dropout_rate
            if round(budget, 9) > 0.9:
                raise UnsafeParameters(
                    f"malicious server requires corrupt_rate + 2*dropout_rate <= 0.9, got "
                    f"{self.corrupt_rate} + 2*{self.dropout_rate} = {budget:.4g}"
                )
        else:
            budget = self.corrupt_rate + self.dropout_rate
            if round(budget, 9) > 0.9:
                raise UnsafeParameters(
                    f"semi-honest server requires corrupt_rate + dropout_rate <= 0.9, got "
                    f"{self.corrupt_rate} + {self.dropout_rate} = {budget:.4g}"
                )

    def corrupt_count(self, n: int) -> int:
        return _floor(self.corrupt_rate * n)

    def dropout_count(self, n: int) -> int:
        return _floor(self.dropout_rate * n)

    def survivor_count(self, n: int) -> int:
        return _ceil((1.0 - self.dropout_rate) * n)


@dataclass(frozen=True)
class GraphParams:
    """Graph degree ``k`` and Shamir threshold ``t`` for a cohort of ``n`` devices."""

    n: int
    k: int
    t: int

    @property
    def full(self) -> bool:
        return self.k == self.n - 1


def _log_disconnect_bound(n: int, k: int, bad: int) -> float:
    """Union bound on log P[the Harary graph disconnects once ``bad`` random nodes are removed].

    Disconnection needs two runs of k/2 consecutive bad nodes on the ring: about n(n-k-1)/2
    placements, each all-bad with probability bad!/(bad-k)! * (n-k)!/n!.
    """
    if k > bad:
        return -math.inf
    return (
        math.log(n)
        + math.log(n - k - 1)
        - _LOG2
        + math.lgamma(bad + 1)
        + math.lgamma(n - k + 1)
        - math.lgamma(n + 1)
        - math.lgamma(bad - k + 1)
    )


def _log_choose(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _log_tails(n: int, successes: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """log P[X > j] and log P[X < j] for j = 0..k, X ~ Hypergeometric(n, successes, k).

    Accumulating log-pmfs keeps the 2^-40-scale tails exact where 1 - cdf would round to zero.
    The pmf is written out with lgamma rather than taken from scipy.stats: the aggregator checks
    every session's parameters with it, and its image carries no scipy.
    """
    total = _log_choose(n, k)
    logpmf = np.array([
        _log_choose(successes, j) + _log_choose(n - successes, k - j) - total
        if j <= successes and k - j <= n - successes else -np.inf
        for j in range(k + 1)
    ])
    log_ge = np.logaddexp.accumulate(logpmf[::-1])[::-1]  # log P[X >= j]
    log_le = np.logaddexp.accumulate(logpmf)  # log P[X <= j]
    log_gt = np.append(log_ge[1:], -np.inf)
    log_lt = np.insert(log_le[:-1], 0, -np.inf)
    return log_gt, log_lt


def _harary_threshold_range(n: int, k: int, threat: ThreatModel) -> tuple[int, int]:
    """Smallest secure and largest correct threshold for a Harary graph of degree ``k``.

    The range is empty (first > second) when no threshold is both secure and correct.
    """
    log_gt, _ = _log_tails(n, threat.corrupt_count(n), k)
    _, log_lt = _log_tails(n, threat.survivor_count(n), k)
    security = -(SECURITY_BITS + 1) * _LOG2 - math.log(n)
    correctness = -CORRECTNESS_BITS * _LOG2 - math.log(n)
    corrupt = int(np.argmax(log_gt <= security))  # P[C > k] = 0, so always found
    # P[S < j] grows with j; the largest j still within the failure budget.
    correct = int(np.flatnonzero(log_lt <= correctness)[-1])
    return _secure_minimum(k, corrupt, threat), correct


def _secure_minimum(holders: int, corrupt: int, threat: ThreatModel) -> int:
    """Smallest t that ``corrupt`` colluding holders (plus a lying server) cannot reach.

    A malicious server may get t shares of an honest device's key from some holders and t of its
    seed from the others; 2t > holders + corrupt makes the two sets overlap in an honest holder,
    who never releases both.
    """
    if threat.malicious_server:
        return max((holders + corrupt) // 2 + 1, 2)
    return max(corrupt + 1, 2)


def _full_threshold_range(n: int, threat: ThreatModel) -> tuple[int, int]:
    """Threshold range for the full graph, worst case over which devices drop or are corrupt.

    Each device has n-1 holders, of which up to ceil(dropout*n) drop and ceil(corrupt*n) collude:
    rounding up keeps a 5% rate meaningful in a cohort of 10.
    """
    holders = n - 1
    return (
        _secure_minimum(holders, _ceil(threat.corrupt_rate * n), threat),
        holders - _ceil(threat.dropout_rate * n),
    )


def _connectivity_ok(n: int, k: int, threat: ThreatModel) -> tuple[bool, float]:
    bad = threat.corrupt_count(n) + threat.dropout_count(n)
    log_p = _log_disconnect_bound(n, k, bad)
    return log_p < -(SECURITY_BITS + 1) * _LOG2, log_p


def _cheapest_harary(n: int, threat: ThreatModel) -> GraphParams | None:
    for k in range(2, n - 1, 2):
        if not _connectivity_ok(n, k, threat)[0]:
            continue
        t_min, t_max = _harary_threshold_range(n, k, threat)
        if t_min <= t_max:
            return GraphParams(n=n, k=k, t=t_min)
    return None


def choose_params(n: int, threat: ThreatModel) -> GraphParams:
    """The cheapest safe Harary graph for cohorts of at least ``MIN_HARARY_N``, else the full graph.

    Raises UnsafeParameters when even the full graph cannot be both secure and correct.
    """
    if n < 2:
        raise UnsafeParameters(f"a secure sum needs at least 2 devices, got n={n}")
    if n >= MIN_HARARY_N and (harary := _cheapest_harary(n, threat)) is not None:
        return harary
    t_min, t_max = _full_threshold_range(n, threat)
    if t_min > t_max:
        raise UnsafeParameters(
            f"cohort too small: n={n} with dropout_rate={threat.dropout_rate} and "
            f"corrupt_rate={threat.corrupt_rate} needs threshold t >= {t_min} for security but "
            f"t <= {t_max} for correctness"
        )
    return GraphParams(n=n, k=n - 1, t=t_min)


# Cohort sizes tried for a suggestion; from MIN_HARARY_N on the Harary search answers for almost
# any n, so a suggestion is never far above.
_LARGEST_SUGGESTED_COHORT = 1000


def smallest_secure_cohort(above: int, threat: ThreatModel) -> int | None:
    """The smallest cohort size above ``above`` that ``threat`` admits a threshold for, so that an
    error can name the value to use instead of leaving the operator to bisect (None: none up to
    1000, and only a lower dropout or corrupt rate helps)."""
    for n in range(max(above + 1, 2), _LARGEST_SUGGESTED_COHORT + 1):
        try:
            choose_params(n, threat)
        except UnsafeParameters:
            continue
        return n
    return None


def validate_params(params: GraphParams, threat: ThreatModel) -> None:
    """Refuse a user-supplied (k, t) unless it carries the same guarantees as ``choose_params``."""
    t_min, t_max = _threshold_range(params, threat)
    _check_floor(params, t_min, t_max)
    if params.t > t_max:
        raise UnsafeParameters(
            f"t={params.t} too high: too few neighbours may survive dropout to reconstruct; "
            f"{_safe_range(params, t_min, t_max)}"
        )


def check_privacy(params: GraphParams, threat: ThreatModel) -> None:
    """Refuse a (k, t) whose privacy guarantee fails under ``threat``; unlike ``validate_params``
    a threshold that only risks the sum failing (too high for the dropouts) passes. Devices run
    this on every configuration they receive: liveness is the server's concern, their input's
    secrecy is theirs."""
    t_min, t_max = _threshold_range(params, threat)
    _check_floor(params, t_min, t_max)


def _threshold_range(params: GraphParams, threat: ThreatModel) -> tuple[int, int]:
    n, k, t = params.n, params.k, params.t
    if n < 2:
        raise UnsafeParameters(f"a secure sum needs at least 2 devices, got n={n}")
    if not 2 <= k <= n - 1:
        raise UnsafeParameters(f"k={k} must lie in [2, n-1={n - 1}]")
    if k % 2 and not params.full:
        raise UnsafeParameters(f"k={k} must be even (or n-1={n - 1} for the full graph)")
    if not 2 <= t <= k:
        raise UnsafeParameters(f"t={t} must lie in [2, k={k}]")
    if params.full:
        return _full_threshold_range(n, threat)
    if n < MIN_HARARY_N:
        raise UnsafeParameters(
            f"n={n} < {MIN_HARARY_N}: rates are too coarse to trust a Harary graph this small; "
            f"use the full graph k={n - 1}"
        )
    connected, log_p = _connectivity_ok(n, k, threat)
    if not connected:
        raise UnsafeParameters(
            f"k={k} too small for n={n}: the graph disconnects after removing bad nodes with "
            f"probability up to 2^{log_p / _LOG2:.1f} > 2^-{SECURITY_BITS + 1}"
        )
    return _harary_threshold_range(n, k, threat)


def _safe_range(params: GraphParams, t_min: int, t_max: int) -> str:
    k = params.k
    return f"safe range for k={k}: [{t_min}, {t_max}]" if t_min <= t_max else f"no safe t for k={k}"


def _check_floor(params: GraphParams, t_min: int, t_max: int) -> None:
    if params.t < t_min:
        raise UnsafeParameters(
            f"t={params.t} too low: corrupt neighbours (and a lying server) could reach it; "
            f"{_safe_range(params, t_min, t_max)}"
        )

"""The device's own privacy account: what each release it took part in cost it, and the budget
it enforces whatever the coordinator does.

The coordinator's accountant (``tally.privacy.accounting``) bounds what one *job* released, and
it is kept by the server: a coordinator that selects the same device every round, or broadcasts
one model to a cohort S and then to S minus one device and subtracts the two sums (the
differencing attack), is bounded by nothing the server does not choose to count. So the device
keeps its own ledger. For every release (job, round, sum, attempt) it records the noise it
*verified* before training: its own share of the distributed discrete Gaussian and the planned
honest survivors from the session configuration it checks against its signed roster (at most the
cohort's size: ``tally.privacy.payload.verified_noise``). A step without DP, or with central DP
(noise the server adds and the device cannot see), is an unbounded release.

Composition is Google's ``dp-accounting`` (the PLD accountant by default, RDP selectable),
never by hand; neighbouring ledgers differ by this device's contribution replaced by nothing
(REPLACE_SPECIAL, as the server's). No sampling amplification is assumed: the server chooses
who is selected, so an adversarial server selects the device every time (q = 1). A policy may
opt in to a ``sampling_rate`` (``PrivacyBudget``): a claim the device cannot check, charged over
every round of a job up to the latest it joined, not only the rounds it joined.

The file (``privacy-ledger.json``, beside the input ledger, 0600 in a 0700 directory) is written
and fsynced before the masked input leaves: a device that restarts mid-job still counts the
releases it joined. A file that does not parse is refused loudly, never reset: forgetting spent
privacy would hand the budget out again.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from tally.security.files import write_new
from tally.wire.task_reports import MAX_LEDGER_JOBS

PRIVACY_LEDGER_FILE = "privacy-ledger.json"  # in the device's state directory
ACCOUNTANTS = ("pld", "rdp")
SCOPES = ("device", "job")
# The PLD accountant's loss grid: 1e-3 is within 1e-6 of the default 1e-4 on a device's
# compositions here and 10-20x faster (a fleet accounts many devices in one process).
PLD_DISCRETIZATION = 1e-3
RDP_ORDERS = [*range(2, 64), 80, 96, 128, 192, 256, 512, 1024]
NO_NOISE = 0.0  # the noise multiplier of a release without noise the device can verify


class PrivacyLedgerError(ValueError):
    """A privacy ledger file this device cannot trust; the device refuses to run without it."""


@dataclass(frozen=True)
class PrivacyBudget:
    """What the device lets releases cost it, in (epsilon, delta).

    ``scope``: "device" composes every job's releases (the whole budget of this device, its
    population's jobs included), "job" each job's on its own (a budget per job). ``accountant``:
    "pld" (tighter) or "rdp". ``sampling_rate``: 1 (no amplification) unless the policy opts in
    to the claim that each round of a job selects this device independently with at most that
    probability, by a coin the server neither controls nor sees; every round of a job up to the
    latest it joined is then charged as a Poisson-sampled event, joined or not. Nothing on the
    device can check that claim (the server picks the cohort and learns its roster), which is
    why it is off by default."""

    epsilon: float
    delta: float
    scope: str = "device"
    accountant: str = "pld"
    sampling_rate: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"privacy budget: max epsilon must be a finite number > 0, got {self.epsilon:g}")
        if not 0 < self.delta < 1:
            raise ValueError(f"privacy budget: delta must be in (0, 1), got {self.delta:g}")
        if self.scope not in SCOPES:
            raise ValueError(f"privacy budget: scope must be one of {SCOPES}, got {self.scope!r}")
        if self.accountant not in ACCOUNTANTS:
            raise ValueError(f"privacy budget: accountant must be one of {ACCOUNTANTS}, got {self.accountant!r}")
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"privacy budget: sampling_rate must be in (0, 1], got {self.sampling_rate:g}")


@dataclass(frozen=True)
class Release:
    """One sum this device sent a masked input to; ``noise_multiplier`` is what it verified
    (``NO_NOISE``: none it could verify, an unbounded release)."""

    job_id: str
    round: int
    sum_id: str
    session_id: str
    noise_multiplier: float
    noise_devices: int


class BudgetSpent(Exception):
    """A release would take the ledger past the device's budget; the message says by how much."""


def event(noise_multiplier: float, sampling_rate: float = 1.0) -> dp_accounting.DpEvent:
    """One release as a DpEvent: a Gaussian, Poisson-sampled only under an opted-in rate."""
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    return gaussian if sampling_rate >= 1 else dp_accounting.PoissonSampledDpEvent(sampling_rate, gaussian)


@functools.lru_cache(maxsize=4096)  # devices of a fleet share histories: each is composed once
def _epsilon(multipliers: tuple[tuple[float, int], ...], delta: float, accountant: str,
             sampling_rate: float) -> float:
    if not multipliers:
        return 0.0
    if any(z <= NO_NOISE for z, _ in multipliers):
        return math.inf
    relation = dp_accounting.NeighboringRelation.REPLACE_SPECIAL
    account = (pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=PLD_DISCRETIZATION)
               if accountant == "pld" else rdp_privacy_accountant.RdpAccountant(RDP_ORDERS, relation))
    account.compose(dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(event(z, sampling_rate), count) for z, count in multipliers]))
    return float(account.get_epsilon(delta))


def epsilon_of(multipliers: Iterable[float], delta: float, accountant: str = "pld",
               sampling_rate: float = 1.0) -> float:
    """The epsilon at ``delta`` of releases with these noise multipliers, composed."""
    counts = Counter(round(z, 9) for z in multipliers)
    return _epsilon(tuple(sorted(counts.items())), delta, accountant, sampling_rate)


class PrivacyLedger:
    """The releases this device joined, on disk with a ``path`` (else in memory), and the
    ``budget`` it enforces (None: it accounts but refuses nothing)."""

    def __init__(self, path: Path | None = None, budget: PrivacyBudget | None = None) -> None:
        self.path, self.budget = path, budget
        self.releases: list[Release] = []
        # Jobs whose next release this device refused for its budget: stated at each check-in.
        self.spent_jobs: list[str] = []
        if path is not None and path.exists():
            self.releases, self.spent_jobs = _read(path)

    def epsilon(self, job_id: str | None = None, extra: Iterable[Release] = ()) -> float:
        """Epsilon spent at the budget's delta (1e-5 without a budget), of ``job_id``'s releases
        or all of them, with ``extra`` releases added."""
        budget = self.budget or PrivacyBudget(1.0, 1e-5)
        mine = [r for r in [*self.releases, *extra] if job_id is None or r.job_id == job_id]
        multipliers = [r.noise_multiplier for r in mine]
        if budget.sampling_rate < 1:
            multipliers += _rounds_sat_out(mine)
        return epsilon_of(multipliers, budget.delta, budget.accountant, budget.sampling_rate)

    def admit(self, release: Release) -> None:
        """``BudgetSpent`` when ``release`` would take the ledger past the budget: before
        training, so nothing of a refused release is computed or sent."""
        budget = self.budget
        if budget is None:
            return
        job_id, noise_multiplier = release.job_id, release.noise_multiplier
        scope = job_id if budget.scope == "job" else None
        after = self.epsilon(scope, [release])
        if after <= budget.epsilon:
            return
        if job_id not in self.spent_jobs:
            self.spent_jobs = [*self.spent_jobs, job_id]
            self._write()
        spent = self.epsilon(scope)
        what = "an unbounded release (no noise this device can verify)" if noise_multiplier <= NO_NOISE \
            else f"a release of noise multiplier {noise_multiplier:.4g}"
        raise BudgetSpent(f"privacy budget spent: {what} would take this device's epsilon from {spent:.4g} to "
                          f"{after:.4g} at delta {budget.delta:g}, past its budget of {budget.epsilon:g}"
                          + (f" for job {job_id}" if scope else ""))

    def record(self, release: Release) -> None:
        """Charge ``release`` (fsynced before the input leaves; if writing fails nothing is sent)."""
        self.releases = [*self.releases, release]
        self._write()

    def statement(self) -> list[str]:
        """The jobs this device tells the coordinator it has no budget left for (most recent)."""
        return self.spent_jobs[-MAX_LEDGER_JOBS:]

    def _write(self) -> None:
        if self.path is None:
            return
        record = {"releases": [asdict(r) for r in self.releases],
                  "budget_spent_jobs": self.spent_jobs}
        write_new(self.path, json.dumps(record).encode(), 0o600, replace=True)


def _rounds_sat_out(releases: list[Release]) -> list[float]:
    """Under opted-in amplification, the rounds of each job the device did not join: Poisson
    amplification holds only over every round the device could have been sampled in, so rounds
    1 to the latest it joined all count (each at the least noise it verified in that job; the
    job's noise is fixed by its spec). Counting only the joined rounds would understate it."""
    out: list[float] = []
    for job_id in dict.fromkeys(r.job_id for r in releases):
        mine = [r for r in releases if r.job_id == job_id]
        missing = max(r.round for r in mine) - len({r.round for r in mine})
        out += [min(r.noise_multiplier for r in mine)] * max(missing, 0)
    return out


def _read(path: Path) -> tuple[list[Release], list[str]]:
    try:
        record = json.loads(path.read_bytes())
        releases = [Release(**r) for r in record["releases"]]
        spent = record["budget_spent_jobs"]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise PrivacyLedgerError(f"privacy ledger {path} is unreadable ({type(exc).__name__}: {exc}): refusing to "
                                 "start without it (it is never reset; restore it or retire this device)") from None
    if not isinstance(spent, list) or not all(isinstance(j, str) for j in spent) or not all(
            isinstance(r.job_id, str) and type(r.round) is int and isinstance(r.noise_multiplier, (int, float))
            and math.isfinite(r.noise_multiplier) and r.noise_multiplier >= 0 for r in releases):
        raise PrivacyLedgerError(f"privacy ledger {path} is malformed: refusing to start without it")
    return releases, spent

"""The device's own privacy ledger (tally.client.privacy_ledger): composition by dp-accounting,
the budget it enforces, durability, and refusal of what it cannot account."""

from __future__ import annotations

import json
import math
import stat

import numpy as np
import pytest

from tally.client.privacy_ledger import (
    NO_NOISE,
    BudgetSpent,
    PrivacyBudget,
    PrivacyLedger,
    PrivacyLedgerError,
    Release,
    epsilon_of,
)
from tally.codec import CodecError
from tally.privacy import accounting
from tally.privacy.payload import PARAMS, check_noise_floor, verified_noise
from tally.privacy.planning import plan_distributed
from tally.privacy.server import MECHANISM_CODES


def release(job: str = "j", round_: int = 1, z: float = 1.0, sum_id: str = "update") -> Release:
    return Release(job, round_, sum_id, f"s-{job}-{round_}-{sum_id}", z, 9)


def test_pld_is_the_default_and_tighter_than_rdp_which_matches_the_servers():
    pld = epsilon_of([1.0] * 3, 1e-5)
    rdp = epsilon_of([1.0] * 3, 1e-5, accountant="rdp")
    assert 0 < pld < rdp
    assert rdp == pytest.approx(accounting.epsilon_of(1.0, 3, 1e-5), rel=1e-6)  # same library, same relation
    assert epsilon_of([1.0, 1.0, 2.0], 1e-5) < epsilon_of([1.0, 1.0, 1.0], 1e-5)


def test_a_release_without_noise_is_unbounded():
    assert epsilon_of([1.0, NO_NOISE], 1e-5) == math.inf
    ledger = PrivacyLedger(budget=PrivacyBudget(100.0, 1e-5))
    with pytest.raises(BudgetSpent, match="unbounded"):
        ledger.admit(release(z=NO_NOISE))


def test_the_budget_admits_until_the_next_release_would_pass_it(tmp_path):
    budget = PrivacyBudget(epsilon_of([1.0] * 3, 1e-5) + 1e-6, 1e-5)
    ledger = PrivacyLedger(tmp_path / "p.json", budget)
    for r in (1, 2, 3):
        ledger.admit(release(round_=r))
        ledger.record(release(round_=r))
    with pytest.raises(BudgetSpent, match="past its budget"):
        ledger.admit(release(round_=4))
    assert ledger.statement() == ["j"]
    assert ledger.epsilon() <= budget.epsilon
    # Device scope: another job draws on the same budget; job scope: it has its own.
    with pytest.raises(BudgetSpent):
        ledger.admit(release("k"))
    PrivacyLedger(budget=PrivacyBudget(budget.epsilon, 1e-5, scope="job"), path=tmp_path / "p.json").admit(release("k"))


def test_the_ledger_survives_a_restart_and_is_private(tmp_path):
    path = tmp_path / "state" / "p.json"
    path.parent.mkdir(mode=0o700)
    ledger = PrivacyLedger(path, PrivacyBudget(5.0, 1e-5))
    ledger.record(release())
    with pytest.raises(BudgetSpent):
        ledger.admit(release(round_=2, z=0.1))
    again = PrivacyLedger(path, PrivacyBudget(5.0, 1e-5))
    assert again.releases == [release()] and again.statement() == ["j"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_opted_in_amplification_charges_every_round_up_to_the_latest_joined():
    """Poisson amplification is a claim over every round the device could have been sampled in:
    joining rounds 1 and 10 of a job costs ten sampled rounds, not two."""
    q = 0.1
    ledger = PrivacyLedger(budget=PrivacyBudget(100.0, 1e-5, sampling_rate=q))
    ledger.record(release(round_=1))
    ledger.record(release(round_=10))
    assert ledger.epsilon() == epsilon_of([1.0] * 10, 1e-5, sampling_rate=q) > epsilon_of([1.0] * 2, 1e-5,
                                                                                          sampling_rate=q)
    assert ledger.epsilon() < PrivacyLedger(budget=PrivacyBudget(100.0, 1e-5)).epsilon(extra=ledger.releases)


@pytest.mark.parametrize("text", ["{not json", json.dumps({"releases": [{"job_id": "j"}]}),
                                  json.dumps({"releases": [], "budget_spent_jobs": "j"}), json.dumps([])])
def test_a_corrupted_ledger_is_refused_never_reset(tmp_path, text):
    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(PrivacyLedgerError, match="privacy ledger"):
        PrivacyLedger(path)
    assert path.read_text() == text


@pytest.mark.parametrize("kwargs, named", [
    ({"epsilon": 0.0, "delta": 1e-5}, "max epsilon"), ({"epsilon": math.inf, "delta": 1e-5}, "max epsilon"),
    ({"epsilon": 1.0, "delta": -1e-5}, "delta"), ({"epsilon": 1.0, "delta": 0.0}, "delta"),
    ({"epsilon": 1.0, "delta": 1e-5, "scope": "world"}, "scope"),
    ({"epsilon": 1.0, "delta": 1e-5, "sampling_rate": 0.0}, "sampling_rate"),
])
def test_a_bad_budget_is_refused_naming_it(kwargs, named):
    with pytest.raises(ValueError, match=named):
        PrivacyBudget(**kwargs)


def _public(cohort: int, z: float = 1.0, **overrides: float) -> tuple[dict[str, np.ndarray], int]:
    plan = plan_distributed(clip=1.0, dim=63, noise_multiplier=z, cohort_size=cohort, dropout_rate=0.1,
                            corrupt_rate=0.05, min_survivors=5)
    values = {"mechanism": MECHANISM_CODES["distributed"], "clip": 1.0, "scale": plan.scale,
              "bound_sq": plan.bound_sq, "share_std": plan.sigma_device, "noise_multiplier": z,
              "noise_devices": plan.noise_devices, **overrides}
    return {PARAMS: np.array(list(values.values()))}, plan.padded


def test_the_verified_noise_is_the_planned_noise_and_a_lie_about_the_cohort_gains_nothing():
    public, dim = _public(10)
    z, honest = verified_noise(public, 10, dim)
    assert honest == 8 and z == pytest.approx(1.0, rel=1e-2)
    # A server claiming 1000 honest devices for a cohort of 10: the device counts 10 at most.
    liar = dict(public)
    liar[PARAMS] = public[PARAMS].copy()
    liar[PARAMS][6] = 1000
    assert verified_noise(liar, 10, dim)[0] <= z * math.sqrt(10 / 8) * 1.01
    with pytest.raises(Exception, match="share"):  # and the floor refuses it outright
        check_noise_floor({PARAMS: liar[PARAMS] * np.array([1, 1, 1, 1, 0.1, 1, 1])}, 0.5, 10)


def test_a_step_declaring_dp_without_what_the_device_needs_is_refused_naming_it():
    public, dim = _public(10)
    with pytest.raises(CodecError, match="noise_devices"):
        verified_noise({PARAMS: public[PARAMS][:6]}, 10, dim)
    with pytest.raises(CodecError, match="share_std"):
        verified_noise({PARAMS: public[PARAMS] * np.array([1, 1, 1, 1, 0, 1, 1])}, 10, dim)
    assert verified_noise({}, 10, dim) == (0.0, 0)  # no DP: an unbounded release, not an error
    central = {PARAMS: np.array([MECHANISM_CODES["central"], 1.0, 0, 0, 0, 1.0, 0])}
    assert verified_noise(central, 10, dim) == (0.0, 0)  # the server's noise: unverifiable

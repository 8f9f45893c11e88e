#!/usr/bin/env python
"""What device-held privacy budgets cost in accuracy: distributed-DP FedAvg on digits, with every
device enforcing its own (epsilon, delta) budget (``tally.client.privacy_ledger``).

The job is ``bench/dp_digits.py``'s distributed-DP job (``--clients`` devices, Poisson cohorts of
``--cohort`` on average, ``--rounds`` rounds, noise calibrated for the server-side target
each of ``--job-epsilons`` with the amplification q = cohort / clients the server's accountant claims).
Each device keeps its own ledger: before each round it joins, it checks the release against its
budget with the noise it verifies from the step's ``dp.params`` (its share over at most the
session's size), composed with dp-accounting's PLD accountant; a device whose next release would
pass its budget sits the round out (in the SDK: task report ``privacy_budget_spent``). Two device
policies per budget:

* ``q=1`` (the default): no amplification, since the server chooses who is selected;
* ``opt-in``: the device claims amplification at q, true here because the simulator samples each
  device with its own coin (``PrivacyBudget(sampling_rate=q)``).

Reported per budget: final test accuracy (median over ``--seeds``), the job's server-side epsilon
(its ledger, from the honest survivors' noise actually present), and the devices' own epsilon
(p50 and max over devices), with how many devices ran out of budget. Not a timed test.

    python bench/device_budgets.py --json bench/results/device_budgets.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from importlib import metadata
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dp_digits import fedavg_options, poisson, population

from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.client.privacy_ledger import PrivacyBudget, PrivacyLedger, Release
from tally.privacy.payload import PrivateClient, verified_noise
from tally.privacy.server import PrivateServer
from tally.privacy.simulation import RingSum
from tally.privacy.spec import PrivacySpec, settings_for
from tally.sim.rounds import run_rounds

STEP = "update"


class OutOfEligibleDevices(Exception):
    """Fewer than min_cohort devices admit the round: the coordinator fails the job here."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=150)
    p.add_argument("--cohort", type=int, default=30)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--alpha", type=float, default=5.0)
    p.add_argument("--clip", type=float, default=0.3)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--local-lr", type=float, default=0.3)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--corrupt", type=float, default=0.05)
    p.add_argument("--job-epsilons", type=float, nargs="+", default=[4.0, 1.0],
                   help="server-side targets the job's noise is calibrated for (one sweep each)")
    p.add_argument("--budgets", type=float, nargs="+", default=[2.0, 4.0, 8.0, 16.0],
                   help="per-device epsilon budgets at --delta")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--json", type=Path)
    return p.parse_args(argv)


class Budgets:
    """Each device's ledger, and the Poisson sampler that seats only devices that admit the
    round's release: a ``run_rounds`` ``sample`` function."""

    def __init__(self, args: argparse.Namespace, public: dict, dim: int, budget: PrivacyBudget | None,
                 min_cohort: int) -> None:
        self.public, self.dim, self.budget, self.min_cohort = public, dim, budget, min_cohort
        self.q = args.cohort / args.clients
        self.ledgers = [PrivacyLedger(budget=budget) for _ in range(args.clients)]
        self.refusals = 0
        self.out_of_budget: set[int] = set()
        self.round = 0

    def __call__(self, rng: np.random.Generator, size: int) -> list[int]:
        drawn = poisson(self.q)(rng, size)
        noise, honest = verified_noise(self.public, len(drawn), self.dim)
        self.round += 1
        release = Release("bench", self.round, STEP, f"r{self.round}", noise, honest)
        refused = {d for d in drawn if self.budget is not None
                   and self.ledgers[d].epsilon(extra=[release]) > self.budget.epsilon}
        self.refusals += len(refused)
        self.out_of_budget |= refused
        seated = [d for d in drawn if d not in refused]
        if len(seated) < self.min_cohort:
            self.round -= 1
            raise OutOfEligibleDevices(f"round {self.round + 1}: {len(seated)} devices admit it")
        for d in seated:
            self.ledgers[d].record(release)
        return seated


def run(args: argparse.Namespace, seed: int, job_epsilon: float, budget: PrivacyBudget | None) -> dict:
    devices, initial, test = population(args, seed)
    options = FedAvgOptions(**fedavg_options(args))
    server, client = FedAvgServer(options), FedAvgClient(options)
    spec = PrivacySpec(mechanism="distributed", clip=args.clip, target_epsilon=job_epsilon, delta=args.delta,
                       population=args.clients)
    settings = settings_for(spec, rounds=args.rounds, cohort_size=args.cohort, min_cohort=max(2, args.cohort // 2),
                            dropout_rate=args.dropout, corrupt_rate=args.corrupt)
    private = PrivateServer(server, "fedavg", settings)
    state = private.init(initial)
    steps = private.steps(state)
    public = {k: v for k, v in private.broadcast(state, STEP).items() if k.startswith("dp.")}
    min_cohort = settings.min_survivors
    budgets = Budgets(args, public, steps[0].schema.dim, budget, min_cohort)
    ring = RingSum(private, dropout=args.dropout, seed=seed)
    accuracies = [test.evaluate(initial)[1]]
    try:
        run_rounds(private, PrivateClient(client), devices, initial, args.rounds, args.cohort, ring, seed=seed,
                   sample=budgets, evaluate=test.evaluate, on_round=lambda log: accuracies.append(log.test_accuracy))
    except OutOfEligibleDevices:
        pass  # the job fails; its last committed model is what it produced
    accuracy = accuracies[-1]
    spent = [ledger.epsilon() for ledger in budgets.ledgers]
    return {
        "accuracy": accuracy, "noise_multiplier": settings.noise_multiplier, "rounds_committed": budgets.round,
        "server_epsilon": private.ledger.epsilon,
        "device_epsilon_p50": float(np.median(spent)), "device_epsilon_max": float(max(spent)),
        "releases_per_device_p50": float(np.median([len(ledger.releases) for ledger in budgets.ledgers])),
        "refusals": budgets.refusals, "devices_out_of_budget": len(budgets.out_of_budget),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    q = args.cohort / args.clients
    policies: list[tuple[str, float | None, PrivacyBudget | None]] = [("none", None, None)]
    for epsilon in args.budgets:
        policies.append(("q=1", epsilon, PrivacyBudget(epsilon, args.delta)))
        policies.append(("opt-in", epsilon, PrivacyBudget(epsilon, args.delta, sampling_rate=q)))
    rows = []
    for job_epsilon, (label, epsilon, budget) in itertools.product(args.job_epsilons, policies):
        results = [run(args, seed, job_epsilon, budget) for seed in range(args.seeds)]
        row = {"job_epsilon": job_epsilon, "policy": label, "device_budget": epsilon,
               **{k: statistics.median(r[k] for r in results) for k in results[0]},
               "accuracy_per_seed": [r["accuracy"] for r in results]}
        rows.append(row)
        print(f"job {job_epsilon:g} {label:7} budget {epsilon!s:5} accuracy {row['accuracy']:.3f} "
              f"server eps {row['server_epsilon']:.2f} "
              f"device eps p50 {row['device_epsilon_p50']:.2f} max {row['device_epsilon_max']:.2f} "
              f"releases p50 {row['releases_per_device_p50']:.0f} refusals {row['refusals']:.0f}", flush=True)
    if args.json:
        report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  "tally_version": metadata.version("tally"), "rows": rows}
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

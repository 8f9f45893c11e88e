#!/usr/bin/env python
"""Differentially private FedAvg on scikit-learn's digits: accuracy vs epsilon, and vs bits.

Runs the in-process simulator (``tally.sim.rounds.run_rounds``) with the privacy layer of
``tally/privacy`` on a population of ``--clients`` devices (Dirichlet label split), cohorts of
``--cohort`` sampled uniformly each round, ``--rounds`` rounds, an MLP of ``--hidden`` units:

* no DP (plain sums of the same clipped-weight FedAvg payload: the accuracy ceiling);
* central DP (Gaussian noise added by the server) at each target epsilon;
* distributed DP (discrete Gaussian shares added by the devices in the ring, bits chosen by the
  planner) at each target epsilon;
* distributed DP at ``--bits-epsilon`` with the ring forced to each of ``--bits``.

``--services`` runs the sweep through the real services instead (no DP and distributed DP at
each target epsilon, ``--seeds`` seeds): a coordinator and two aggregators as processes over TLS
(``tally.ops.cluster.ProcessCluster``), the devices as an SDK fleet with masking on, each
cohort's ``--dropout`` leaving before its masked input; next to each, the in-process run at the
same settings, so the two can be compared (accuracy within noise, the epsilon spent).

Each target epsilon is calibrated with dp-accounting (RDP) over the rounds with Poisson
amplification q = cohort / clients, and the simulator samples exactly so: each device takes part
in a round with probability q (the cohort size varies around ``--cohort``). The ledger's spent
epsilon, from the honest survivors' noise actually present in every round (``--dropout`` of each
cohort dropping), is reported next to the target. Each configuration is run for ``--seeds`` seeds; medians are
reported. Writes JSON and a two-panel plot.

    python bench/dp_digits.py --json bench/results/dp_digits.json --plot bench/results/dp_digits.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tally.algorithms.fedavg import FedAvgClient, FedAvgOptions, FedAvgServer
from tally.datasets.digits import digits
from tally.models.mlp import mlp
from tally.models.params import get_params
from tally.privacy.errors import PrivacyRefused
from tally.privacy.payload import PrivateClient
from tally.privacy.server import PrivacySettings, PrivateServer
from tally.privacy.simulation import RingSum
from tally.privacy.spec import PrivacySpec, settings_for
from tally.sim.rounds import plain_sum, run_rounds
from tally.training import TorchTrainer

TFF_MAX_BITS = 22  # tff.learning.ddp_secure_aggregator: bits "in the inclusive range of [1, 22]"
TFF_DEFAULT_BITS = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=150, help="population (devices with data)")
    p.add_argument("--cohort", type=int, default=30, help="devices per round")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--hidden", type=int, default=16, help="MLP hidden units")
    p.add_argument("--alpha", type=float, default=5.0, help="Dirichlet label skew")
    p.add_argument("--clip", type=float, default=0.3, help="L2 clip of a device's update (about its median norm)")
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--local-lr", type=float, default=0.3)
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--dropout", type=float, default=0.1, help="fraction of each cohort that drops")
    p.add_argument("--corrupt", type=float, default=0.05, help="fraction assumed to collude with the server")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    p.add_argument("--bits-epsilon", type=float, default=4.0)
    p.add_argument("--bits", type=int, nargs="*", default=[10, 11, 12, 13, 14, 16, 20, 24])
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--services", action="store_true",
                   help="run no DP and distributed DP at each --epsilons through a real coordinator, two "
                   "aggregators and a fleet, next to the in-process run at the same settings")
    p.add_argument("--workdir", type=Path, help="--services: where the processes keep state and logs "
                   "(default: a temporary directory)")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    return p.parse_args(argv)


def population(args: argparse.Namespace, seed: int):
    fed = digits(args.clients, alpha=args.alpha, seed=seed)
    factory = lambda: mlp(fed.num_features, fed.num_classes, hidden=args.hidden, seed=seed)  # noqa: E731
    devices = [TorchTrainer(factory, X, y, seed=seed + i) for i, (X, y) in enumerate(fed.clients)]
    return devices, get_params(factory()), TorchTrainer(factory, *fed.test)


def poisson(q: float):
    """Each device takes part in a round with probability q, independently."""
    return lambda rng, population: np.flatnonzero(rng.random(population) < q).tolist()


def fedavg_options(args: argparse.Namespace) -> dict:
    return {"local_epochs": args.local_epochs, "local_lr": args.local_lr, "server_lr": args.server_lr,
            "example_cap": 1, "batch_size": 16}


def run(args: argparse.Namespace, seed: int, mechanism: str | None, epsilon: float | None,
        bits: int | None = None) -> dict:
    devices, initial, test = population(args, seed)
    options = FedAvgOptions(**fedavg_options(args))
    server, client = FedAvgServer(options), FedAvgClient(options)
    start = time.perf_counter()
    if mechanism is None:
        state, _ = run_rounds(server, client, devices, initial, args.rounds, args.cohort, plain_sum, seed=seed,
                              sample=poisson(args.cohort / args.clients))
        out: dict = {}
    else:
        spec = PrivacySpec(mechanism=mechanism, clip=args.clip, target_epsilon=epsilon, delta=args.delta,
                           population=args.clients, bits=bits)
        settings: PrivacySettings = settings_for(
            spec, rounds=args.rounds, cohort_size=args.cohort, min_cohort=max(2, args.cohort // 2),
            dropout_rate=args.dropout, corrupt_rate=args.corrupt)
        private = PrivateServer(server, "fedavg", settings)
        ring = RingSum(private, dropout=args.dropout, seed=seed)
        state, _ = run_rounds(private, PrivateClient(client), devices, initial, args.rounds, args.cohort, ring,
                              seed=seed, sample=poisson(settings.sampling_rate))
        plan = private.plan_of("update")
        out = {
            "noise_multiplier": settings.noise_multiplier,
            "epsilon_spent": private.ledger.epsilon,
            "bits": plan.bits(args.cohort) if plan is not None else None,
            "bytes_per_device_round": statistics.median(ring.wire_bytes),
            "values_per_device": plan.padded if plan is not None else None,
            "inflation": plan.inflation if plan is not None else 1.0,
        }
    loss, accuracy = test.evaluate(server.model(state))
    return {"accuracy": accuracy, "loss": loss, "seconds": time.perf_counter() - start, **out}


def median_over_seeds(results: list[dict]) -> dict:
    keys = [k for k, v in results[0].items() if isinstance(v, (int, float)) and v is not None]
    return {**results[0], **{k: statistics.median(r[k] for r in results) for k in keys},
            "accuracy_per_seed": [r["accuracy"] for r in results]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.services:
        import dp_services

        rows = dp_services.sweep_through_services(args, run, population, median_over_seeds)
        write_report(args, rows, dp_services.plot)
        return 0
    configs = [("none", None, None, None)]
    configs += [(m, m, e, None) for e in args.epsilons for m in ("central", "distributed")]
    configs += [("distributed", "distributed", args.bits_epsilon, b) for b in args.bits]
    rows = []
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("DP digits", total=len(configs) * args.seeds)
        for label, mechanism, epsilon, bits in configs:
            results = []
            try:
                for seed in range(args.seeds):
                    results.append(run(args, seed, mechanism, epsilon, bits))
                    progress.advance(task)
            except PrivacyRefused as exc:  # a ring too narrow for this noise: the planner says so
                progress.advance(task, args.seeds - len(results))
                rows.append({"mechanism": label, "target_epsilon": epsilon, "forced_bits": bits, "refused": str(exc)})
                continue
            rows.append({"mechanism": label, "target_epsilon": epsilon, "forced_bits": bits,
                         **median_over_seeds(results)})
    table = Table(title=f"DP FedAvg on digits: {args.clients} devices, cohort {args.cohort}, {args.rounds} rounds")
    for column in ("mechanism", "target eps", "spent eps", "z", "bits", "bytes/device/round", "accuracy"):
        table.add_column(column)
    for r in rows:
        if "refused" in r:
            table.add_row(r["mechanism"], f"{r['target_epsilon']}", "-", "-", f"{r['forced_bits']}", "-",
                          "refused: " + r["refused"][:40])
            continue
        table.add_row(r["mechanism"], f"{r['target_epsilon'] or '-'}", f"{r.get('epsilon_spent', 0):.2f}",
                      f"{r.get('noise_multiplier', 0):.2f}", f"{r.get('bits') or '-'}",
                      f"{r.get('bytes_per_device_round', '-')}", f"{r['accuracy']:.3f}")
    Console().print(table)
    write_report(args, rows, plot)
    return 0


def write_report(
    args: argparse.Namespace, rows: list[dict], plot: Callable[[list[dict], argparse.Namespace], None]
) -> None:
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "tally_version": metadata.version("tally"), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.plot:
        plot(rows, args)


def plot(rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rows = [r for r in rows if "refused" not in r]
    baseline = next(r["accuracy"] for r in rows if r["mechanism"] == "none")
    for mechanism, marker in (("central", "o"), ("distributed", "s")):
        points = sorted((r["target_epsilon"], r["accuracy"]) for r in rows
                        if r["mechanism"] == mechanism and r["forced_bits"] is None)
        left.plot(*zip(*points), marker=marker, label=f"{mechanism} DP")
    left.axhline(baseline, color="grey", linestyle="--", label="no DP")
    left.set_xscale("log", base=2)
    left.set_xlabel(f"epsilon (delta = {args.delta:g}, {args.rounds} rounds)")
    left.set_ylabel("test accuracy")
    left.set_title("accuracy vs epsilon")
    left.legend()
    forced = sorted((r["bits"], r["accuracy"]) for r in rows if r["forced_bits"] is not None)
    right.plot(*zip(*forced), marker="s", label=f"distributed DP, epsilon {args.bits_epsilon:g}")
    auto = next(r for r in rows if r["mechanism"] == "distributed" and r["forced_bits"] is None
                and r["target_epsilon"] == args.bits_epsilon)
    right.axvline(auto["bits"], color="green", linestyle=":", label=f"Tally's choice ({auto['bits']:.0f} bits)")
    right.axvline(TFF_DEFAULT_BITS, color="orange", linestyle=":", label=f"TFF default ({TFF_DEFAULT_BITS})")
    right.axvspan(TFF_MAX_BITS, max(max(b for b, _ in forced), TFF_MAX_BITS) + 1, color="red", alpha=0.1,
                  label=f"beyond TFF's cap ({TFF_MAX_BITS})")
    right.axhline(baseline, color="grey", linestyle="--", label="no DP")
    right.set_xlabel("bits per value on the wire")
    right.set_ylabel("test accuracy")
    right.set_title("accuracy vs ring width")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())

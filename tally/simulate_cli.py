"""``tally simulate``: an algorithm in process through the secure-sum engine, metrics as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress

from tally import algorithms, data, fairness
from tally.secagg import ThreatModel
from tally.simulation import SecureSum, plain_sum, run_rounds
from tally.training import TorchTrainer, get_params, mlp, single_threaded

DATASETS = ("digits",)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="run an algorithm in process (no network) and write metrics as JSON")
    p.add_argument("--algorithm", choices=algorithms.NAMES, default="fedavg")
    p.add_argument("--dataset", choices=DATASETS, default="digits")
    p.add_argument("--clients", type=int, default=50, help="devices in the population")
    p.add_argument("--cohort", type=int, default=None, help="devices per round (default: all)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet label skew (smaller: more skew)")
    p.add_argument("--seed", type=int, default=0)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--secure", dest="secure", action="store_true", default=True, help="real secure sums (default)")
    mode.add_argument("--plain", dest="secure", action="store_false", help="plain float sums (baseline)")
    p.add_argument("--dropout", type=float, default=0.0, help="fraction of each cohort dropping (secure mode)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="algorithm option")
    p.add_argument("--json", type=Path, required=True, help="where to write the metrics")
    p.set_defaults(run=run)


def _options(pairs: list[str]) -> dict:
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--option needs KEY=VALUE, got {pair!r}")
        options[key] = json.loads(value) if value[:1] in "-0123456789[{tn" else value
    return options


def simulate(args: argparse.Namespace, console: Console | None = None) -> dict:
    console = console or Console()
    single_threaded()
    fed = data.digits(args.clients, alpha=args.alpha, seed=args.seed)
    factory = lambda: mlp(fed.num_features, fed.num_classes, seed=args.seed)  # noqa: E731
    devices = [TorchTrainer(factory, X, y, seed=args.seed + i) for i, (X, y) in enumerate(fed.clients)]
    test = TorchTrainer(factory, *fed.test)
    server, client = algorithms.make(args.algorithm, _options(args.option))
    sum_fn = (
        SecureSum(ThreatModel(dropout_rate=max(args.dropout, 0.05)), args.dropout, args.seed)
        if args.secure
        else plain_sum
    )
    with Progress(console=console) as progress:
        task = progress.add_task(f"{args.algorithm} rounds", total=args.rounds)
        state, logs = run_rounds(
            server, client, devices, get_params(factory()), args.rounds,
            args.cohort or args.clients, sum_fn, seed=args.seed, evaluate=test.evaluate,
            on_round=lambda log: progress.update(
                task, advance=1, description=f"round {log.round} acc {log.test_accuracy:.3f}"
            ),
        )
    model = server.model(state)
    per_device = np.array([d.evaluate(model)[1] for d in devices])
    final = {"test_loss": logs[-1].test_loss, "test_accuracy": logs[-1].test_accuracy,
             "per_device_accuracy": per_device.tolist(), **fairness.summary(per_device)}
    return {
        "algorithm": args.algorithm,
        "dataset": args.dataset,
        "clients": args.clients,
        "rounds": args.rounds,
        "secure": args.secure,
        "seed": args.seed,
        "per_round": [
            {"round": log.round, "test_loss": log.test_loss, "test_accuracy": log.test_accuracy,
             "contributors": {k: len(v) for k, v in log.contributors.items()}}
            for log in logs
        ],
        "final": final,
    }


def run(args: argparse.Namespace) -> int:
    console = Console()
    report = simulate(args, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    f = report["final"]
    console.print(
        f"test accuracy {f['test_accuracy']:.3f}; worst 10% of devices {f['worst10_accuracy']:.3f}; "
        f"gini {f['gini']:.3f}"
    )
    console.print(f"metrics written to {args.json}")
    return 0

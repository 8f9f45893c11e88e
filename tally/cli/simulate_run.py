"""What ``tally simulate`` runs (its arguments are ``tally.cli.simulate``'s): an algorithm in
process through the secure-sum engine, metrics as JSON, and with ``--report DIR`` the plots a
researcher wants next to a FedAvg baseline."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress

from tally import algorithms
from tally.algorithms import aaggff
from tally.cli.console import console as cli_console
from tally.secagg import ThreatModel, UnsafeParameters
from tally.sim import scenarios
from tally.sim.rounds import SecureSum, plain_sum, run_rounds
from tally.training import single_threaded


# tally.client.adaptation's methods, named here so --help does not import the SDK.
class UsageError(ValueError):
    """A mistake in the command line, reported as one line naming the option."""


def _options(algorithm: str, pairs: list[str]) -> dict[str, Any]:
    """``--option KEY=VALUE`` pairs (values as JSON, else strings), type-checked against the
    algorithm's options as a job spec's ``options`` is."""
    from tally.coordinator.spec.jobspec import option_type_errors

    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--option needs KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    errors = option_type_errors(algorithm, options, where="--option")
    if errors:
        raise UsageError("; ".join(e.replace("--option.", "--option ", 1) for e in errors))
    return options


def _check(args: argparse.Namespace) -> None:
    """What argparse cannot see option by option."""
    if args.cohort is not None and args.cohort > args.clients:
        raise UsageError(f"--cohort {args.cohort} exceeds --clients {args.clients}")
    if args.reveal and args.algorithm != "aaggff_s":
        raise UsageError(f"--reveal: {args.algorithm} reveals nothing (only aaggff_s can reveal: response)")
    unknown = sorted(set(args.reveal) - {"response"})
    if unknown:
        raise UsageError(f"--reveal: {unknown} cannot be revealed (only: response)")


def _trace(algorithm: str, server: Any, clients: int):
    """What the report plots per round: λ (AgnosticFedAvg), p (AAggFF)."""

    def trace(state: Any, local: dict[int, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if algorithm == "agnostic_fedavg":
            out["lambda"] = state.weights.tolist()
            out["domain_loss"] = np.asarray(state.domain_loss).tolist()
        elif getattr(state, "decision", None) is not None:
            out["p"] = np.asarray(state.decision).tolist()
        elif algorithm.startswith("aaggff"):
            out["p"] = aaggff.decision(server.options, state.round, [local.get(i) for i in range(clients)]).tolist()
        return out

    return trace


def simulate_one(args: argparse.Namespace, algorithm: str, given: dict[str, Any], console: Console) -> dict:
    scenario_args = scenarios.ScenarioArgs(args.clients, args.cohort, args.domains, args.alpha, args.samples,
                                           args.noise, args.partition, args.seed, algorithm,
                                           classes_per_device=args.classes_per_device)
    try:  # the dataset and the algorithm refuse what does not fit them (num_clients, domains, ...)
        scenario = scenarios.build(args.dataset, scenario_args)
        options = scenario.options(algorithm, given)
        if algorithm == "aaggff_s" and args.reveal:
            options.setdefault("reveal", list(args.reveal))
        server, client = algorithms.make(algorithm, options)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{algorithm} on {args.dataset}: {exc}") from None
    if args.adapt and scenario.fleet is None:
        raise UsageError(f"--adapt: the devices of {args.dataset} have no validation and test splits of their "
                         "own (use pathological-digits or rotated-digits)")
    sum_fn = (
        SecureSum(ThreatModel(dropout_rate=max(args.dropout, 0.05)), args.dropout, args.seed)
        if args.secure
        else plain_sum
    )
    from tally.sim.personal_report import UploadCounter

    sum_fn = uploads = UploadCounter(sum_fn)
    local: dict[int, Any] = {}
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task(f"{algorithm} rounds", total=args.rounds)
        state, logs = run_rounds(
            server, client, scenario.devices, scenario.initial, args.rounds, args.cohort or args.clients, sum_fn,
            seed=args.seed, evaluate=scenario.evaluate, reveal=args.reveal,
            trace=_trace(algorithm, server, args.clients),
            on_round=lambda log: progress.update(bar, advance=1, description=f"{algorithm} round {log.round}"),
            local_states=local,
        )
    out = {
        "algorithm": algorithm,
        "options": options,
        "dataset": args.dataset,
        "clients": args.clients,
        "rounds": args.rounds,
        "secure": args.secure,
        "dropout": args.dropout,
        "seed": args.seed,
        "per_round": [
            {"round": log.round, "test_loss": log.test_loss, "test_accuracy": log.test_accuracy,
             "contributors": {k: len(v) for k, v in log.contributors.items()}, **log.trace}
            for log in logs
        ],
        "final": scenario.final(server.model(state)),
        "uploaded_values": uploads.values,
    }
    if scenario.fleet is not None:
        from tally.sim.personal_report import personal_results

        plot = (args.report or args.json.parent) / f"who-gains-{algorithm}.png"
        out.update(personal_results(client, server.model(state), local, scenario.fleet, uploads, args.adapt,
                                    args.adapt_epochs, plot))
    return out


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args, cli_console())
    except (UsageError, UnsafeParameters) as exc:
        print(f"tally simulate: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --json or --report where nothing can be written
        print(f"tally simulate: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    _check(args)
    given = _options(args.algorithm, args.option)
    single_threaded()
    report = simulate_one(args, args.algorithm, given, console)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    f = report["final"]
    summary = ", ".join(
        f"{key} {f[key]:.4g}" for key in ("test_accuracy", "worst_domain_loss", "worst10_accuracy", "gini") if key in f
    )
    console.print(f"{args.algorithm} on {args.dataset}: {summary}")
    if "personal" in report:
        from tally.sim.personal_report import summary_line

        console.print(f"{args.algorithm} on {args.dataset}: {summary_line(report)}")
    if args.report is not None:
        baseline = None
        if args.baseline != "none" and args.baseline != args.algorithm:
            baseline = simulate_one(args, args.baseline, {}, console)
        from tally.sim.report import write_report

        paths = write_report(args.report, report, baseline)
        console.print(f"report: {', '.join(str(p) for p in paths)}")
    console.print(f"metrics written to {args.json}")
    return 0

"""``tally sum``: one secure sum over a simulated cohort, in process: the engine on its
own, to see cost and correctness for a cohort size and dropout pattern."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tally.cli import argtypes
from tally.cli.console import console as cli_console
from tally.codec import Field, PayloadSchema, to_ring
from tally.secagg import (
    DevicePolicy,
    Dropout,
    SessionConfig,
    SessionRef,
    ThreatModel,
    UnsafeParameters,
    enrol,
    run_cohort,
    smallest_secure_cohort,
)
from tally.secagg.messages import (
    AdvertiseKeys,
    MaskedInputResponse,
    ShareKeysResponse,
    UnmaskResponse,
)
from tally.secagg.phases import DEADLINED, DROPPABLE, Phase

# The phase each device answer completes: the progress bars count them.
_PHASE_OF = {
    AdvertiseKeys: Phase.ADVERTISE_KEYS,
    ShareKeysResponse: Phase.SHARE_KEYS,
    MaskedInputResponse: Phase.MASKED_INPUT,
    UnmaskResponse: Phase.UNMASK,
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sum", help="run one secure sum over a simulated cohort, in process")
    _add_cohort_args(p, clients=100, dim=1000)
    p.add_argument("--json", type=Path, help="write the measurements here as JSON")
    p.set_defaults(run=run_sum)

    p.add_argument("--plot", type=Path, help="also write a PNG of the per-phase times here")


def _add_cohort_args(p: argparse.ArgumentParser, clients: int, dim: int) -> None:
    p.add_argument("--clients", type=argtypes.integer(3), default=clients, help="devices in the cohort")
    p.add_argument("--dim", type=argtypes.integer(1), default=dim, help="values per device")
    p.add_argument("--dropout", type=argtypes.FRACTION, default=0.1, help="fraction of devices that drop")
    p.add_argument(
        "--phase",
        choices=["random", *DROPPABLE],
        default="random",
        help="phase in which the dropped devices stop answering",
    )
    p.add_argument("--corrupt", type=argtypes.FRACTION, default=0.05, help="tolerated fraction of corrupt devices")
    p.add_argument("--semi-honest", action="store_true",
                   help="skip the consistency check: devices trust the server not to lie about survivors "
                        "(measures what the check costs; a malicious server could read one device's input)")
    p.add_argument("--seed", type=int, default=0, help="seed for inputs and dropouts")


def simulate(args: argparse.Namespace, console: Console) -> dict:
    rng = np.random.default_rng(args.seed)
    n, dim = args.clients, args.dim
    schema = PayloadSchema((Field("update", (dim,), clip=1.0, frac_bits=19),))
    threat = ThreatModel(dropout_rate=max(args.dropout, 0.0), corrupt_rate=args.corrupt)
    identities = enrol(n)
    config = SessionConfig.plan(
        SessionRef("demo", 0, "engine"), [("update", schema)], n, threat,
        consistency_check=not args.semi_honest,
        identities=[identities[i].public for i in range(1, n + 1)],
    )
    values = rng.uniform(-1, 1, size=(n, dim))
    bits = config.sums[0].bits
    encoded = {
        i: {"update": to_ring(schema.encode({"update": values[i - 1]}, rng).vector, bits)}
        for i in range(1, n + 1)
    }
    phases = [p for p in DROPPABLE if p != Phase.CONSISTENCY_CHECK or not args.semi_honest]
    device_threat = dataclasses.replace(threat, malicious_server=not args.semi_honest)
    victims = rng.choice(np.arange(1, n + 1), size=int(args.dropout * n), replace=False)
    dropouts = {
        int(v): Dropout(args.phase if args.phase != "random" else str(rng.choice(phases)))
        for v in victims
    }
    console.print(
        f"cohort {n} devices, {dim:,} values at {bits} bits; graph k={config.params.k}, "
        f"t={config.params.t}; {len(dropouts)} devices will drop"
    )
    with Progress(
        TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=False,
    ) as progress:
        tasks = {p: progress.add_task(p, total=n) for p in _PHASE_OF.values()}

        def observe(message: object) -> None:
            phase = _PHASE_OF.get(type(message))
            if phase is not None:
                progress.advance(tasks[phase])

        start = time.perf_counter()
        run = run_cohort(config, encoded, dropouts, observe=observe, measure_bytes=True,
                         identities=identities, policy=DevicePolicy(threat=device_threat))
        wall = time.perf_counter() - start
    if run.aborted:
        raise SystemExit(f"session aborted: {run.aborted}")
    result = run.results["update"]
    decoded = schema.decode_sum(result.total, bits)["update"]
    survivors = result.contributors
    exact = values[np.array(survivors) - 1].sum(axis=0)
    return {
        "clients": n,
        "dim": dim,
        "bits": bits,
        "k": config.params.k,
        "t": config.params.t,
        "dropped": n - len(survivors),
        "contributors": len(survivors),
        "max_abs_error": float(np.max(np.abs(decoded - exact))),
        "quantisation_bound": schema.quantisation_bound(len(survivors))["update"],
        "server_seconds": dict(run.server_seconds),
        "client_median_seconds": {p: float(np.median(v)) for p, v in run.client_seconds.items()},
        "upload_bytes_per_client": float(np.median([run.upload_bytes[i] for i in survivors])),
        "plain_bytes_per_client": 4 * dim,
        "wall_seconds": wall,
    }


def _table(report: dict) -> Table:
    table = Table(title="secure sum")
    table.add_column("phase")
    table.add_column("server s", justify="right")
    table.add_column("device median s", justify="right")
    for phase in DEADLINED:
        if phase in report["server_seconds"] or phase in report["client_median_seconds"]:
            table.add_row(
                phase,
                f"{report['server_seconds'].get(phase, 0.0):.4f}",
                f"{report['client_median_seconds'].get(phase, 0.0):.5f}",
            )
    return table


def _summary(report: dict) -> str:
    return (
        f"{report['contributors']} of {report['clients']} devices summed, {report['dropped']} dropped; "
        f"max error {report['max_abs_error']:.2e} (bound {report['quantisation_bound']:.2e}); "
        f"upload {report['upload_bytes_per_client'] / report['plain_bytes_per_client']:.3f}x float32"
    )


def _plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in DEADLINED if p in report["server_seconds"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = np.arange(len(phases))
    ax.bar(x - 0.2, [report["server_seconds"][p] for p in phases], 0.4, label="server (total)")
    ax.bar(x + 0.2, [report["client_median_seconds"].get(p, 0) for p in phases], 0.4, label="device (median)")
    ax.set_xticks(x, phases)
    ax.set_ylabel("seconds")
    ax.set_title(f"secure sum: {report['clients']} devices, {report['dim']:,} values, {report['dropped']} dropped")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sum(args: argparse.Namespace) -> int:
    console = cli_console()
    try:
        report = simulate(args, console)
    except UnsafeParameters as exc:  # a cohort too small for its dropout and corrupt rates
        threat = ThreatModel(dropout_rate=max(args.dropout, 0.0), corrupt_rate=args.corrupt)
        smallest = smallest_secure_cohort(args.clients, threat)
        hint = (f"; the smallest that is: --clients {smallest}" if smallest is not None
                else "; lower --dropout or --corrupt")
        print(f"tally sum: --clients {args.clients}: {exc}{hint}", file=sys.stderr)
        return 2
    console.print(_table(report))
    console.print(_summary(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        console.print(f"measurements written to {args.json}")
    if args.plot:
        _plot(report, args.plot)
        console.print(f"plot written to {args.plot}")
    return 0 if report["max_abs_error"] <= report["quantisation_bound"] else 1

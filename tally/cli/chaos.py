"""``tally chaos``: a fault campaign against real services on 127.0.0.1 (see
``tally.chaos.campaign``): random faults, one per round, every invariant checked after each."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tally.cli import argtypes
from tally.cli.console import console as cli_console


def _faults(text: str) -> tuple[str, ...]:
    from tally.chaos.campaign import FAULTS, FRONT_FAULTS, REPLICA_FAULTS

    known = FAULTS + FRONT_FAULTS + REPLICA_FAULTS
    chosen = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = sorted(set(chosen) - set(known))
    if not chosen or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(known)}; got {text!r}")
    return chosen


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chaos", help="a fault campaign: random faults against real services, every committed sum checked",
        description="Starts a coordinator and aggregators as processes over TLS on 127.0.0.1 and a synthetic "
        "fleet, runs one FedAvg job, and injects one random fault per round (device dropouts below and past "
        "the threshold, aggregators and the coordinator (or, with --replicas, its leading replica) SIGKILLed "
        "mid-round and restarted, with --replicas the leading replica paused past its lease and resumed, "
        "devices sending late, duplicated, replayed or corrupt messages or leaving "
        "their stream open and unread). After every round: "
        "each committed cohort sum equals the sum of its contributors' inputs, rounds commit once and in "
        "order, the round ended by its deadline, no process died unkilled; at the end, no memory growth. "
        "Exit status 1 when any invariant was violated.",
    )
    p.add_argument("--rounds", type=argtypes.integer(1), default=10, help="rounds to run (default: %(default)s)")
    p.add_argument("--devices", type=argtypes.integer(10), default=60, help="synthetic devices (default: %(default)s)")
    p.add_argument("--cohort", type=argtypes.integer(5), default=20, help="cohort size (default: %(default)s)")
    p.add_argument("--aggregators", type=argtypes.integer(1, 8), default=2, help="aggregator processes")
    p.add_argument("--hidden", type=argtypes.integer(1), default=16,
                   help="hidden units of the job's mlp: its size is the summed vector's (default: %(default)s)")
    p.add_argument("--faults", type=_faults, default=None,
                   help="comma-separated faults to draw from (default: all; kill_device_front with "
                   "--device-processes > 1)")
    p.add_argument("--device-processes", type=argtypes.integer(1, 16), default=1, metavar="N",
                   help="the coordinator serves devices from N processes (tally coordinator "
                   "--device-processes); with N > 1 the faults include its device fronts killed mid-round "
                   "(default: %(default)s)")
    p.add_argument("--replicas", type=argtypes.integer(1, 8), default=1, metavar="N",
                   help="the coordinator as N replicas over the PostgreSQL database --database names (tally "
                   "coordinator --database); with N > 1 the faults include the leading replica killed mid-round, "
                   "or paused (SIGSTOP) past its lease and resumed once another leads "
                   "(default: %(default)s)")
    p.add_argument("--database", default=os.environ.get("TALLY_DATABASE_URL", ""), metavar="URL",
                   help="postgresql:// URL of the replicas' database (default: $TALLY_DATABASE_URL); use an "
                   "empty database of its own: the campaign's jobs stay in it")
    p.add_argument("--seed", type=argtypes.integer(0), default=0, help="seed of the faults, the fleet and the inputs")
    p.add_argument("--workdir", type=Path, help="certificates, state and logs (default: a temporary directory)")
    p.add_argument("--json", type=Path, help="write the campaign's record here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tally.chaos.campaign import FAULTS, FRONT_FAULTS, REPLICA_FAULTS, Campaign, CampaignConfig
    from tally.coordinator.state.database import is_postgres_url
    from tally.shutdown import Signalled, cancelled_by_signals

    default = (FAULTS + (FRONT_FAULTS if args.device_processes > 1 else ())
               + (REPLICA_FAULTS if args.replicas > 1 else ()))
    try:
        config = CampaignConfig(rounds=args.rounds, devices=args.devices, cohort=args.cohort,
                                aggregators=args.aggregators, hidden=args.hidden, seed=args.seed,
                                faults=args.faults or default, device_processes=args.device_processes,
                                replicas=args.replicas)
    except ValueError as exc:
        print(f"tally chaos: --faults: {exc}", file=sys.stderr)
        return 2
    if args.replicas > 1 and not is_postgres_url(args.database):
        print("tally chaos: --database: --replicas > 1 needs a postgresql:// URL", file=sys.stderr)
        return 2
    if args.devices < 2 * args.cohort:
        print("--devices must be at least twice --cohort: a retried round may not reuse the devices "
              "seated in its failed attempt")
        return 2
    console = cli_console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="tally-chaos-") as tmp:
        workdir = args.workdir or Path(tmp)
        with Progress(TextColumn("[bold]chaos[/bold] {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("rounds", total=args.rounds)

            def on_round(record) -> None:
                progress.update(task, advance=1, description=f"round {record.index}: {record.fault} -> "
                                f"{record.outcome} ({record.seconds:.1f} s)")

            try:
                result = asyncio.run(cancelled_by_signals(
                    Campaign(config, workdir, on_round, database_url=args.database or None).run(), (signal.SIGTERM,)))
            except Signalled:
                print("tally chaos: terminated; its processes are stopped", file=sys.stderr)
                return 143
    report = result.to_dict()
    console.print(_table(report))
    for violation in result.violations:
        console.print(f"[red]violation[/red]: {violation}")
    console.print(f"cohort sums exact {report['sums']['exact']}, wrong {report['sums']['wrong']}; "
                  f"violations {len(result.violations)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if result.violations else 0


def _table(report: dict) -> Table:
    table = Table(title="faults injected and outcomes")
    for column in ("fault", "rounds", "committed", "job failed cleanly", "hung"):
        table.add_column(column, justify="left" if column == "fault" else "right")
    for row in report["faults"]:
        table.add_row(row["fault"], *(str(row[k]) for k in ("rounds", "committed", "job_failed", "hung")))
    return table

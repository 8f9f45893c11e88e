"""The ``tally`` command. Each subcommand lives in its own module; this file only routes.

Only the module of the command being run is imported: most pull in torch or the services, which
would make ``tally --help`` take seconds. The index below carries each command's one-line help
for the overview; a test keeps it equal to the modules' own.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from collections.abc import Sequence
from importlib import metadata

# command -> (module whose register(sub) adds it, one-line help); in the order `tally --help` lists them
COMMANDS: dict[str, tuple[str, str]] = {
    "sum": ("tally.cli.sum", "run one secure sum over a simulated cohort, in process"),
    "demo": ("tally.cli.demo", "coordinator, two aggregators and a simulated fleet on 127.0.0.1, with a report"),
    "simulate": ("tally.cli.simulate", "run an algorithm in process (no network) and write metrics as JSON"),
    "certs": ("tally.cli.certs", "create a CA and per-role TLS certificates and keys for a deployment"),
    "aggregator": ("tally.cli.aggregator",
                   "run a secure aggregator: secure-sum sessions for cohorts, cohort sums only"),
    "client": ("tally.cli.client", "run one device on a shard of a dataset against a coordinator"),
    "fleet": ("tally.cli.client", "run N simulated devices (load tests, demos)"),
    "coordinator": ("tally.cli.coordinator", "run the coordinator service"),
    "job": ("tally.cli.job", "write, check, submit, inspect, cancel and watch jobs; fetch trained models"),
    "algorithms": ("tally.cli.algorithms", "list the algorithms and model kinds installed here, with versions"),
    "new": ("tally.cli.new", "write a new algorithm package: halves, options, privacy, example job, tests"),
    "device": ("tally.cli.device", "revoke an enrolled device"),
    "enrol": ("tally.cli.enrol",
              "print enrolment credentials for devices (what `tally client --credential` takes)"),
    "chaos": ("tally.cli.chaos", "a fault campaign: random faults against real services, every committed sum checked"),
    "k8s": ("tally.cli.k8s", "deploy on Kubernetes, run a fleet there, and show the deployment's state"),
}


def _version() -> str:
    try:
        return metadata.version("tally")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser(command: str | None = "*") -> argparse.ArgumentParser:
    """The parser with ``command``'s module loaded ("*": every module; None or an unknown name:
    none, each command listed with its help only)."""
    parser = argparse.ArgumentParser(
        prog="tally",
        description="Federated learning in which the server side only ever sees sums. "
        "`tally COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"tally {_version()}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, summary) in COMMANDS.items():
        if name in sub.choices:  # a module registering several commands added it
            continue
        if command == "*" or command == name:
            importlib.import_module(module).register(sub)
        elif command not in COMMANDS:
            sub.add_parser(name, help=summary)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # gRPC's core logs each failed TLS handshake as a raw line on stderr; the commands name the
    # cause themselves (tally.security.tls_failures). Set before any command imports grpc.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C of a command without a stop of its own (`job watch`): a line
        print(f"tally {command}: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT

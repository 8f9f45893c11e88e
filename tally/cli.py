"""The ``tally`` command. Each subcommand lives in its own module; this file only routes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tally import demo, engine_demo, simulate_cli
from tally.security import certs_cli
from aggregator import cli as aggregator_cli
from client_sdk import cli as client_cli
from coordinator import cli as coordinator_cli
from coordinator import enrol_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tally",
        description="Federated learning in which the server side only ever sees sums.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    engine_demo.register(sub)
    demo.register(sub)
    simulate_cli.register(sub)
    certs_cli.register(sub)
    aggregator_cli.register(sub)
    client_cli.register(sub)
    coordinator_cli.register(sub)
    enrol_cli.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

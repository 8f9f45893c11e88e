"""One console script per role (``tally-aggregator``, ``tally-coordinator``, ``tally-client``,
``tally-fleet``), each taking exactly the arguments of the matching ``tally`` subcommand.

``tally`` itself imports every subcommand, so it needs every role's dependencies; each script here
imports only its role's CLI module, so it runs with that role's extra alone
(``pip install 'tally[aggregator]'`` has no torch and ``tally-aggregator`` never asks for it).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence


def _run(command: str, module: str, argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="tally")
    sub = parser.add_subparsers(dest="command", required=True)
    importlib.import_module(module).register(sub)
    sub.choices[command].prog = f"tally-{command}"
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return int(args.run(args) or 0)


def aggregator(argv: Sequence[str] | None = None) -> int:
    """``tally aggregator``: the secure-sum service (base dependencies only)."""
    return _run("aggregator", "tally.cli.aggregator", argv)


def coordinator(argv: Sequence[str] | None = None) -> int:
    """``tally coordinator``: jobs, rounds, cohorts (``tally[coordinator]``)."""
    return _run("coordinator", "tally.cli.coordinator", argv)


def client(argv: Sequence[str] | None = None) -> int:
    """``tally client``: one device on a dataset shard (``tally[client]``)."""
    return _run("client", "tally.cli.client", argv)


def fleet(argv: Sequence[str] | None = None) -> int:
    """``tally fleet``: simulated devices for load tests (``tally[loadtest]``)."""
    return _run("fleet", "tally.cli.client", argv)

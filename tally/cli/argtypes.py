"""Command-line value types with their bounds, so a bad value is argparse's one-line error naming
the option (``argument --dropout: must be a number in [0, 1), got '1.5'``), never a traceback from
deep inside a run; and the arguments every service's command shares (``--metrics-port``, the
connection limits)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from tally.metrics import METRICS_PORTS
from tally.security.connections import DEFAULT_LIMITS, ConnectionLimits


def installed_algorithm(text: str) -> str:
    """The name of an algorithm installed in this environment (``tally algorithms list``): read from
    the catalogue only when a name is given, so ``--help`` loads no algorithm package."""
    from tally.algorithms import packages

    if text not in packages.names():
        raise argparse.ArgumentTypeError(f"{text!r} is not an installed algorithm: {', '.join(packages.names())}")
    return text


def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An integer in [low, high] (no upper bound when ``high`` is None)."""
    span = f">= {low}" if high is None else f"in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text!r}")
        return value

    return parse


def number(
    low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = True
) -> Callable[[str], float]:
    """A finite number between ``low`` and ``high``, each bound closed unless said open."""
    span = f"{'(' if open_low else '['}{low:g}, {'∞' if high == math.inf else f'{high:g}'}{')' if open_high else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {text!r}") from None
        below = value <= low if open_low else value < low
        above = value >= high if open_high else value > high
        if not math.isfinite(value) or below or above:
            raise argparse.ArgumentTypeError(f"must be a number in {span}, got {text!r}")
        return value

    return parse


FRACTION = number(0.0, 1.0)  # a probability that must leave someone: [0, 1)
POSITIVE = number(0.0, open_low=True)


def add_metrics_arguments(parser: argparse.ArgumentParser, role: str, *, optional: bool = False) -> None:
    """``--metrics-port`` and ``--metrics-addr`` for ``role``. ``optional``: serve nothing unless
    ``--metrics-port`` is given (a device is no server); alone, it means the role's default port."""

    port, kind = METRICS_PORTS[role], integer(0, 65535)
    served = f"/metrics (tally_{role}_*), /healthz and /readyz"
    if optional:
        parser.add_argument(
            "--metrics-port", type=kind, nargs="?", const=port, metavar="PORT",
            help=f"serve {served} on this port ({port} when no port follows; 0: any free port; "
            "default: not served)",
        )
    else:
        parser.add_argument(
            "--metrics-port", type=kind, default=port, metavar="PORT",
            help=f"port of {served} (default: %(default)s; 0: any free port)",
        )
    parser.add_argument(
        "--metrics-addr", default="127.0.0.1", metavar="HOST",
        help="address the metrics server binds (default: %(default)s, this host only; 0.0.0.0 lets "
        "a Prometheus on another host scrape it)",
    )


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """The device port's connection limits (``tally.security.connections``; docs/security.md)."""
    for flag, field, what in (
        ("--connection-idle", "idle_s", "close a connection with no call in flight after this long"),
        ("--connection-max-age", "max_age_s", "ask every connection to go after this long"),
        ("--connection-age-grace", "age_grace_s", "then close it this much later, calls in flight or not"),
    ):
        parser.add_argument(flag, type=POSITIVE, default=getattr(DEFAULT_LIMITS, field), metavar="SECONDS",
                            dest=f"connection_{field}", help=f"{what} (default: %(default)s)")
    parser.add_argument("--max-connections", type=integer(1), metavar="N",
                        help="connections of the device port in all, per process (default: three quarters of "
                        "the open-file limit)")
    parser.add_argument("--max-connections-per-source", type=integer(0), metavar="N",
                        help="connections one source address may hold, over all processes (default: an eighth "
                        "of --max-connections; 0: no cap). Devices behind one NAT or a gateway that hides "
                        "their addresses share one source")


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(idle_s=args.connection_idle_s, max_age_s=args.connection_max_age_s,
                            age_grace_s=args.connection_age_grace_s, total=args.max_connections,
                            per_source=args.max_connections_per_source)

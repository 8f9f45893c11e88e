"""Command-line value types with their bounds, so a bad value is argparse's one-line error naming
the option (``argument --dropout: must be a number in [0, 1), got '1.5'``), never a traceback from
deep inside a run; and the arguments every service's command shares (``--metrics-port``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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
    from tally.metrics import METRICS_PORTS  # prometheus_client: only for the commands that serve metrics

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

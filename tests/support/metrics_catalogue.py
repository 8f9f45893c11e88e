"""The metric catalogue (docs/metrics.md) parsed into its rows: the tests that check what each role
serves, and the tests that check the rules and dashboards on a live Prometheus, both hold the
services to this one reading of the page."""

from __future__ import annotations

import re
from dataclasses import dataclass

from support.deploy import ROOT

CATALOGUE = ROOT / "docs" / "metrics.md"
SERIES = re.compile(r"`(tally_[a-z0-9_]+)`")
SECTIONS = {"Every role": "shared", "Coordinator": "coordinator", "Aggregator": "aggregator", "Client": "client"}


@dataclass(frozen=True)
class Entry:
    type: str
    unit: str
    labels: frozenset[str]


def catalogue() -> dict[str, dict[str, Entry]]:
    """Section ("shared" or a role) -> series -> its row."""
    out: dict[str, dict[str, Entry]] = {}
    section = None
    for line in CATALOGUE.read_text().splitlines():
        if line.startswith("## "):
            section = next((v for k, v in SECTIONS.items() if line[3:].startswith(k)), None)
        elif line.startswith("| `tally_") and section is not None:
            series, kind, unit, labels, meaning = (cell.strip() for cell in line.strip().strip("|").split("|"))
            name = SERIES.fullmatch(series).group(1)
            assert meaning and name not in out.setdefault(section, {}), f"{name}: listed twice or no meaning"
            out[section][name] = Entry(kind, unit, frozenset(re.findall(r"`(\w+)`", labels)))
    return out

"""How long the offline job-spec commands take, against a limit of 1 s: `tally job validate` of
every example spec and `tally job init` of every algorithm.

Each runs as its own process (`python -m tally.cli job ...`), as a person types it, so interpreter
start-up and every import are in the time; the median of ``--repeats`` runs is compared with the
limit. A spec's check reads its model's layout (tally.models.layouts) and imports neither torch nor
scipy; a test asserts the imports, this measures the time.

    .venv/bin/python bench/cli_offline.py --repeats 5 --json bench/results/cli_offline.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from cli_help import emit, timed  # bench/, beside this script

ROOT = Path(__file__).resolve().parents[1]
LIMIT_S = 1.0
# tally.algorithms.NAMES, named here so that timing starts from a cold interpreter.
ALGORITHMS = ("fedavg", "agnostic_fedavg", "aaggff_d", "aaggff_s", "feddar_wa", "feddar_sa", "lg_fedavg",
              "superfed", "fedevg")


def measure(repeats: int, examples: list[Path], algorithms: list[str]) -> dict:
    rows = {f"validate {p.name}": timed(["job", "validate", str(p)], repeats, LIMIT_S) for p in examples}
    rows |= {f"init {name}": timed(["job", "init", name], repeats, LIMIT_S) for name in algorithms}
    medians = [r["median_s"] for r in rows.values()]
    return {"bench": "cli_offline", "limit_s": LIMIT_S, "repeats": repeats, "commands": rows,
            "median_of_medians_s": statistics.median(medians), "slowest_median_s": max(medians),
            "all_within_limit": max(medians) <= LIMIT_S}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs per command; the median is reported (default: 5)")
    p.add_argument("--examples", type=Path, nargs="*", default=sorted((ROOT / "examples").glob("*.yaml")),
                   help="specs to validate (default: every example)")
    p.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS), help="algorithms to init (default: all)")
    p.add_argument("--json", type=Path, help="write the result here as JSON")
    args = p.parse_args()
    emit(measure(args.repeats, args.examples, args.algorithms), args.json)


if __name__ == "__main__":
    main()

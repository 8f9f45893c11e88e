#!/usr/bin/env python
"""Ring width the distributed-DP planner chooses, by cohort size and noise multiplier.

No training: ``tally.privacy.planning.plan_distributed`` for a payload of ``--dim`` values
(digits' 16-unit MLP: 1210) at 1% discretisation inflation, 10% expected dropouts, 5% corrupt
devices, wrap probability 1e-6 and the cohort sum's floor at half the cohort. It shows where a
job needs more than the 22 bits TensorFlow Federated's distributed-DP aggregator allows.

    python bench/dp_ring_bits.py --json bench/results/dp_ring_bits.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tally.privacy.planning import plan_distributed

TFF_MAX_BITS = 22


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1210)
    p.add_argument("--cohorts", type=int, nargs="+", default=[30, 100, 1000, 10_000, 100_000])
    p.add_argument("--noise-multipliers", type=float, nargs="+", default=[0.3, 0.5, 1.0, 4.0])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = []
    for n in args.cohorts:
        for z in args.noise_multipliers:
            plan = plan_distributed(clip=1.0, dim=args.dim, noise_multiplier=z, cohort_size=n, dropout_rate=0.1,
                                    corrupt_rate=0.05, min_survivors=max(2, n // 2))
            rows.append({"cohort": n, "noise_multiplier": z, "bits": plan.bits(n), "inflation": plan.inflation,
                         "beyond_tff_cap": plan.bits(n) > TFF_MAX_BITS})
    table = Table(title=f"bits per value chosen for a {args.dim}-value payload")
    table.add_column("cohort")
    for z in args.noise_multipliers:
        table.add_column(f"z = {z:g}")
    for n in args.cohorts:
        table.add_row(str(n), *(f"{r['bits']}{' *' if r['beyond_tff_cap'] else ''}"
                                for r in rows if r["cohort"] == n))
    Console().print(table)
    Console().print(f"* more than TFF's {TFF_MAX_BITS}-bit cap")
    if args.json:
        args.json.write_text(json.dumps(
            {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

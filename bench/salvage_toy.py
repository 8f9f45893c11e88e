"""The toy reproduction of specs/local-adaptation.md section 12.D, both configs over seeds 0-4,
beside the spec's own numbers: who is worse off than with a local model under BASIC-, DP- and
ROBUST-FED, and after local adaptation (FT, EWC, KD, per-participant best).

    .venv/bin/python bench/salvage_toy.py --json bench/results/salvage_toy.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import salvage_toy_model as toy  # bench/ is the script's own folder: sys.path[0]
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

CONFIGS = {"A": toy.CONFIG_A, "B": toy.CONFIG_B}

# The spec's tables (means over seeds 0-4; its [min, max] where it gives them).
SPEC: dict[str, dict[str, Any]] = {
    "A": {
        "local": 0.622,
        "basic": {"fed": 0.812, "share_losing": 0.068, "ft": 0.812, "ewc": 0.816, "kd": 0.817, "best": 0.823,
                  "share_losing_adapted": 0.038},
        "dp": {"fed": 0.684, "share_losing": 0.294, "ft": 0.721, "ewc": 0.701, "kd": 0.702, "best": 0.722,
               "share_losing_adapted": 0.128},
        "robust": {"fed": 0.813, "share_losing": 0.074, "ft": 0.812, "ewc": 0.816, "kd": 0.818, "best": 0.824,
                   "share_losing_adapted": 0.046},
    },
    "B": {
        "local": 0.624,
        "basic": {"fed": 0.721, "fed_majority": 0.779, "fed_minority": 0.586, "share_losing": 0.196,
                  "share_losing_minority": 0.560, "best": 0.765, "share_losing_adapted": 0.074},
        "dp": {"fed": 0.616, "fed_majority": 0.656, "fed_minority": 0.523, "share_losing": 0.514,
               "share_losing_minority": 0.707, "best": 0.675, "share_losing_adapted": 0.306},
        "robust": {"fed": 0.732, "fed_majority": 0.818, "fed_minority": 0.532, "share_losing": 0.218,
                   "share_losing_minority": 0.727, "best": 0.771, "share_losing_adapted": 0.134},
    },
}
HEADERS = {"fed_majority": "fed maj", "fed_minority": "fed min", "share_losing": "losing",
           "share_losing_minority": "losing min", "share_losing_adapted": "losing adapted"}
COLUMNS = ("fed", "fed_majority", "fed_minority", "share_losing", "share_losing_minority",
           "ft", "ewc", "kd", "best", "share_losing_adapted")


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def table(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean [min, max] over seeds of every summary entry."""
    out: dict[str, Any] = {"local": spread([s["local"] for s in per_seed])}
    for kind in toy.AGGREGATIONS:
        out[kind] = {c: spread([s[kind][c] for s in per_seed]) for c in COLUMNS}
    return out


def show(console: Console, name: str, measured: dict[str, Any]) -> None:
    spec = SPEC[name]
    view = Table(title=f"config {name}: local-only {measured['local']['mean']:.3f} (spec {spec['local']:.3f}); "
                       "mean over seeds (spec's number below)")
    view.add_column("aggregation")
    for c in COLUMNS:
        view.add_column(HEADERS.get(c, c), justify="right")
    for kind in toy.AGGREGATIONS:
        cells = []
        for c in COLUMNS:
            m = measured[kind][c]["mean"]
            s = spec[kind].get(c)
            cells.append(f"{m:.3f}" + ("" if s is None else f"\n({s:.3f})"))
        view.add_row(kind, *cells)
    console.print(view)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(5)), help="one run per seed")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS))
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    console = Console(stderr=True, width=140)
    result: dict[str, Any] = {"seeds": args.seeds, "configs": {}}
    with Progress(console=console) as progress:
        task = progress.add_task("toy runs", total=len(args.seeds) * len(args.configs))
        for name in args.configs:
            per_seed, seconds = [], []
            for seed in args.seeds:
                start = time.perf_counter()
                per_seed.append(toy.run_seed(CONFIGS[name], seed).summary())
                seconds.append(time.perf_counter() - start)
                progress.advance(task)
            result["configs"][name] = {"recipe": vars(CONFIGS[name]), "measured": table(per_seed),
                                       "spec": SPEC[name], "per_seed": per_seed,
                                       "seconds_per_seed": spread(seconds)}
    for name in args.configs:
        show(console, name, result["configs"][name]["measured"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

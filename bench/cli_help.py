"""How long each `tally COMMAND --help` takes, against a limit of 0.5 s.

Each command runs as its own process (`python -m tally.cli COMMAND --help`), as a person types
it, so interpreter start-up and every import the command's module makes are in the time. The
limit is the same for every command; the median of ``--repeats`` runs is compared with it.

    .venv/bin/python bench/cli_help.py --repeats 5 --json bench/results/cli_help.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tally.cli import COMMANDS

LIMIT_S = 0.5


def measure(commands: list[str], repeats: int) -> dict:
    rows = {}
    for command in commands:
        seconds = []
        for _ in range(repeats):
            began = time.perf_counter()
            subprocess.run([sys.executable, "-m", "tally.cli", command, "--help"], check=True,
                           stdout=subprocess.DEVNULL)
            seconds.append(time.perf_counter() - began)
        median = statistics.median(seconds)
        rows[command] = {"median_s": median, "min_s": min(seconds), "max_s": max(seconds),
                         "ratio_to_limit": median / LIMIT_S}
    return {"bench": "cli_help", "limit_s": LIMIT_S, "repeats": repeats, "commands": rows,
            "all_within_limit": all(r["median_s"] <= LIMIT_S for r in rows.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commands", nargs="+", choices=sorted(COMMANDS), default=sorted(COMMANDS),
                   help="commands to time (default: every one)")
    p.add_argument("--repeats", type=int, default=5, help="runs per command; the median is reported (default: 5)")
    p.add_argument("--json", type=Path, help="write the result here as JSON")
    args = p.parse_args()
    result = measure(args.commands, args.repeats)
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

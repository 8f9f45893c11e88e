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


def timed(argv: list[str], repeats: int, limit_s: float) -> dict[str, float]:
    """``tally ARGV`` run ``repeats`` times, each as its own process: median, min, max and the
    median's ratio to ``limit_s`` (bench/cli_offline.py times its commands with this too)."""
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tally.cli", *argv], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        seconds.append(time.perf_counter() - began)
    median = statistics.median(seconds)
    return {"median_s": median, "min_s": min(seconds), "max_s": max(seconds), "ratio_to_limit": median / limit_s}


def emit(result: dict, path: Path | None) -> None:
    """Print ``result`` as JSON, and write it to ``path`` when given."""
    text = json.dumps(result, indent=2)
    if path:
        path.write_text(text + "\n")
    print(text)


def measure(commands: list[str], repeats: int) -> dict:
    rows = {command: timed([command, "--help"], repeats, LIMIT_S) for command in commands}
    return {"bench": "cli_help", "limit_s": LIMIT_S, "repeats": repeats, "commands": rows,
            "all_within_limit": all(r["median_s"] <= LIMIT_S for r in rows.values())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--commands", nargs="+", choices=sorted(COMMANDS), default=sorted(COMMANDS),
                   help="commands to time (default: every one)")
    p.add_argument("--repeats", type=int, default=5, help="runs per command; the median is reported (default: 5)")
    p.add_argument("--json", type=Path, help="write the result here as JSON")
    args = p.parse_args()
    emit(measure(args.commands, args.repeats), args.json)


if __name__ == "__main__":
    main()

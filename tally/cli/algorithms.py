"""``tally algorithms list``: the algorithms installed in this environment, with versions and the
packages they come from, the model kinds packages add, and every entry refused at load with why.
Run on a coordinator's host it says what jobs may name; on a device's, what that device declares
at check-in."""

from __future__ import annotations

import argparse

from tally.cli.job import _print_json, output_parser


def register(sub: argparse._SubParsersAction) -> None:
    command = sub.add_parser("algorithms", help="list the algorithm packages installed here, with versions",
                             description=__doc__.splitlines()[0])
    actions = command.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", parents=[output_parser()], help="installed algorithms and refused entries")
    listing.set_defaults(run=_list)


def _list(args: argparse.Namespace) -> int:
    from tally.algorithms import packages

    catalogue = packages.catalogue()
    rows = [{"name": name, "version": found.algorithm.version, "package": found.package,
             "needs": list(found.algorithm.needs), "summary": found.algorithm.summary}
            for name, found in catalogue.installed.items()]
    from tally import models

    modelled = models.packages()
    model_rows = [{"kind": kind, "version": version, "package": package}
                  for kind, (package, version, _) in modelled.installed.items()]
    problems = [*catalogue.refused, *modelled.refused]
    refused = [{"package": r.package, "entry": r.entry, "reason": r.reason} for r in problems]
    if args.json:
        _print_json({"algorithms": rows, "models": model_rows, "refused": refused})
        return 0
    width = max((len(row["name"]) for row in rows), default=0)
    for row in rows:
        needs = f"  needs {', '.join(row['needs'])}" if row["needs"] else ""
        print(f"{row['name']:<{width}}  {row['version']:<10}  {row['package']:<16}{needs}  {row['summary']}".rstrip())
    for row in model_rows:
        print(f"model kind {row['kind']}  {row['version']}  {row['package']}")
    for problem in problems:
        print(f"refused: {problem}")
    return 0

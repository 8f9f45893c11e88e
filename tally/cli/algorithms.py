"""``tally algorithms list``: the algorithms and model kinds installed in this environment, with
versions and the packages they come from, and every entry refused at load with why.
Run on a coordinator's host it says what jobs may name; on a device's, what that device declares
at check-in."""

from __future__ import annotations

import argparse
import sys

from tally.cli.job import _print_json, output_parser


def register(sub: argparse._SubParsersAction) -> None:
    command = sub.add_parser("algorithms", help="list the algorithms and model kinds installed here, with versions",
                             description=__doc__.splitlines()[0])
    actions = command.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", parents=[output_parser()],
                                 help="installed algorithms and model kinds, and refused entries")
    listing.add_argument("--model-plugin", action="append", default=[], metavar="MODULE",
                         help="a plug-in module of model kinds (TALLY_MODELS) the device or coordinator loads: "
                              "its kinds are listed too")
    listing.set_defaults(run=_list)


def _list(args: argparse.Namespace) -> int:
    from tally.algorithms import packages

    catalogue = packages.catalogue()
    rows = [{"name": name, "version": found.item.version, "package": found.package,
             "needs": list(found.item.needs), "summary": found.item.summary}
            for name, found in catalogue.installed.items()]
    from tally import models

    try:
        models.load_plugins(args.model_plugin)
    except models.PluginError as exc:
        print(f"tally algorithms list: {exc}", file=sys.stderr)
        return 2
    modelled = models.catalogue()
    model_rows = [{"kind": kind, "version": found.item.version, "package": found.package,
                   "summary": found.item.summary} for kind, found in modelled.installed.items()]
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
        print(f"model kind {row['kind']}  {row['version']}  {row['package']}  {row['summary']}".rstrip())
    for problem in problems:
        print(f"refused: {problem}")
    return 0

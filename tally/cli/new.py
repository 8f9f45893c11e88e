"""``tally new algorithm NAME``: write an algorithm package to start from: a pyproject declaring the
``tally.algorithms`` entry point, the two halves, the options with their meanings and ranges, the
privacy role of every payload field, an example job and tests (``tally.testing``) that pass as
written once the package is installed (``pip install -e DIR``)."""

from __future__ import annotations

import argparse
import re
import string
import sys
from pathlib import Path

TEMPLATES = Path(__file__).parent / "scaffold" / "algorithm"
_NAME = re.compile(r"[a-z][a-z0-9_]{0,39}")


def register(sub: argparse._SubParsersAction) -> None:
    new = sub.add_parser("new", help="write a new algorithm package: halves, options, privacy, example job, tests",
                         description=__doc__.splitlines()[0])
    kinds = new.add_subparsers(dest="kind", required=True, metavar="KIND")
    algorithm = kinds.add_parser("algorithm", help="an algorithm package")
    algorithm.add_argument("name", help="the algorithm's name, as jobs will say `algorithm: NAME` "
                                        "(lowercase letters, digits, '_')")
    algorithm.add_argument("--dir", type=Path, default=None,
                           help="where to write it (default: ./tally-NAME); must not exist or be empty")
    algorithm.set_defaults(run=_algorithm)


def write_algorithm_package(name: str, directory: Path) -> list[Path]:
    """The files of package ``name`` written under ``directory``; ``ValueError`` for a name a
    job could not say or a directory that already holds files."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an algorithm name: lowercase letters, digits and '_', "
                         "starting with a letter, at most 40")
    if directory.exists() and any(directory.iterdir()):
        raise ValueError(f"{directory} already exists and is not empty")
    module = f"tally_{name}"
    values = {"name": name, "module": module, "dist": f"tally-{name.replace('_', '-')}",
              "class_name": "".join(part.capitalize() for part in name.split("_"))}
    written = []
    for template in sorted(TEMPLATES.rglob("*.tmpl")):
        relative = template.relative_to(TEMPLATES).with_suffix("")
        if relative.name in ("__init__.py", "algorithm.py"):
            relative = Path(module) / relative
        elif relative.name == "test_algorithm.py":  # named after the algorithm: pytest wants unique names
            relative = relative.with_name(f"test_{name}.py")
        target = directory / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(string.Template(template.read_text()).substitute(values))
        written.append(target)
    return written


def _algorithm(args: argparse.Namespace) -> int:
    directory = args.dir or Path(f"tally-{args.name.replace('_', '-')}")
    try:
        written = write_algorithm_package(args.name, directory)
    except ValueError as exc:
        print(f"tally new algorithm: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    print(f"next: pip install -e {directory} && pytest {directory / 'tests'}", file=sys.stderr)
    return 0

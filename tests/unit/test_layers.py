"""Import direction across tally/ (issue 27): the layers of
``tally/__init__.py``'s module map, checked by parsing every module's imports with ``ast``.

A module may import its own layer or a lower one, never a higher one, and no chain of imports may
lead from a module back to itself. Every import counts, wherever it is written: a function-level
import that keeps ``tally --help`` fast is still a dependency, and so is one under
``if TYPE_CHECKING:`` (a type the module cannot name without the other is coupling all the same),
and so is ``importlib.import_module("a.literal.name")``. Only an import's implied parent packages
are left out (``import a.b.c`` runs ``a/__init__`` and ``a/b/__init__``, which may import ``a.b.c``:
Python orders that, it is no cycle).

``tests/unit/test_layers.py`` is the only place the layers are written down for a machine; the module
map and docs/DESIGN.md say the same in words.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tally",)

# Lowest first. A module belongs to the layer of the longest prefix that names it (a package name
# covers its submodules); a module no prefix names fails the test, so a new top-level module is
# given a place on purpose.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # what every part shares: no imports of the project beyond this layer
    ("plumbing", ("tally", "tally.version", "tally.logs", "tally.metrics", "tally.modelio")),
    # the protocol, free of torch: secure sum, fixed-point codec, TLS and enrolment, the wire
    ("protocol", ("tally.codec", "tally.secagg", "tally.security", "tally.wire")),
    # the halves of each algorithm: framework-free, sums only; with the options of a device's local
    # adaptation, which parse as algorithms' options do
    ("algorithms", ("tally.algorithms", "tally.algorithms.adaptation_options")),
    # differential privacy: wraps any algorithm's halves (clipping, noise, accounting)
    ("privacy", ("tally.privacy",)),
    # torch: the models, their trainers, and the datasets that hand devices trainers
    ("models", ("tally.models",)),
    ("training", ("tally.training",)),
    ("datasets", ("tally.datasets",)),
    # the three services
    ("services", ("tally.coordinator", "tally.aggregator", "tally.client")),
    # what runs the services or the algorithms for a person: the simulator and its reports,
    # operations, the fault campaign, research reproductions
    ("tools", ("tally.sim", "tally.loadtest", "tally.ops", "tally.chaos")),
    # the commands
    ("cli", ("tally.cli",)),
)
# Within the services layer each service stands alone: none imports another (each has its own image
# and extra, and talks to the others over gRPC only).
SIBLINGS = ("tally.coordinator", "tally.aggregator", "tally.client")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (a package's __init__ under the package's name)
    line: int


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Dotted name -> file for every module under ``root``'s ``packages``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(root: Path, packages: Sequence[str]) -> list[Import]:
    """Every import between the modules of ``packages`` under ``root``."""
    known = modules(root, packages)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found = set()
    for source, path in known.items():
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                # ``from a import b``: the module a.b where there is one, else a itself
                names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                         for alias in node.names]
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module" and node.args
                  and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            for name in names:
                if name.split(".")[0] not in packages:
                    continue
                target = resolve(name)
                if target is not None and target != source:
                    found.add(Import(source, target, node.lineno))
    return sorted(found, key=lambda i: (i.source, i.line, i.target))


def layer_of(module: str, layers: Sequence[tuple[str, Sequence[str]]]) -> int | None:
    """Index of the layer whose longest prefix names ``module``; None when none does."""
    best, best_length = None, -1
    for index, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    return best


def wrong_way(found: Iterable[Import], layers: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Each import of a higher layer, as ``source:line imports target (layer < layer)``."""
    problems = []
    for imp in found:
        low, high = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if low is not None and high is not None and high > low:
            problems.append(f"{imp.source}:{imp.line} imports {imp.target} "
                            f"({layers[low][0]} must not import {layers[high][0]})")
    return problems


def unplaced(names: Iterable[str], layers: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    return sorted(name for name in names if layer_of(name, layers) is None)


def cycles(found: Iterable[Import]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.source, set()).add(imp.target)
        graph.setdefault(imp.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:  # recursion depth is bounded by the module count (hundreds)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def across(found: Iterable[Import], siblings: Sequence[str]) -> list[str]:
    """Each import from one of ``siblings`` (top-level packages) into another."""
    return [f"{imp.source}:{imp.line} imports {imp.target} (a sibling)" for imp in found
            if imp.source.split(".")[0] in siblings and imp.target.split(".")[0] in siblings
            and imp.source.split(".")[0] != imp.target.split(".")[0]]


def check(root: Path, packages: Sequence[str], layers: Sequence[tuple[str, Sequence[str]]],
          siblings: Sequence[str] = ()) -> list[str]:
    """Everything wrong with ``root``'s imports, one line each; empty when the layering holds."""
    found = imports(root, packages)
    return ([f"{name} is in no layer" for name in unplaced(modules(root, packages), layers)]
            + wrong_way(found, layers) + across(found, siblings)
            + [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(found)])


def test_the_project_keeps_its_layers_and_has_no_import_cycle():
    assert check(ROOT, PACKAGES, LAYERS, SIBLINGS) == []


# The checker itself, on a tiny package written for each case.

TOY_LAYERS = (("base", ("toy.base",)), ("mid", ("toy.mid",)), ("top", ("toy", "toy.top")))


def write(root: Path, files: Mapping[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def toy(tmp_path: Path, **extra: str) -> list[str]:
    files = {"toy/__init__.py": "", "toy/base/__init__.py": "", "toy/base/util.py": "X = 1\n",
             "toy/mid/__init__.py": "", "toy/mid/work.py": "from toy.base.util import X\n",
             "toy/mid/leaf.py": "", "toy/top/__init__.py": "", "toy/top/cli.py": "from toy.mid import work\n",
             "toy/top/leaf.py": ""}
    files.update({name.replace("__", "/") + ".py": text for name, text in extra.items()})
    return check(write(tmp_path, files), ("toy",), TOY_LAYERS)


def test_a_package_that_imports_downwards_only_passes(tmp_path):
    assert toy(tmp_path) == []


def test_a_wrong_way_import_fails_even_inside_a_function(tmp_path):
    problems = toy(tmp_path, toy__base__util="X = 1\n\ndef late():\n    from toy.top import leaf\n")
    assert problems == ["toy.base.util:4 imports toy.top.leaf (base must not import top)"]


def test_relative_type_checking_and_import_module_imports_count(tmp_path):
    assert toy(tmp_path, toy__base__util="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
               "    from ..mid import leaf\n") == ["toy.base.util:3 imports toy.mid.leaf (base must not import mid)"]
    assert toy(tmp_path, toy__base__util="import importlib\nimportlib.import_module('toy.top.leaf')\n") == [
        "toy.base.util:2 imports toy.top.leaf (base must not import top)"]


def test_a_cycle_within_one_layer_fails(tmp_path):
    problems = toy(tmp_path, toy__mid__other="from toy.mid.work import Y\n",
                   toy__mid__work="from toy.base.util import X\nY = X\n\ndef f():\n    from toy.mid import other\n")
    assert problems == ["import cycle: toy.mid.other -> toy.mid.work"]


def test_a_sibling_import_fails(tmp_path):
    files = {"toy/__init__.py": "", "toy/base/__init__.py": "", "toy/base/a.py": "from toy.base.b import X\n",
             "toy/base/b.py": "X = 1\n"}
    assert check(write(tmp_path, files), ("toy",), TOY_LAYERS, siblings=()) == []
    assert check(tmp_path, ("toy",), (("all", ("toy",)),), siblings=()) == []
    assert check(tmp_path, ("toy",), (("all", ("toy",)),), siblings=("toy",)) == []  # one package: no sibling
    write(tmp_path, {"kit/__init__.py": "import toy.base.b\n"})
    assert check(tmp_path, ("toy", "kit"), (("all", ("toy", "kit")),), siblings=("toy", "kit")) == [
        "kit:1 imports toy.base.b (a sibling)"]


def test_a_module_in_no_layer_fails(tmp_path):
    assert check(write(tmp_path, {"toy/__init__.py": "", "toy/stray.py": ""}), ("toy",),
                 (("base", ("toy.base",)),)) == ["toy is in no layer", "toy.stray is in no layer"]

"""Import direction across tally/ (issues 27 and 43): the contracts of ``[tool.importlinter]`` in
``pyproject.toml``, checked twice.

``lint-imports`` (import-linter) checks them as written, indirect chains included; the test below
runs it. This module reads the same contracts and checks, by parsing every module with ``ast``, what
import-linter does not see: ``importlib.import_module("a.literal.name")`` (a dependency all the
same), a module that sits in no layer (so a new package is given a place on purpose), and any
chain of imports that leads from a module back to itself. Every import counts, wherever it is
written: a function-level import that keeps ``tally --help`` fast is still a dependency, and so is
one under ``if TYPE_CHECKING:`` (a type the module cannot name without the other is coupling all the
same). Only an import's implied parent packages are left out (``import a.b.c`` runs ``a/__init__``
and ``a/b/__init__``, which may import ``a.b.c``: Python orders that, it is no cycle).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from support import tools

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tally",)

Layer = tuple[str, tuple[str, ...]]  # its name as the contract writes it, and its modules


@dataclass(frozen=True)
class Layers:
    """One layers contract for one container: every module under ``container`` belongs to the layer
    of the longest of ``layers``' names that is it or a package above it, and a module that none
    names fails. The container's own ``__init__`` belongs to the lowest layer: a package's
    ``__init__`` that imported what it contains would import upwards."""

    container: str
    layers: tuple[Layer, ...]  # lowest first


def contracts(pyproject: str) -> tuple[tuple[Layers, ...], tuple[tuple[str, ...], ...]]:
    """The layers and the groups of independent siblings that ``pyproject``'s
    ``[tool.importlinter]`` contracts declare: a layers contract (each of ours names its
containers) lists its layers highest first,
    "a | b" for independent siblings and "a : b" for ones that may import each other; an
    independence contract names a group of siblings."""
    layered: list[Layers] = []
    siblings: list[tuple[str, ...]] = []
    for contract in tomllib.loads(pyproject)["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "independence":
            siblings.append(tuple(contract["modules"]))
        elif contract["type"] == "layers":
            for container in contract["containers"]:
                layers = []
                for written in reversed(contract["layers"]):
                    names = tuple(f"{container}.{tail.strip()}"
                                  for tail in written.replace("|", ":").split(":"))
                    layers.append((written, names))
                    if "|" in written:
                        siblings.append(names)
                layered.append(Layers(container, tuple(layers)))
    return tuple(layered), tuple(dict.fromkeys(siblings))


LAYERS, SIBLINGS = contracts((ROOT / "pyproject.toml").read_text())


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


def layer_of(module: str, layers: Layers) -> int | None:
    """Index of the layer whose longest name is ``module`` or a package above it; None when
    ``module`` is outside ``layers``' container or no layer names it."""
    if module == layers.container:
        return 0
    best, best_length = None, -1
    for index, (_, names) in enumerate(layers.layers):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_length:
                best, best_length = index, len(name)
    return best


def wrong_way(found: Iterable[Import], layers: Layers) -> list[str]:
    """Each import of a higher layer, as ``source:line imports target (layer < layer)``."""
    problems = []
    for imp in found:
        low, high = layer_of(imp.source, layers), layer_of(imp.target, layers)
        if low is not None and high is not None and high > low:
            problems.append(f"{imp.source}:{imp.line} imports {imp.target} "
                            f"({layers.layers[low][0]} must not import {layers.layers[high][0]})")
    return problems


def unplaced(names: Iterable[str], layers: Layers) -> list[str]:
    """The modules under ``layers``' container that no layer names."""
    return sorted(name for name in names if name.startswith(layers.container + ".")
                  and layer_of(name, layers) is None)


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


def sibling_of(module: str, siblings: Sequence[str]) -> str | None:
    """The longest of ``siblings`` that is ``module`` or a package above it."""
    holding = [sibling for sibling in siblings if module == sibling or module.startswith(sibling + ".")]
    return max(holding, key=len, default=None)


def across(found: Iterable[Import], siblings: Sequence[str]) -> list[str]:
    """Each import from one of ``siblings`` (packages, dotted or not) into another."""
    problems = []
    for imp in found:
        source, target = sibling_of(imp.source, siblings), sibling_of(imp.target, siblings)
        if source is not None and target is not None and source != target:
            problems.append(f"{imp.source}:{imp.line} imports {imp.target} (a sibling)")
    return problems


def check(root: Path, packages: Sequence[str], layered: Sequence[Layers],
          siblings: Sequence[Sequence[str]] = ()) -> list[str]:
    """Everything wrong with ``root``'s imports, one line each; empty when the rules hold."""
    found = imports(root, packages)
    names = modules(root, packages)
    return ([f"{name} is in no layer" for layers in layered for name in unplaced(names, layers)]
            + [problem for layers in layered for problem in wrong_way(found, layers)]
            + [problem for group in siblings for problem in across(found, group)]
            + [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(found)])


def test_the_project_keeps_its_layers_and_has_no_import_cycle():
    assert check(ROOT, PACKAGES, LAYERS, SIBLINGS) == []


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the contracts in ``root``/pyproject.toml, ``root``'s packages first on
    the path (the .venv's editable install may point at another checkout)."""
    program = tools.require("lint-imports", "import-linter, in the test extra", search=Path(sys.executable).parent)
    return subprocess.run([program, "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)


def test_import_linter_finds_the_contracts_kept():
    """The contracts as import-linter reads them: chains through other modules count there."""
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


# The checker itself, on a tiny package written for each case.

TOY_LAYERS = (Layers("toy", (("base", ("toy.base",)), ("mid", ("toy.mid",)), ("top", ("toy.top",)))),)


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


def test_a_module_in_no_layer_fails_and_the_container_sits_lowest(tmp_path):
    assert toy(tmp_path, toy__stray="") == ["toy.stray is in no layer"]
    toy(tmp_path)
    write(tmp_path, {"toy/__init__.py": "from toy.top import leaf\n", "toy/stray.py": ""})
    assert check(tmp_path, ("toy",), TOY_LAYERS) == ["toy.stray is in no layer",
                                                     "toy:1 imports toy.top.leaf (base must not import top)"]


# The contracts as pyproject.toml writes them, on a toy house shaped like tally's: services that
# are dotted packages under one root, and rooms inside one of them.
TOY_PYPROJECT = """
[tool.importlinter]
root_package = "toy"

[[tool.importlinter.contracts]]
name = "layers"
type = "layers"
containers = ["toy"]
layers = ["cli : tools", "coordinator | client", "base"]

[[tool.importlinter.contracts]]
name = "services"
type = "independence"
modules = ["toy.coordinator", "toy.client"]

[[tool.importlinter.contracts]]
name = "rooms"
type = "layers"
containers = ["toy.coordinator"]
layers = ["service", "rounds"]
"""
TOY_HOUSE = {"toy/__init__.py": "", "toy/base.py": "", "toy/tools.py": "import toy.coordinator.service\n",
             "toy/cli.py": "from toy import tools\n", "toy/client/__init__.py": "", "toy/client/y.py": "",
             "toy/coordinator/__init__.py": "", "toy/coordinator/rounds/__init__.py": "",
             "toy/coordinator/rounds/x.py": "from toy import base\n",
             "toy/coordinator/service.py": "from toy.coordinator.rounds import x\n"}


def house(tmp_path: Path, **extra: str) -> list[str]:
    files = {**TOY_HOUSE, **{name.replace("__", "/") + ".py": text for name, text in extra.items()}}
    return check(write(tmp_path, files), ("toy",), *contracts(TOY_PYPROJECT))


def test_the_contracts_read_lowest_first_with_their_siblings():
    layered, siblings = contracts(TOY_PYPROJECT)
    assert layered == (
        Layers("toy", (("base", ("toy.base",)), ("coordinator | client", ("toy.coordinator", "toy.client")),
                       ("cli : tools", ("toy.cli", "toy.tools")))),
        Layers("toy.coordinator", (("rounds", ("toy.coordinator.rounds",)),
                                   ("service", ("toy.coordinator.service",)))))
    assert siblings == (("toy.coordinator", "toy.client"),)  # "a : b" are no independent siblings
    assert contracts(TOY_PYPROJECT.replace('"cli : tools"', '"cli | tools"'))[1] == (
        ("toy.coordinator", "toy.client"), ("toy.cli", "toy.tools"))


def test_the_toy_house_keeps_its_contracts(tmp_path):
    assert house(tmp_path) == []


def test_a_service_importing_another_fails_though_both_sit_under_one_root(tmp_path):
    # the sibling rule once compared the importer's first name ("toy") with "toy.client": no finding
    assert house(tmp_path, toy__coordinator__rounds__x="import toy.client.y\n") == [
        "toy.coordinator.rounds.x:1 imports toy.client.y (a sibling)"]
    assert house(tmp_path / "back", toy__client__y="def late():\n    from toy.coordinator import service\n") == [
        "toy.client.y:2 imports toy.coordinator.service (a sibling)"]


def test_import_linter_reads_the_toy_contracts_as_this_module_does(tmp_path):
    (tmp_path / "pyproject.toml").write_text(TOY_PYPROJECT)
    assert house(tmp_path) == [] and lint_imports(tmp_path).returncode == 0
    assert house(tmp_path, toy__coordinator__rounds__x="import toy.client.y\n") != []
    broken = lint_imports(tmp_path)
    assert broken.returncode == 1 and "toy.coordinator.rounds.x -> toy.client.y" in broken.stdout, broken.stdout


def test_a_room_importing_a_higher_room_fails(tmp_path):
    assert house(tmp_path, toy__coordinator__rounds__x="import importlib\n"
                 "importlib.import_module('toy.coordinator.service')\n") == [
        "toy.coordinator.rounds.x:2 imports toy.coordinator.service (rounds must not import service)",
        "import cycle: toy.coordinator.rounds.x -> toy.coordinator.service"]


def test_a_module_in_no_room_fails(tmp_path):
    assert house(tmp_path, toy__coordinator__stray="") == ["toy.coordinator.stray is in no layer"]

"""``make demo`` installs what the demo runs and nothing of the tests or the docs: the ``tally[demo]``
extra covers every distribution the demo's processes import (the demo itself with its fleet and
report, the coordinator, the aggregators), and the Makefile's demo target installs that extra alone."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
# What runs when `tally demo` does: its own lazily imported parts, and the services it starts.
DEMO_IMPORTS = """
import tally.cli.demo, tally.cli.coordinator, tally.cli.aggregator
import tally.coordinator.service, tally.aggregator.service
from tally.client import Device, OnnxModel
from tally.datasets.digits import digits
from tally.loadtest import DropoutPlan, Fleet
from tally.models.mlp import mlp
from tally.training import TorchTrainer
import tally.client.onnx_model
import matplotlib.pyplot
"""
# Imported when present, never required: grpc loads grpc_tools' run-time protos if installed, and
# numpy.f2py (which torch loads) charset_normalizer.
OPTIONAL = {"grpcio-tools", "charset-normalizer"}


# The distributions whose files the imported modules are. A top-level name several distributions
# share (the ``google`` namespace of protobuf, and of google-auth where MLflow is installed) is
# told apart by which one's RECORD lists the module's file.
OWNERS = """
import json, sys
from importlib import metadata
from pathlib import Path
owners = metadata.packages_distributions()
found = set()
for name, module in list(sys.modules.items()):
    candidates = owners.get(name.partition('.')[0], ())
    if len(candidates) > 1:
        if not getattr(module, '__file__', None):
            continue  # the shared namespace itself: its modules with files tell the owners apart
        path = Path(module.__file__).resolve()
        candidates = [d for d in candidates
                      if any(path == Path(f.locate()).resolve() for f in metadata.distribution(d).files or ())]
    found.update(candidates)
print(json.dumps(sorted(found)))
"""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _tally_requirements(extra: str) -> list[Requirement]:
    """What ``tally[extra]`` asks for, read from this tree's pyproject.toml (the installed metadata
    may be another checkout's)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"][extra]]


def _closure(requirements: list[Requirement]) -> set[str]:
    """The normalised names of the distributions ``requirements`` install, transitively."""
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(r, frozenset[str]()) for r in requirements]
    while todo:
        req, active = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (active or {""})):
            continue
        key = (_normal(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        if key[0] == "tally":
            todo += [(r, frozenset[str]()) for extra in req.extras for r in _tally_requirements(extra)]
        else:
            todo += [(Requirement(text), frozenset(req.extras)) for text in metadata.requires(req.name) or []]
    return {name for name, _ in seen}


def test_the_demo_extra_covers_every_distribution_the_demo_imports():
    script = DEMO_IMPORTS + OWNERS
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    imported = {_normal(d) for d in json.loads(done.stdout)} - {"tally"} - OPTIONAL
    installed = _closure(_tally_requirements("demo"))
    assert imported - installed == set(), "add these to tally[demo] in pyproject.toml"


def test_make_demo_installs_the_demo_extra_and_nothing_of_the_tests_or_docs():
    makefile = (ROOT / "Makefile").read_text()
    demo = re.search(r"(?m)^demo: (.+)$", makefile)
    assert demo is not None
    stamp = demo.group(1).split()[0]
    recipe = re.search(rf"(?ms)^{re.escape(stamp)}:.*?\n((?:\t.*\n)+)", makefile)
    assert recipe is not None, stamp
    installs = re.findall(r"-e '\.\[([^\]]*)\]'", recipe.group(1))
    assert installs == ["demo"], recipe.group(1)
    assert "checkov" not in recipe.group(1)
    assert not {"pytest", "mkdocs", "ruff", "kubernetes"} & _closure(_tally_requirements("demo"))

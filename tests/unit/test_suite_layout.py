"""The test suite's own layout: every test module lives in the folder of its kind (tests/unit,
tests/service, tests/e2e), so ``pytest -m unit`` leaves nothing out by accident; and no module
under tests/ imports a test module: what two modules share lives in tests/support/."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import KINDS

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_lives_in_the_folder_of_one_kind():
    stray = [str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")
             if path.parent.parent != TESTS or path.parent.name not in KINDS]
    assert stray == [], "move these into tests/unit, tests/service or tests/e2e"
    assert all((TESTS / kind).is_dir() for kind in KINDS)


def test_the_kind_markers_come_from_the_folder(request):
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("e2e") is None


def test_no_module_under_tests_imports_a_test_module():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(TESTS)}:{node.lineno}: {name}" for name in names
                      if any(part.startswith("test_") for part in name.split("."))]
    assert not found, "move what is shared into tests/support/: " + "; ".join(found)

"""The test suite's own layout (issue 27): every test module is classified unit, service or e2e
(support/kinds.py), so ``pytest -m unit`` leaves nothing out by accident; and no module under
tests/ imports a test module: what two modules share lives in tests/support/."""

from __future__ import annotations

import ast
from pathlib import Path

from support.kinds import KINDS

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_exactly_one_kind_and_the_table_names_no_other():
    modules = {path.stem for path in TESTS.glob("test_*.py")}
    assert modules - KINDS.keys() == set(), "add these to tests/support/kinds.py"
    assert KINDS.keys() - modules == set(), "no such test module: remove from tests/support/kinds.py"
    assert set(KINDS.values()) <= {"unit", "service", "e2e"}


def test_no_module_under_tests_imports_a_test_module():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.relative_to(TESTS)}:{node.lineno}: {name}" for name in names
                      if any(part.startswith("test_") for part in name.split("."))]
    assert not found, "move what is shared into tests/support/: " + "; ".join(found)

"""The test suite's own layout (issue 27): every test module is classified unit, service or e2e
(support/kinds.py), so ``pytest -m unit`` leaves nothing out by accident."""

from __future__ import annotations

from pathlib import Path

from support.kinds import KINDS

TESTS = Path(__file__).resolve().parent


def test_every_test_module_has_exactly_one_kind_and_the_table_names_no_other():
    modules = {path.stem for path in TESTS.glob("test_*.py")}
    assert modules - KINDS.keys() == set(), "add these to tests/support/kinds.py"
    assert KINDS.keys() - modules == set(), "no such test module: remove from tests/support/kinds.py"
    assert set(KINDS.values()) <= {"unit", "service", "e2e"}


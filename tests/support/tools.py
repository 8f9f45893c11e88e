"""The programs and packages outside Python's reach that some tests need (kubectl, promtool,
PostgreSQL's initdb, hadolint, checkov, podman, lint-imports, kubernetes-validate), looked for in one
place.

On a workstation a missing tool skips the tests that need it, with the reason in pytest's summary.
Where ``TALLY_REQUIRE_TOOLS`` is set (CI sets it) it fails them instead: there a tool gone missing
from the image would otherwise turn a check into a skip that nobody reads.
``TALLY_REQUIRE_CONTAINERS``, the switch ``make test-containers`` has always set, is the same switch
under its older name.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

SWITCHES = ("TALLY_REQUIRE_TOOLS", "TALLY_REQUIRE_CONTAINERS")


def required() -> str | None:
    """The switch that makes a missing tool fail the test that needs it (set, and not to 0), if any."""
    return next((switch for switch in SWITCHES if os.environ.get(switch, "0") not in ("", "0")), None)


def missing(why: str) -> NoReturn:
    """Skip the test (or the module, when called at import) because of ``why``, or fail it where
    a tool is required."""
    switch = required()
    if switch is not None:
        pytest.fail(f"{why} ({switch} is set: a missing tool fails the test)", pytrace=False)
    pytest.skip(why, allow_module_level=True)


def require(name: str, reason: str, *, search: Path | None = None) -> str:
    """The path of program ``name`` (on PATH, or in ``search`` only), else ``missing``; ``reason``
    says what the test needs it for or where it comes from."""
    path = shutil.which(name, path=None if search is None else str(search))
    if path is None:
        missing(f"{name} is not installed: {reason}")
    return path


def require_module(name: str, reason: str) -> ModuleType:
    """The imported module ``name``, else ``missing`` (``pytest.importorskip``, failing where a
    tool is required)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"{name} is not installed: {reason}")


def needs(why_not: str | None) -> pytest.MarkDecorator:
    """A mark for tests that need what is missing when ``why_not`` says so (None: nothing is):
    tests/conftest.py calls ``missing(why_not)`` as such a test is set up, so it is skipped or
    failed there, with the reason, before any fixture starts."""
    return pytest.mark.needs_tool(why_not)

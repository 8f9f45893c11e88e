"""Shared fixtures, and ``tests/`` on ``sys.path`` so every test module imports the shared code
as ``support.<module>`` whichever way pytest is started (from the repository root, from
``tests/``, or on a single file)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture
def one_thread() -> None:
    """Tiny models on many simulated devices: torch's intra-op threads only contend, so the
    modules that train them ask for this (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    from tally.training import single_threaded  # here: torch costs seconds to import, and `-m unit` needs none

    single_threaded()

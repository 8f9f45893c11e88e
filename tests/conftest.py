"""Shared fixtures, and ``tests/`` on ``sys.path`` so every test module imports the shared code
as ``support.<module>`` whichever way pytest is started (from the repository root, from
``tests/``, or on a single file)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import settings

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# Property tests check properties, not speed: hypothesis's default 200 ms deadline per example made a
# graph-building test fail at 310 ms on a loaded machine. Speed is the benchmarks' business (bench/).
settings.register_profile("tally", deadline=None)
settings.load_profile("tally")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_tool(why_not): set by support.tools.needs; a test whose tool "
                                       "is missing skips, or fails under TALLY_REQUIRE_TOOLS")


def pytest_runtest_setup(item: pytest.Item) -> None:
    from support import tools

    for mark in item.iter_markers("needs_tool"):
        if mark.args[0] is not None:
            tools.missing(mark.args[0])


@pytest.fixture
def one_thread() -> None:
    """Tiny models on many simulated devices: torch's intra-op threads only contend, so the
    modules that train them ask for this (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    from tally.training import single_threaded  # here: torch costs seconds to import, and `-m unit` needs none

    single_threaded()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory):
    """TLS identities and a ticket signer for the aggregator service tests (support.aggregator),
    made once per module: writing a deployment's keys and certificates is the slow part."""
    from support.aggregator import new_deployment  # here: it imports the services, `-m unit` needs none

    return new_deployment(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory):
    """One real PostgreSQL server per test process (support.postgres), started on first use."""
    from support import tools
    from support.postgres import _missing, postgres_server

    if _missing():
        tools.missing(_missing())
    with postgres_server(tmp_path_factory.mktemp("postgres")) as server:
        yield server


@pytest.fixture
def postgres_url(postgres) -> str:
    """A new, empty database on that server, for one test: its URL (with the password)."""
    return postgres.database()


@pytest.fixture
def twostep():
    """``twostep`` registered as an algorithm for one test: a two-sum algorithm whose second
    broadcast depends on the first sum (support.coordinator.TwoStepServer)."""
    from support.coordinator import TwoStepServer  # here: it imports the services, `-m unit` needs none
    from tally.coordinator.spec import catalogue

    catalogue.register_algorithm("twostep", TwoStepServer)
    yield
    catalogue.unregister_algorithm("twostep")


KINDS = ("unit", "service", "e2e")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its folder's kind: ``-m unit``, ``-m service``, ``-m e2e``
    (tests/unit: in this process, no server and no port; tests/service: real servers on 127.0.0.1
    or child processes, short of the whole system; tests/e2e: a real coordinator, aggregators and
    devices running jobs). A module's folder is the kind of its heaviest test."""
    for item in items:
        kind = item.path.parent.name
        if kind in KINDS and item.path.parent.parent == TESTS:
            item.add_marker(kind)

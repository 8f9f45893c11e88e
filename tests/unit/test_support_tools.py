"""support.tools: a test whose tool is missing skips with the reason on a workstation and fails
under TALLY_REQUIRE_TOOLS (CI), so a tool gone from CI's image cannot turn a check into a skip."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from conftest import pytest_runtest_setup
from support import tools


@pytest.fixture
def relaxed(monkeypatch: pytest.MonkeyPatch) -> None:
    for switch in tools.SWITCHES:
        monkeypatch.delenv(switch, raising=False)


@pytest.fixture(params=[("TALLY_REQUIRE_TOOLS", "1"), ("TALLY_REQUIRE_CONTAINERS", "1")])
def strict(relaxed: None, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """Each switch in turn; the name of the one set."""
    monkeypatch.setenv(*request.param)
    return request.param[0]


def test_a_tool_that_is_there_is_found_by_its_path(relaxed, tmp_path: Path) -> None:
    program = tmp_path / "frobnicate"
    program.write_text("#!/bin/sh\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    assert tools.require("frobnicate", "it frobnicates", search=tmp_path) == str(program)
    assert tools.require_module("tomllib", "the standard library") is sys.modules["tomllib"]


def test_a_missing_tool_skips_with_its_reason(relaxed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(pytest.skip.Exception, match="frobnicate is not installed: it frobnicates"):
        tools.require("frobnicate", "it frobnicates", search=tmp_path)
    with pytest.raises(pytest.skip.Exception, match="no_such_module is not installed: the test extra"):
        tools.require_module("no_such_module", "the test extra")
    monkeypatch.setenv("TALLY_REQUIRE_TOOLS", "0")  # set, but to "no"
    with pytest.raises(pytest.skip.Exception, match="PostgreSQL is missing"):
        tools.missing("PostgreSQL is missing")


def test_a_missing_tool_fails_where_tools_are_required(strict: str, tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match=f"frobnicate is not installed: it frobnicates .{strict} is set"):
        tools.require("frobnicate", "it frobnicates", search=tmp_path)
    with pytest.raises(pytest.fail.Exception, match="no_such_module is not installed"):
        tools.require_module("no_such_module", "the test extra")


def test_a_marked_test_is_skipped_or_failed_as_it_is_set_up(relaxed, request: pytest.FixtureRequest,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    request.node.add_marker(tools.needs(None))  # nothing missing: the mark does nothing
    pytest_runtest_setup(request.node)
    request.node.add_marker(tools.needs("promtool is not installed"))
    with pytest.raises(pytest.skip.Exception, match="promtool is not installed"):
        pytest_runtest_setup(request.node)
    monkeypatch.setenv("TALLY_REQUIRE_TOOLS", "1")
    with pytest.raises(pytest.fail.Exception, match="promtool is not installed"):
        pytest_runtest_setup(request.node)

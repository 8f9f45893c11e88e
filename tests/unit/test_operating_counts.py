"""docs/operating.md explains every count a healthy run shows: the fleet's line (`tally fleet`, the
demo's live line), the demo's closing line and `tally client`'s summary."""

from __future__ import annotations

import re
from pathlib import Path

from tally.client.device import DeviceStats
from tally.client.device_progress import summary
from tally.loadtest.fleet import FleetStats

PAGE = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()


def _explained() -> str:
    """The first column of the table under the healthy-run heading."""
    section = PAGE.split("## What the counts of a healthy run mean", 1)[1].split("\n## ", 1)[0]
    return " ".join(line.split("|")[1] for line in section.splitlines() if line.startswith("| `"))


def test_every_count_of_the_fleet_line_is_explained():
    stats = FleetStats.collect([DeviceStats("d", checkins=1, tasks_done=1, sessions_completed=1,
                                            refusal="PERMISSION_DENIED: revoked")], "", 1.0)
    labels = re.findall(r"([a-z][a-z ]*?) \d", stats.summary())  # "tasks 1 · sessions ok 1 aborted 0 ..."
    assert {"tasks", "sessions ok", "aborted", "dropouts", "up", "down", "refused"} <= set(labels), labels
    explained = _explained()
    assert [label for label in labels if f"`{label}`" not in explained] == []


def test_the_demo_line_and_the_client_summary_are_explained():
    explained = _explained()
    for label in ("sessions summed", "dropouts handled", "retried call(s)"):
        assert f"`{label}`" in explained, label
    assert "retried call(s)" in summary(DeviceStats("d"))
    assert "Over-selection surplus is not an abort" in PAGE and "Internal error from Core" in PAGE

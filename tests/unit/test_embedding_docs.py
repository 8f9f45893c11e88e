"""The embedding guide documents the whole of the API an application touches: every argument of
``Device``, every field of ``DeviceStats``, ``tally.client.__all__``, what ``run`` does with no
job, how an application learns that a job ended, credentials from Python and a lost identity key."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import tally.client
from tally.client.device import Device, DeviceStats

GUIDE = (Path(__file__).resolve().parents[2] / "docs" / "embedding.md").read_text()


def _table_after(heading: str) -> str:
    """The first Markdown table under ``heading``."""
    section = GUIDE.split(heading, 1)[1]
    rows = re.search(r"(?m)^\|.*\n(?:\|.*\n)+", section)
    assert rows is not None, heading
    return rows.group(0)


def _names_in_first_column(table: str) -> set[str]:
    return {name for line in table.splitlines() for name in re.findall(r"`(\w+)`", line.split("|")[1])}


def test_every_argument_of_device_is_in_the_arguments_table():
    arguments = set(inspect.signature(Device.__init__).parameters) - {"self"}
    missing = arguments - _names_in_first_column(_table_after("### `Device` arguments"))
    assert not missing, f"document these Device arguments in docs/embedding.md: {sorted(missing)}"


def test_every_field_of_device_stats_is_in_its_table():
    fields = {f.name for f in dataclasses.fields(DeviceStats)}
    missing = fields - _names_in_first_column(_table_after("### `DeviceStats`"))
    assert not missing, f"document these DeviceStats fields in docs/embedding.md: {sorted(missing)}"


def test_the_guide_answers_what_an_application_asks():
    for heading in ("### What `device.run()` does when there is no job",
                    "### How an application learns that a job ended",
                    "### Device credentials from Python", "### A lost identity key"):
        assert heading in GUIDE, heading
    assert "round_status(" in GUIDE and "job_state" in GUIDE
    for name in tally.client.__all__:  # the package's public names resolve and are its documented surface
        assert getattr(tally.client, name) is not None, name

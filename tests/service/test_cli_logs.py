"""Log lines carry ISO-8601 UTC times, not seconds since the epoch (issue 9, item 10)."""

from __future__ import annotations

import json
import logging
from datetime import datetime

from hypothesis import given
from hypothesis import strategies as st

from tally import logs


@given(st.floats(min_value=0, max_value=4_102_444_800, allow_nan=False))  # up to 2100
def test_a_log_line_time_is_iso_8601_utc_to_the_millisecond(created):
    record = logging.LogRecord("tally.test", logging.INFO, __file__, 1, "round committed", None, None)
    record.created = created
    record.fields = {"job_id": "j"}
    entry = json.loads(logs.JsonFormatter().format(record))
    assert entry["ts"].endswith("Z") and entry["event"] == "round committed" and entry["job_id"] == "j"
    parsed = datetime.fromisoformat(entry["ts"].replace("Z", "+00:00"))
    assert abs(parsed.timestamp() - created) < 1.001e-3


def test_lines_written_to_a_log_file_are_neither_cut_nor_wrapped(tmp_path):
    """Issue 25, item 7: off a terminal rich assumed 80 columns, so the fleet's progress line was
    cut and the demo's summary wrapped mid-number in a log file. Both go to files whole now."""
    import os
    import subprocess
    import sys

    from tally.loadtest.fleet import FleetStats

    stats = FleetStats(devices=10_000, checkins=987_654, tasks_done=123_456, sessions_completed=120_000,
                       sessions_aborted=12, dropouts=3_456, bytes_up=12 << 30, bytes_down=34 << 30, retries=7,
                       clipped_values=0, last_model_version="job/v12", rounds={"job": list(range(1, 13))},
                       elapsed_seconds=3_600.0, jobs=["job"], last_error="", jobs_over=False)
    code = ("from tally.loadtest.fleet import FleetStats, progress_display\n"
            "from tally.cli.console import console\n"
            "c = console()\n"
            f"c.print({'summary: ' + 'x' * 150!r})\n"
            f"with progress_display(True, c, None) as show:\n    show(FleetStats(**{stats.__dict__!r}))\n")
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    with (tmp_path / "out.log").open("w") as log:
        subprocess.run([sys.executable, "-c", code], stdout=log, check=True, env=env, timeout=60)
    lines = (tmp_path / "out.log").read_text().splitlines()
    assert lines[0] == "summary: " + "x" * 150
    progress = [line for line in lines if "fleet" in line]
    assert progress and stats.summary() in progress[-1], lines

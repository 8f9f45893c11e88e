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

"""`tally client` talks (issue 25, item 4): it printed nothing while contributing to 14 rounds.
A real `tally client` process takes part in a secure round beside an in-process fleet, against
the real coordinator and aggregators; its stderr says it connected, how its task ended, and sums
up at the end, while stdout keeps the JSON statistics."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support.stack import in_process, run, spec, trainers
from tally.client.device import DeviceStats
from tally.client.device_progress import DeviceProgress, summary
from tally.security.enrolment import SharedKeyEnrolment
from tally.wire.v1 import common_pb2

REPO = Path(__file__).resolve().parents[2]
FLEET = 11  # and the client: one cohort's selection of 12


def test_a_client_process_says_what_it_does_and_sums_up(tmp_path):
    devices, _ = trainers(FLEET)
    # The selection waits for all 12 (the client process needs seconds to import torch).
    text = spec("talk", 1, cohort=FLEET + 1).replace("checkin: 10", "checkin: 120")

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(text)
            credential = SharedKeyEnrolment(s.coordinator.enrolment_key).credential("default", "cli-device")
            client = [sys.executable, "-m", "tally.cli", "client", "--coordinator", s.target, "--insecure",
                      "--device-id", "cli-device", "--credential", credential.hex(), "--shard", "0", "--shards",
                      "12", "--hidden", "16", "--max-tasks", "1", "--state-dir", str(tmp_path / "client")]
            code, out, err = await s.run_beside_a_fleet(job_id, devices, client, REPO)
            return job_id, s.target, await s.job(job_id), code, out, err

    job_id, target, job, code, out, err = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert code == 0, err
    lines = [line for line in err.splitlines() if line.startswith("tally client: ")]
    assert lines[0] == f"tally client: connected: cli-device checked in at {target}"
    assert f"tally client: task 1: job {job_id} round 1: completed (input summed)" in lines
    assert lines[-1].startswith("tally client: 1 task(s): 1 summed;") and lines[-1].endswith(
        f"last: job {job_id} round 1: completed (input summed)")
    assert json.loads(out)["sessions_completed"] == 1


def test_progress_lines_come_once_per_change():
    lines: list[str] = []
    printed = type("Out", (), {"write": lambda self, text: lines.append(text), "flush": lambda self: None})()
    progress = DeviceProgress("d", "coordinator:7000", printed)
    stats = DeviceStats("d")
    for update in ({"last_error": "Register: UNAVAILABLE"}, {}, {"last_error": "CheckIn: UNAVAILABLE"},
                   {"checkins": 1, "last_error": ""}, {"checkins": 2},
                   {"tasks_done": 1, "last_task": "job j round 1: dropped: dropped"}, {"checkins": 3},
                   {"population_idle": True}, {"population_idle": True, "checkins": 4}):
        for field, value in update.items():
            setattr(stats, field, value)
        progress(stats)
    said = [text.removeprefix("tally client: ").strip() for text in lines if text.strip()]
    assert said == ["retrying: Register: UNAVAILABLE", "retrying: CheckIn: UNAVAILABLE",
                    "connected: d checked in at coordinator:7000", "task 1: job j round 1: dropped: dropped",
                    "no job of this device's population is running; checking in again later"]
    stats.dropouts = 1
    assert summary(stats).startswith("1 task(s): 0 summed, 1 dropped; 0.0 MiB up, 0.0 MiB down; 4 check-in(s)")

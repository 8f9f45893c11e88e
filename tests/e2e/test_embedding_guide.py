"""docs/embedding.md's program, run exactly as written (issue 25, item 8): the embedding story
needed the source. The guide's one Python block is written to a file and run as its own process
against the real coordinator and two aggregators, beside an in-process fleet of eleven; it must
contribute to the round and predict with the committed model through ONNX Runtime."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from support.stack import in_process, run, spec, trainers
from tally.security.enrolment import SharedKeyEnrolment
from tally.wire.v1 import common_pb2

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"
FLEET = 11


def _program() -> str:
    # The complete program is the first block under its heading; later ones are fragments.
    found = re.search(r"```python\n(.*?)```", GUIDE.read_text().split("## The program", 1)[1], re.S)
    assert found is not None, "the guide has a program"
    return found.group(1)


def test_the_guide_program_takes_part_in_a_secure_round_as_written(tmp_path):
    program = tmp_path / "device.py"
    program.write_text(_program())
    devices, _ = trainers(FLEET)
    # One selection of twelve; the program's process needs seconds to import torch.
    text = spec("guide", 1, cohort=FLEET + 1).replace("checkin: 10", "checkin: 120")

    async def main():
        async with in_process().whole_system(tmp_path, tls=True) as s:
            job_id = await s.submit(text)
            credential = SharedKeyEnrolment(s.coordinator.enrolment_key).credential("default", "app-device")
            guide = [sys.executable, str(program), s.target.replace("127.0.0.1", "localhost"),
                     str(tmp_path / "pki" / "device" / "ca.pem"), "app-device", credential.hex(),
                     str(tmp_path / "app-state")]
            code, out, err = await s.run_beside_a_fleet(job_id, devices, guide, tmp_path)
            return job_id, await s.job(job_id), code, out, err

    job_id, job, code, out, err = run(main())
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.message
    assert code == 0, err
    assert f"sessions completed: 1, rounds contributed: [('{job_id}', 1)]" in out, out
    predicted = re.search(r"predicted: \[([\d, ]+)\] true: \[([\d, ]+)\]", out)
    assert predicted and len(predicted.group(1).split(",")) == 5, out
    assert (tmp_path / "app-state" / "identity.key").exists()

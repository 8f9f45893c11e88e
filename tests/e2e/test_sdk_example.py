"""The SDK embedding example runs as written (issue 9, item 9: the README's snippet did not):
``examples/embed_device.py`` as its own process is one device of a cohort with a simulated fleet,
against the real coordinator and aggregators."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from support.stack import HIDDEN, in_process, run, spec, trainers
from tally.security.enrolment import SharedKeyEnrolment
from tally.wire.v1 import common_pb2

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embed_device.py"


def test_the_embedding_example_takes_part_in_a_secure_round(tmp_path):
    fleet_devices, _ = trainers(5)

    async def main():
        async with in_process().whole_system(tmp_path) as s:
            job_id = await s.submit(spec("embedded", 1, cohort=6))
            credential = SharedKeyEnrolment(s.coordinator.enrolment_key).credential("default", "app-1")
            app = await asyncio.create_subprocess_exec(
                sys.executable, str(EXAMPLE), "--coordinator", s.target, "--insecure",
                "--device-id", "app-1", "--credential", credential.hex(),
                "--state-dir", str(tmp_path / "app"), "--hidden", str(HIDDEN), "--shard", "7",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
            try:
                fleet = s.fleet(fleet_devices, seed=1)
                await fleet.run(until=fleet.until_job_done(job_id, every_seconds=0.2))
                fleet.close()
                out, err = await app.communicate()
            finally:  # a test that fails or times out must not leave the application running
                if app.returncode is None:
                    app.kill()
                    await app.wait()
            return await s.job(job_id), app.returncode, out.decode(), err.decode()

    job, code, out, err = run(main())
    assert code == 0, err
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED and job.committed_round == 1
    assert "1 task(s), 1 secure sum(s) completed" in out
    assert "predictions of the latest global model: [" in out
    assert (tmp_path / "app" / "identity.key").stat().st_mode & 0o077 == 0
